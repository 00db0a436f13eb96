"""The fused Triton codec (``compression.triton_codec``) against the plain-torch path, on CPU
tensors under Triton's interpreter (the checks are tests/codec_checks.py's; tests/test_cuda.py runs
them compiled on a GPU, so this module is skipped there, and where Triton is not installed)."""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    # read when the kernels are decorated, on triton_codec's first import (the dispatch imports
    # it lazily, and nothing imports it for CPU tensors unless asked to, as here)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="Triton is not installed (pip install '.[gpu]' in a checkout, or triton as pinned "
                                     "in requirements-dev.txt)")

from codec_checks import (DTYPES, bits, check_compress, check_pack_and_unpack,  # noqa: E402
                          check_server_sum_and_expansion, inputs)
from rank_pool import run_ranks  # noqa: E402
from onebitlamb.compression.packing import pack_signs, unpack_signs  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: tests/test_cuda.py "
                                                                  "checks the compiled kernels there")

SIZES = [1, 13, 4103]  # odd sizes; the last spans two programs of 4096 elements and ends mid-byte


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compress_matches_torch_path(dtype):
    for n in SIZES:
        e, b = inputs(n, dtype, n, "cpu")
        check_compress(e, b)
        check_compress(e, None)  # the server's case: no addend
    zeros = torch.zeros(SIZES[-1], dtype=dtype)
    scale, error = check_compress(zeros, -zeros)  # 0 + -0 = 0: scale 0, error stays +0
    assert scale == 0.0 and torch.equal(bits(error), bits(zeros))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # float16 holds neither
@pytest.mark.parametrize("magnitude", [1e-30, 1e30])
def test_compress_extreme_magnitudes(dtype, magnitude):
    """Squares of 1e-30 underflow float32 and of 1e30 overflow it: the torch path's scale is then 0
    or infinity; the fused one, summed in float64, stays within 1 ulp of the exact scale."""
    n = SIZES[-1]
    e = (magnitude * torch.randn(n, generator=torch.Generator().manual_seed(7))).to(dtype)
    scale, _ = check_compress(e, None)
    assert 0 < scale < math.inf
    # every element of magnitude s: each error is exactly 0 (a tie of |y| and the scale)
    same = torch.where(torch.arange(n) % 3 == 0, -magnitude, magnitude).to(dtype)
    scale, error = check_compress(same, None)
    assert scale == float(same[1]) and not error.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_server_sum_and_expansion_match_torch_path(dtype):
    check_server_sum_and_expansion(dtype, 8 * 513, "cpu")  # rows of 513 bytes: two programs, one nearly empty


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_and_unpack_match_the_other_paths(dtype):
    check_pack_and_unpack(dtype, SIZES[-1], "cpu")


def test_fused_true_says_why_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        pack_signs(torch.ones(8), fused=True)
    from onebitlamb.compression import packing

    monkeypatch.setitem(packing._FUSED, "module", None)
    monkeypatch.setitem(packing._FUSED, "reason", "triton cannot be imported (ImportError: none here)")
    with pytest.raises(ValueError, match=r"none here.*the gpu extra: pip install '\.\[gpu\]'"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 8, fused=True)


def _allreduce_worker(rank, world):
    """The same calls with each codec: both error pairs evolve over the calls."""
    from onebitlamb.comm import CommStats, compressed_allreduce, padded_size

    D = padded_size(5000, world)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(D, generator=g) for _ in range(3)]
    out = {}
    for fused in (False, True):
        we, se = torch.zeros(D), torch.zeros(D // world)
        out[fused] = [compressed_allreduce(x.clone(), we, se, stats=CommStats(), fused=fused) for x in xs]
        out[fused, "errors"] = (we, se)
    return out


def test_compressed_allreduce_fused_on_two_ranks():
    results = run_ranks(_allreduce_worker, 2, timeout_s=120)
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


def test_kernel_benchmark_measures_both_codecs(monkeypatch):
    """The GPU section's code path (benchmarks/kernels.py --device cuda), run on CPU tensors; a
    fused codec that fails leaves the torch path's figures and says why."""
    from benchmarks import kernels

    numel = 8 * 4 * 512
    measured, missing = kernels.device_kernels("cpu", [numel], repeats=1, min_total_s=0.0)
    assert missing is None and set(measured) == {"torch", "fused"}
    assert all(t[k] > 0 for codec in measured.values() for t in codec.values() for k in ("copy", "whole"))
    body = kernels.render_device(measured, "cmd", 1, "cpu", missing)
    assert "### Plain torch (`fused=False`)" in body and "| 16K |" in body
    assert "- 16K: compress " in body and "target <= 2x" in body and "floor 2.50x" in body

    measure = kernels.kernel_times

    def failing(*args, fused=None):
        if fused:
            raise RuntimeError("no kernel today")
        return measure(*args, fused=fused)

    monkeypatch.setattr(kernels, "kernel_times", failing)
    measured, missing = kernels.device_kernels("cpu", [numel], repeats=1, min_total_s=0.0)
    assert set(measured) == {"torch"} and "no kernel today" in missing
    assert "Not measured: the fused kernels failed at 16K" in kernels.render_device(measured, "cmd", 1, "cpu", missing)
