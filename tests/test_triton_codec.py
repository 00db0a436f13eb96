"""The fused Triton codec (``compression.triton_codec``) against the plain-torch path, on CPU
tensors under Triton's interpreter: the same bits for packed signs, server sums, expansions and
(given the scale) error updates; the scale within 1 float32 ulp of the float64 one, the bound the
module's docstring derives. tests/test_cuda.py runs the compiled kernels against the same path on
a GPU; this module is skipped there, and where Triton is not installed (``onebitlamb[gpu]``)."""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    # read when the kernels are decorated, on triton_codec's first import (the dispatch imports
    # it lazily, and nothing imports it for CPU tensors unless asked to, as here)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="Triton is not installed (pip install onebitlamb[gpu], or triton as pinned "
                                     "in requirements-dev.txt)")

from onebitlamb.comm.collectives import _add_signs_, _add_signs_bits_, _compress_, _compress_torch_  # noqa: E402
from onebitlamb.comm.launch import spawn_local  # noqa: E402
from onebitlamb.compression.packing import expand_bits, pack_signs, unpack_signs  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: tests/test_cuda.py "
                                                                  "checks the compiled kernels there")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 13, 4103]  # odd sizes; the last spans two programs of 4096 elements and ends mid-byte
ULP = 2.0 ** -23       # float32's relative spacing: the fused scale's bound


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 and 0.0 (and NaNs) compare as what they are."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _inputs(n: int, dtype: torch.dtype, seed: int):
    """An error and an addend with zeros, -0.0 (which packs as +1), and sums that fall exactly
    half-way between two values of the dtype (round to even picks one, the other way the other)."""
    g = torch.Generator().manual_seed(seed)
    e, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    eps = torch.finfo(dtype).eps
    e[::5], b[::5] = 0.0, 0.0
    e[1::7], b[1::7] = -0.0, -0.0
    e[2::11], b[2::11] = 1.0, eps / 2            # tie, rounds down to 1
    e[3::11], b[3::11] = 1.0 + eps, eps / 2       # tie, rounds up to 1 + 2 eps (even)
    return e, b


def _exact_scale(y: torch.Tensor) -> float:
    return math.sqrt(float((y.double() ** 2).sum()) / y.numel())


