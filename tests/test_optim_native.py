"""1-bit LAMB's fused stage-2 loop (optim/_native.c) against the torch path it replaces, and its
instruction-set versions against each other. The optimizer itself is checked against the
reference of docs/algorithm.md with and without the loop in test_optimizers.py."""
import functools
from unittest import mock

import pytest
import torch

from onebitlamb.optim import functional as F
from onebitlamb.optim import native

SIZES = [1, 7, 8, 9, 1000, 4099, 65539]   # ragged tails of every length, and a few long layers
BETA1, BETA2, EPS = 0.9, 0.999, 1e-6


def _buffers(seed: int):
    gen = torch.Generator().manual_seed(seed)
    d = sum(SIZES)
    # layers whose variances differ by orders of magnitude, as in a real model
    level = torch.cat([torch.full((n,), 10.0 ** -(i % 5)) for i, n in enumerate(SIZES)])
    v_frozen = level * torch.rand(d, generator=gen) ** 4
    v_frozen[::97] = 0.0                               # never-updated elements: den = eps
    v_fresh = v_frozen * 2 * torch.rand(d, generator=gen)
    m = level.sqrt() * torch.randn(d, generator=gen)
    m_prev = level.sqrt() * torch.randn(d, generator=gen)
    offsets = [0]
    for n in SIZES:
        offsets.append(offsets[-1] + n)
    return v_fresh, m, m_prev, v_frozen.sqrt() + EPS, offsets


def _run(path: str, seed: int = 0, bc1: float = 0.3, bc2: float = 0.02):
    """``functional.fresh_variance_statistics_`` on fresh buffers, through the torch fallback
    (``path="torch"``) or the compiled loop forced to one instruction set."""
    v, m, m_prev, den, offsets = _buffers(seed)
    update = torch.empty_like(m)
    slices = [slice(offsets[i], offsets[i + 1]) for i in range(len(SIZES))]
    if path == "torch":
        patch = mock.patch.object(native, "usable", lambda *tensors: None)
    else:
        patch = mock.patch.object(native, "fresh_variance_stats_",
                                  functools.partial(native.fresh_variance_stats_, isa=path))
    with patch:
        max_ratio, norms = F.fresh_variance_statistics_(v, m, m_prev, den, torch.reciprocal(den), bc1, bc2, BETA1,
                                                        BETA2, EPS, slices, torch.tensor(offsets), update,
                                                        scratch=torch.empty_like(m))
    return v, update, max_ratio, norms


def _available_isas():
    if native.LIBRARY.load() is None:
        pytest.skip(f"compiled loop unavailable: {native.LIBRARY.unavailable_reason}")
    found = []
    for isa in ("scalar", "sse2", "avx2"):
        try:
            _run(isa)
            found.append(isa)
        except ValueError:
            pass
    return found


def _float64_truth(seed: int = 0, bc1: float = 0.3, bc2: float = 0.02):
    """The same statistics in float64, written from docs/algorithm.md, and the size of the float32
    rounding that the reconstructed gradient ``m - beta1 m_prev`` can amplify by cancellation."""
    v, m, m_prev, den, offsets = (t.double() if torch.is_tensor(t) else t for t in _buffers(seed))
    g = (m - BETA1 * m_prev) / (1 - BETA1)
    v = BETA2 * v + (1 - BETA2) * g * g
    update = m / bc1 / den
    slices = [slice(offsets[i], offsets[i + 1]) for i in range(len(SIZES))]
    ratio = den / ((v / bc2).sqrt() + EPS)
    max_ratio = torch.stack([ratio[s].max() for s in slices])
    norms = torch.stack([update[s].norm() for s in slices])
    cancellation = (1 - BETA2) * ((m.abs() + BETA1 * m_prev.abs()) / (1 - BETA1)) ** 2
    return (v, update, max_ratio, norms), cancellation


def test_fused_loop_and_torch_path_match_float64():
    truth, cancellation = _float64_truth()
    for path in ["torch"] + _available_isas():
        v, update, max_ratio, norms = (t.double() for t in _run(path))
        assert ((v - truth[0]).abs() <= 1e-6 * truth[0] + 1e-6 * cancellation).all(), f"{path}: fresh variance"
        assert torch.allclose(update, truth[1], rtol=1e-6, atol=0), f"{path}: update"
        assert torch.allclose(norms, truth[3], rtol=1e-6, atol=0), f"{path}: update norms"
        assert torch.allclose(max_ratio, truth[2], rtol=1e-6, atol=0), f"{path}: max ratio"


def test_instruction_sets_give_identical_bits():
    """Ranks on machines with and without AVX2 must not drift apart."""
    isas = _available_isas()
    first = _run(isas[0], seed=3)
    for isa in isas[1:]:
        for a, b in zip(first, _run(isa, seed=3)):
            assert torch.equal(a, b), isa


def test_unknown_instruction_set_is_an_error():
    lib = native.LIBRARY.load()
    if lib is None:
        pytest.skip(native.LIBRARY.unavailable_reason)
    v, m, m_prev, den, offsets = _buffers(0)
    with pytest.raises(KeyError):
        native.fresh_variance_stats_(lib, v, m, m_prev, den, torch.empty_like(m),
                                     torch.tensor(offsets), BETA1, BETA2, 1.0, 0.0, 1.0, isa="neon")


def test_functional_uses_the_loop_only_for_contiguous_float32_cpu():
    v, m, m_prev, den, offsets = _buffers(0)
    assert (native.usable(v, m) is None) == (native.LIBRARY.load() is None)
    assert native.usable(v, m.double()) is None
    assert native.usable(v, m[::2]) is None
