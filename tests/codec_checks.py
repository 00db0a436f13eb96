"""Checks of the fused Triton codec against the plain-torch path, on any device: under Triton's
interpreter on CPU tensors (tests/test_triton_codec.py) and compiled on a GPU (tests/test_cuda.py).
What they check is what ``compression.triton_codec``'s docstring states: the same bits for packed
signs, server sums, expansions and (given the scale) error updates; the scale within 1 float32
ulp of the float64 one."""
import math

import torch

from onebitlamb.compression.onebit import add_signs_, add_signs_bits_, compress_, compress_torch_
from onebitlamb.compression.packing import expand_bits, pack_signs, unpack_signs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = 2.0 ** -23  # float32's relative spacing: the fused scale's bound


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 and 0.0 (and NaNs) compare as what they are."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def inputs(n: int, dtype: torch.dtype, seed: int, device: str):
    """An error and an addend with zeros, -0.0 (which packs as +1), and sums that fall exactly
    half-way between two values of the dtype (round to even takes one down, the other up)."""
    g = torch.Generator().manual_seed(seed)
    e, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    eps = torch.finfo(dtype).eps
    e[::5], b[::5] = 0.0, 0.0
    e[1::7], b[1::7] = -0.0, -0.0
    e[2::11], b[2::11] = 1.0, eps / 2        # tie, rounds down to 1
    e[3::11], b[3::11] = 1.0 + eps, eps / 2  # tie, rounds up to 1 + 2 eps (even)
    return e.to(device), b.to(device)


def exact_scale(y: torch.Tensor) -> float:
    return math.sqrt(float((y.double() ** 2).sum()) / y.numel())


def check_compress(e: torch.Tensor, b):
    """One compression both ways; returns the fused scale and error."""
    n = e.numel()
    y = e.clone() if b is None else e.clone().add_(b)  # what both paths compress
    e_torch, e_fused = e.clone(), e.clone()
    p_torch = torch.empty((n + 7) // 8, dtype=torch.uint8, device=e.device)
    p_fused = torch.full_like(p_torch, 0xAA)
    s_torch = float(compress_torch_(e_torch, b, p_torch, torch.empty(n, dtype=torch.bool, device=e.device)))
    s_fused = compress_(e_fused, b, p_fused, {}, fused=True)
    assert s_fused.dtype == torch.float32 and s_fused.shape == (1,) and s_fused.device == e.device
    assert torch.equal(p_fused, p_torch)
    exact = exact_scale(y)
    assert abs(float(s_fused) - exact) <= ULP * exact
    # given its scale, the update is the torch path's formula bit for bit
    s = s_fused.to(e.dtype)
    assert torch.equal(bits(e_fused), bits(y - torch.where(y < 0, -s, s)))
    if math.isfinite(s_torch) and s_torch > 0:  # float32 squares neither overflowed nor underflowed
        assert abs(float(s_fused) - s_torch) <= 1e-5 * s_torch
    return float(s_fused), e_fused


def check_server_sum_and_expansion(dtype: torch.dtype, chunk: int, device: str) -> None:
    """The server's sum over 3 ranks' strided messages, its scale from the sum's partial norms,
    and the expansion of every row in one launch, against the torch path."""
    ranks = 3
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (ranks, chunk // 8 + 4), generator=g, dtype=torch.uint8).to(device)
    scales = (torch.tensor([0.5, 1e-30, 3.0]) / ranks).to(device)  # 1e-30: 0 in float16, added as ±0
    target = torch.randn(chunk, generator=g).to(dtype).to(device)
    expected, got = target.clone(), target.clone()
    add_signs_bits_(expected, rows[:, :-4], scales)
    partials = add_signs_(got, rows[:, :-4], scales, fused=True)
    assert torch.equal(bits(got), bits(expected))
    packed = torch.empty(chunk // 8, dtype=torch.uint8, device=device)
    scale = compress_(got, None, packed, {}, partials, fused=True)
    exact = exact_scale(expected)
    assert abs(float(scale) - exact) <= ULP * exact
    assert torch.equal(packed, pack_signs(expected, fused=False))

    from onebitlamb.compression import triton_codec

    out = torch.empty(ranks * chunk, dtype=dtype, device=device)
    triton_codec.expand_(rows, scales, out, chunk)
    for i in range(ranks):
        want = torch.empty(chunk, dtype=dtype, device=device)
        expand_bits(rows[i, :-4], scales[i], want)
        assert torch.equal(bits(out[i * chunk:(i + 1) * chunk]), bits(want))


def check_pack_and_unpack(dtype: torch.dtype, n: int, device: str) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, float("nan"), -float("inf")])
    x = x.to(device)
    packed = pack_signs(x, fused=True)
    assert torch.equal(packed, pack_signs(x, fused=False))
    for scale in (0.375, torch.tensor(1 / 3, dtype=torch.float64, device=device)):  # cast as torch casts it
        assert torch.equal(bits(unpack_signs(packed, n, scale, dtype=dtype, fused=True)),
                           bits(unpack_signs(packed, n, scale, dtype=dtype, fused=False)))
