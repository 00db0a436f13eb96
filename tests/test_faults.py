"""Tests that fail when the code breaks: bugs planted
one at a time in the core that the rest of the suite let through. Each test here checks values
against a reference written outside the library (tests/reference.py, or an oracle in this file),
and was seen to fail with its bug planted:

- 1-bit LAMB's factor bounds (``factor_min``/``factor_max``) removed: the reference comparison of
  test_optimizers.py never reaches them, so here they bind, and the test shows that they do;
- the momentum mask dropped after the decompression on several ranks: elements that never get a
  gradient, on 2 gloo ranks, across the freeze;
- the fp16/bf16 compressor's error feedback: call after call against a float64 oracle.

The two others of the list live beside their neighbours: the compiled sums of squares in
test_packing.py (``test_compiled_sums_of_squares_are_taken_in_double``), and the environment of
``test_compiled_loops_can_be_turned_off`` there too.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import onebitlamb
from rank_pool import run_ranks
from onebitlamb.compression import onebit
from onebitlamb.compression.packing import unpack_signs
from reference import Reference

from toy import SHAPES, SCALES, grads_for, initial_params  # noqa: E402,F401
LRS = [0.02, 0.01, 0.02, 0.05]
WDS = [0.01, 0.0, 0.01, 0.01]



def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def groups_of(params, lrs, wds):
    return [{"params": [p], "lr": lr, "weight_decay": wd} for p, lr, wd in zip(params, lrs, wds)]


# ------------------------------------------------------------------ 1. the factor bounds
# (name, factor_min, factor_max, betas, steps, gradient multiplier after the freeze, bound that binds)
FACTOR_CASES = [
    # tight bounds, the gradients of test_optimizers.py: the factor rises to 1.37 there, so 1.1 binds
    ("tight-upper", 0.9, 1.1, (0.9, 0.999), 60, 1.0, "max"),
    # gradients 3x larger after the freeze: the fresh variance outgrows the frozen one, 0.9 binds
    ("tight-lower", 0.9, 1.1, (0.9, 0.999), 60, 3.0, "min"),
    # the default bounds [0.5, 4], with a shorter variance memory and a longer compression stage
    ("default-lower", 0.5, 4.0, (0.9, 0.99), 200, 4.0, "min"),
    ("default-upper", 0.5, 4.0, (0.9, 0.99), 200, 0.1, "max"),
]


@pytest.mark.parametrize("name,fmin,fmax,betas,steps,after,binds", FACTOR_CASES, ids=[c[0] for c in FACTOR_CASES])
def test_factor_bounds_bind_and_match_the_reference(name, fmin, fmax, betas, steps, after, binds):
    """1-bit LAMB against the reference step by step where the factor's bounds bind: the factor sits
    exactly on the bound at some steps, and the reference without the bounds ends far from the one
    with them, so an optimizer that ignored the bounds could not match."""
    freeze = 20

    def grads(params, t):
        return [g * (after if t > freeze else 1.0) for g in grads_for(params, 0, t)]

    params = [torch.nn.Parameter(t) for t in initial_params()]
    opt = onebitlamb.OneBitLamb(groups_of(params, LRS, WDS), lr=LRS[0], betas=betas, freeze_step=freeze,
                                factor_min=fmin, factor_max=fmax)
    ref = Reference(initial_params(), "onebitlamb", LRS, WDS, freeze_step=freeze, betas=betas,
                    factor_min=fmin, factor_max=fmax, bound_direction=True)
    unbounded = Reference(initial_params(), "onebitlamb", LRS, WDS, freeze_step=freeze, betas=betas,
                          factor_min=0.0, factor_max=math.inf, bound_direction=True)
    bound = torch.tensor(fmin if binds == "min" else fmax, dtype=torch.float32)
    on_bound = 0
    for t in range(1, steps + 1):
        for p, g in zip(params, grads(params, t)):
            p.grad = g
        opt.step()
        ref.step([grads(ref.x, t)])
        unbounded.step([grads(unbounded.x, t)])
        for layer, (p, x) in enumerate(zip(params, ref.x)):
            assert rel_err(p.detach(), x) < 2e-6, f"step {t}, layer {layer}"   # measured: 2.1e-7 at most
        if t > freeze:
            factors = torch.tensor([d["factor"] for d in opt.layer_diagnostics()])
            assert (factors >= fmin).all() and (factors <= fmax).all(), (t, factors)
            on_bound += int((factors == bound).sum())
    assert on_bound > 0, f"the factor never reached factor_{binds}"
    # not vacuous: without the bounds the trajectory is another one, far beyond the tolerance above
    apart = max(rel_err(a, b) for a, b in zip(unbounded.x, ref.x))
    assert apart > 1e-3, apart


# ------------------------------------------------------------------ 2. the momentum mask on 2 ranks
PARTLY = (6, 4)   # a parameter whose rows 3-5 never get a gradient, on any rank
MASK_SHAPES = SHAPES + [PARTLY]
MASK_SCALES = SCALES + [1.0]
MASK_LRS = LRS + [0.02]
MASK_WDS = [0.01, 0.0, 0.01, 0.0, 0.0]   # no decay on the partly trained parameter: nothing may move it


def mask_grads(params, rank, step):
    grads = grads_for(params, rank, step, MASK_SCALES)
    grads[-1][3:] = 0.0
    return grads


def _masked_rows_run(rank, n, steps, freeze, space):
    params = [torch.nn.Parameter(t) for t in initial_params(MASK_SHAPES)]
    opt = onebitlamb.OneBitLamb(groups_of(params, MASK_LRS, MASK_WDS), lr=MASK_LRS[0], freeze_step=freeze,
                                compression_space=space)
    history, stages = [], []
    for t in range(1, steps + 1):
        for p, g in zip(params, mask_grads(params, rank, t)):
            p.grad = g
        stages.append(opt.stage)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return {"history": history, "stages": stages, "mask": opt.state["flat"]["momentum_mask"].clone()}


@pytest.mark.parametrize("space", ["momentum", "update"])
def test_rows_without_gradient_never_move_on_two_ranks(space):
    """On several ranks the compressed all-reduce hands every element, those without a gradient
    too, a value of +-scale; the mask must zero them, or with a frozen variance of 0 (denominator
    eps) they jump (by 6.3e5 when this was found; in the update space the scale is divided by that eps).
    Both ranks, every step: those rows exactly as they started, the rest as the reference's
    simulation of the 2 workers."""
    n, steps, freeze = 2, 30, 10
    out = run_ranks(_masked_rows_run, n, (steps, freeze, space), timeout_s=120)
    assert out[0]["stages"] == ["warmup"] * freeze + ["compression"] * (steps - freeze)
    start = initial_params(MASK_SHAPES)
    ref = Reference(initial_params(MASK_SHAPES), "onebitlamb", MASK_LRS, MASK_WDS, freeze_step=freeze, n=n,
                    compression_space=space, bound_direction=True)
    numel = sum(math.prod(s) for s in SHAPES)
    # the mask covers exactly the rows without a gradient (the trained elements all have one)
    mask = out[0]["mask"]
    assert mask[:numel].all() and mask[numel:].view(PARTLY)[:3].all() and not mask[numel:].view(PARTLY)[3:].any()
    for t in range(1, steps + 1):
        ref.step([mask_grads(ref.x, r, t) for r in range(n)])
        for r in range(n):
            got = out[r]["history"][t - 1]
            assert torch.equal(got[-1][3:], start[-1][3:]), f"rank {r}, step {t}: rows without a gradient moved"
            assert torch.equal(ref.x[-1][3:], start[-1][3:])
            for layer, (a, x) in enumerate(zip(got[:-1], ref.x[:-1])):   # measured: 2.7e-7 at most
                assert rel_err(a, x) < 3e-6, f"rank {r}, step {t}, layer {layer}"
            assert rel_err(got[-1][:3], ref.x[-1][:3]) < 3e-6, f"rank {r}, step {t}: the trained rows"
    assert not torch.equal(out[0]["history"][-1][-1][:3], start[-1][:3])  # the trained rows did move


# ------------------------------------------------------------------ 5. fp16/bf16 error feedback
HALF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}   # unit roundoff of each dtype
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _sign64(y):
    """+1 where y >= 0 (so sign(0) = sign(-0.0) = +1), -1 where y < 0."""
    return torch.where(y < 0, -torch.ones_like(y), torch.ones_like(y))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(HALF), ids=["fp16", "bf16"])
def test_half_precision_compressor_error_feedback_against_float64(dtype, device):
    """The compressor of fp16/bf16 buffers (the plain-torch path, on CPU too) over successive calls.
    Each call against a float64 oracle fed the library's own error: ``y = e + b``, one scale
    ``||y|| / sqrt(D)``, signs with sign(0) = +1, ``e = y - scale sign(y)``; packed bits, scale,
    decompressed values and the new error within the dtype's rounding. Over all calls the error
    feedback's bookkeeping: what was sent plus the error left equals what was given."""
    u = HALF[dtype]
    D, calls = 1024, 8
    gen = torch.Generator().manual_seed(11)
    error = torch.zeros(D, dtype=dtype, device=device)
    packed = torch.empty(D // 8, dtype=torch.uint8, device=device)
    workspace = {}
    sent = torch.zeros(D, dtype=torch.float64)
    given = torch.zeros(D, dtype=torch.float64)
    budget = torch.zeros(D, dtype=torch.float64)    # the roundings allowed so far, per element
    worst_error = 0.0
    for t in range(calls):
        b = (torch.randn(D, generator=gen) * (0.5 + t % 3)).to(dtype)
        b[t::97] = 0.0                              # exact zeros in the data
        if t > 0:
            b[5::61] = -error[5::61].cpu()          # y exactly 0 there: sign +1
        b = b.to(device)
        e64 = error.double().cpu()
        b64 = b.double().cpu()
        # the oracle, in float64
        y = e64 + b64
        s = float(y.norm()) / math.sqrt(D)
        q = _sign64(y)
        e_new = y - s * q
        # the library
        scale = onebit.compress_(error, b, packed, workspace)
        out = unpack_signs(packed, D, scale, dtype=dtype)
        assert error.dtype == dtype and out.dtype == dtype
        bits = 1 - 2 * torch.from_numpy(np.unpackbits(packed.cpu().numpy()).astype(np.float64))
        assert torch.equal(bits, q), f"call {t}: signs"
        assert float(scale) == pytest.approx(s, rel=1.5 * u), f"call {t}: scale"
        assert torch.allclose(out.double().cpu(), s * q, rtol=2.5 * u, atol=0), f"call {t}: decompressed"
        # the rounding of y, of the scale and of the subtraction, each at most u of its operand
        tol = 2.5 * u * (y.abs() + s)
        assert ((error.double().cpu() - e_new).abs() <= tol).all(), f"call {t}: error feedback"
        sent += out.double().cpu()
        given += b64
        budget += tol
        worst_error = max(worst_error, float(e_new.abs().max()) / s)
    assert worst_error > 0.5   # the error carried is no rounding detail: the feedback matters
    # sum of what was sent + the error left = sum of what was given, up to each call's rounding
    assert ((sent + error.double().cpu() - given).abs() <= budget).all()
