"""The experiment of 1-bit LAMB with local steps (``benchmarks/local_lamb.py``) against a reference
composed of the two written from docs/algorithm.md (``tests/reference.py``): 1-bit LAMB's warm-up
and freeze, then 0/1 Adam's local steps and syncs with each layer's step size ``lr * c``, ``c`` the
trust ratio frozen at the freeze; on 2 gloo ranks."""
from __future__ import annotations

import functools
import math

import torch

from onebitlamb.comm.launch import spawn_local
from onebitlamb.train import loop
from reference import OneBitAllReduceSim, Reference, ZeroOneReference
from toy import grads_for, initial_params

LRS = [0.02, 0.01, 0.02, 0.05]
WDS = [0.01, 0.0, 0.01, 0.0]
FREEZE, SCALER, CLIPPER, STEPS = 8, 3, 4, 24
# after the freeze at 8: syncs at 9-11 (interval 1), 12, 14 (2), 16, 20, 24 (4, the clipper)
SYNCS = {9, 10, 11, 12, 14, 16, 20, 24}


def _run(rank: int, n: int) -> list:
    from benchmarks.local_lamb import LocalStepOneBitLamb

    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    groups = [{"params": [p], "lr": lr, "weight_decay": wd} for p, lr, wd in zip(params, LRS, WDS)]
    # the experiment as it was measured: the paper's unbounded stage 2, as its reference composes it
    opt = LocalStepOneBitLamb(groups, lr=LRS[0], freeze_step=FREEZE, total_steps=STEPS, local_step_scaler=SCALER,
                              local_step_clipper=CLIPPER, bound_direction=False)
    history = []
    for t in range(1, STEPS + 1):
        for p, g in zip(params, grads_for(params, rank, t)):
            p.grad = g
        stage = opt.stage
        opt.step()
        history.append((stage, [p.detach().clone() for p in params]))
    return history


@functools.lru_cache(maxsize=None)
def _spawned(n: int):
    return spawn_local(_run, n, (), timeout_s=180)


def _reference(n: int) -> list:
    """Each worker's parameters after every step: ``Reference`` (1-bit LAMB) through the freeze,
    then ``ZeroOneReference``'s phase after its freeze, started from that state."""
    lamb = Reference(initial_params(), "onebitlamb", LRS, WDS, freeze_step=FREEZE, n=n, compression_space="update")
    out = []
    for t in range(1, FREEZE + 1):
        lamb.step([grads_for(lamb.x, r, t) for r in range(n)])
        out.append([[x.clone() for x in lamb.x] for _ in range(n)])
    rates = [lr * c for lr, c in zip(LRS, lamb.c_frz)]
    local = ZeroOneReference(lamb.x, rates, WDS, n=n, var_freeze_step=FREEZE, var_update_scaler=1,
                             local_step_scaler=SCALER, local_step_clipper=CLIPPER)
    den = [torch.sqrt(v) + lamb.eps for v in lamb.v_frozen]
    numels = [x.numel() for x in lamb.x]
    local.t, local.frozen, local.den, local.mask = FREEZE, True, den, lamb.mask
    local.k = local._scales([float((m / d).norm()) * rate for m, d, rate in zip(lamb.m, den, rates)], numels)
    local.sim = OneBitAllReduceSim(n, local.D)  # the errors restart
    local.x = [[x.clone() for x in lamb.x] for _ in range(n)]
    local.m = [[m.clone() for m in lamb.m] for _ in range(n)]
    local.x_sync = [x.clone() for x in lamb.x]
    local.acc = [[torch.zeros_like(x) for x in lamb.x] for _ in range(n)]
    local.lrs = [0.0] * len(rates)
    for t in range(FREEZE + 1, STEPS + 1):
        local.step([grads_for(local.x[r], r, t) for r in range(n)])
        out.append([[x.clone() for x in local.x[r]] for r in range(n)])
    return out


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def test_local_steps_after_the_freeze_match_the_composed_reference():
    n = 2
    out, ref = _spawned(n), _reference(n)
    stages = [stage for stage, _ in out[0]]
    assert stages == ["warmup"] * FREEZE + ["compression" if t in SYNCS else "local"
                                            for t in range(FREEZE + 1, STEPS + 1)]
    for t in range(STEPS):
        for r in range(n):
            for a, x in zip(out[r][t][1], ref[t][r]):
                assert rel_err(a, x) < 1e-5, f"rank {r}, step {t + 1} ({stages[t]})"
        # the ranks part at local steps and are bit for bit alike again after every sync
        same = all(torch.equal(a, b) for a, b in zip(out[0][t][1], out[1][t][1]))
        assert same == (stages[t] != "local"), f"step {t + 1} ({stages[t]})"
    # the local steps moved the parameters: the experiment is not 1-bit LAMB's stage 2 under another name
    assert not math.isclose(float(out[0][FREEZE + 4][1][0].sum()), float(out[1][FREEZE + 4][1][0].sum()))


def test_the_substitution_holds_only_in_the_experiments_program():
    """Importing the module leaves the main job's optimizer alone; its command line names the clipper."""
    import benchmarks.local_lamb as experiment

    assert loop.make_optimizer is experiment._library_make_optimizer
    assert experiment._training(["--local-step-clipper", "1", "pretrain", "--preset", "demo"])
    assert experiment._split(["--local-step-clipper", "1", "pretrain"]) == (1, ["pretrain"])
    assert experiment._split(["pretrain"]) == (experiment.LOCAL_STEP_CLIPPER, ["pretrain"])
    assert not experiment._training(["--seeds", "3"])