def _check_compress(e: torch.Tensor, b):
    """One compression both ways, checked as the docstring of triton_codec states."""
    n = e.numel()
    y = e.clone() if b is None else e.clone().add_(b)  # what both paths compress
    e_torch, e_fused = e.clone(), e.clone()
    p_torch = torch.empty((n + 7) // 8, dtype=torch.uint8)
    p_fused = torch.full_like(p_torch, 0xAA)
    s_torch = float(_compress_torch_(e_torch, b, p_torch, torch.empty(n, dtype=torch.bool)))
    s_fused = _compress_(e_fused, b, p_fused, {}, fused=True)
    assert s_fused.dtype == torch.float32 and s_fused.shape == (1,)
    assert torch.equal(p_fused, p_torch)
    exact = _exact_scale(y)
    assert abs(float(s_fused) - exact) <= ULP * exact
    # given its scale, the update is the torch path's formula bit for bit
    s = s_fused.to(e.dtype)
    assert torch.equal(_bits(e_fused), _bits(y - torch.where(y < 0, -s, s)))
    if math.isfinite(s_torch) and s_torch > 0:  # float32 squares neither overflowed nor underflowed
        assert abs(float(s_fused) - s_torch) <= 1e-5 * s_torch
    return float(s_fused), e_fused


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compress_matches_torch_path(dtype):
    for n in SIZES:
        e, b = _inputs(n, dtype, n)
        _check_compress(e, b)
        _check_compress(e, None)  # the server's case: no addend
    zeros = torch.zeros(SIZES[-1], dtype=dtype)
    scale, error = _check_compress(zeros, -zeros)  # 0 + -0 = 0: scale 0, error stays +0
    assert scale == 0.0 and torch.equal(_bits(error), _bits(zeros))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # float16 holds neither
@pytest.mark.parametrize("magnitude", [1e-30, 1e30])
def test_compress_extreme_magnitudes(dtype, magnitude):
    """Squares of 1e-30 underflow float32 and of 1e30 overflow it: the torch path's scale is then 0
    or infinity; the fused one, summed in float64, stays within 1 ulp of the exact scale."""
    n = SIZES[-1]
    g = torch.Generator().manual_seed(7)
    e = (magnitude * torch.randn(n, generator=g)).to(dtype)
    scale, _ = _check_compress(e, None)
    assert 0 < scale < math.inf
    # every element of magnitude s: each error is exactly 0 (a tie of |y| and the scale)
    same = torch.where(torch.arange(n) % 3 == 0, -magnitude, magnitude).to(dtype)
    scale, error = _check_compress(same, None)
    assert scale == float(same[1]) and not error.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_server_sum_and_expansion_match_torch_path(dtype):
    ranks, chunk = 3, 8 * 513  # rows of 513 bytes: two programs, the second nearly empty
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (ranks, chunk // 8 + 4), generator=g, dtype=torch.uint8)  # strided, as messages
    scales = torch.tensor([0.5, 1e-30, 3.0]) / ranks
    target = torch.randn(chunk, generator=g).to(dtype)
    expected, got = target.clone(), target.clone()
    _add_signs_bits_(expected, rows[:, :-4], scales)
    partials = _add_signs_(got, rows[:, :-4], scales, fused=True)
    assert torch.equal(_bits(got), _bits(expected))
    # the partial sums it returns give the server's scale without another pass
    packed = torch.empty(chunk // 8, dtype=torch.uint8)
    scale = _compress_(got, None, packed, {}, partials, fused=True)
    exact = _exact_scale(expected)
    assert abs(float(scale) - exact) <= ULP * exact
    assert torch.equal(packed, pack_signs(expected))

    # the final expansion: every row into its slice, one launch
    from onebitlamb.compression import triton_codec

    out = torch.empty(ranks * chunk, dtype=dtype)
    triton_codec.expand_(rows, scales, out, chunk)
    for i in range(ranks):
        want = torch.empty(chunk, dtype=dtype)
        expand_bits(rows[i, :-4], scales[i], want)
        assert torch.equal(_bits(out[i * chunk:(i + 1) * chunk]), _bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_and_unpack_match_the_other_paths(dtype):
    n = SIZES[-1]
    x = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, float("nan"), -float("inf")])
    packed = pack_signs(x, fused=True)
    assert torch.equal(packed, pack_signs(x, fused=False))
    for scale in (0.375, torch.tensor(1 / 3, dtype=torch.float64)):  # cast to the dtype as torch casts it
        assert torch.equal(_bits(unpack_signs(packed, n, scale, dtype=dtype, fused=True)),
                           _bits(unpack_signs(packed, n, scale, dtype=dtype, fused=False)))


def test_fused_true_says_why_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        pack_signs(torch.ones(8), fused=True)
    from onebitlamb.compression import packing

    monkeypatch.setitem(packing._FUSED, "module", None)
    monkeypatch.setitem(packing._FUSED, "reason", "triton cannot be imported (ImportError: none here)")
    with pytest.raises(ValueError, match="none here.*onebitlamb\\[gpu\\]"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 8, fused=True)


def _allreduce_worker(rank, world):
    """The same calls with each codec: both error pairs evolve over the calls."""
    from onebitlamb.comm import CommStats, compressed_allreduce, padded_size

    D = padded_size(5000, world)
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(D, generator=g) for _ in range(3)]
    out = {}
    for fused in (False, True):
        we, se = torch.zeros(D), torch.zeros(D // world)
        out[fused] = [compressed_allreduce(x.clone(), we, se, stats=CommStats(), fused=fused) for x in inputs]
        out[fused, "errors"] = (we, se)
    return out


def test_compressed_allreduce_fused_on_two_ranks():
    results = spawn_local(_allreduce_worker, 2, timeout_s=120)
    for fused in (False, True):
        for a, b in zip(results[0][fused], results[1][fused]):
            assert torch.equal(a, b)  # every rank expands the same messages
    # the codecs differ in the scales' last bits only, which error feedback carries along
    for torch_out, fused_out in zip(results[0][False], results[0][True]):
        scale = torch_out.abs().max()
        assert ((fused_out - torch_out).abs() <= 1e-5 * scale).float().mean() > 0.999
    for r in results:
        for torch_err, fused_err in zip(r[False, "errors"], r[True, "errors"]):
            assert ((fused_err - torch_err).abs() <= 1e-5).float().mean() > 0.999
