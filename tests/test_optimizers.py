"""The optimizers against the reference of docs/algorithm.md (tests/reference.py), on one process and
on 2 and 4 real gloo ranks; edge cases, checkpoints, hyper-parameter errors, convergence."""
from __future__ import annotations

import copy
import functools
import io
import math

import pytest
import torch
import torch.distributed as dist

import onebitlamb
from rank_pool import run_ranks
from reference import Reference

from toy import SHAPES, SCALES, grads_for, initial_params, through_a_checkpoint  # noqa: F401 (SHAPES, SCALES: for the tests below)

CLASSES = {"lamb": onebitlamb.Lamb, "onebitlamb": onebitlamb.OneBitLamb, "onebitadam": onebitlamb.OneBitAdam}


def make_optimizer(kind, params, lrs, wds, freeze_step, **kw):
    groups = [{"params": [p], "lr": lr, "weight_decay": wd} for p, lr, wd in zip(params, lrs, wds)]
    if kind != "lamb":
        kw["freeze_step"] = freeze_step
    return CLASSES[kind](groups, lr=lrs[0], **kw)


LRS = [0.02, 0.01, 0.02, 0.05]


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", ["lamb", "onebitlamb", "onebitadam", "onebitlamb-torch"])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("bound", [True, False])
def test_single_process_matches_reference(kind, bias_correction, weight_decay, bound, monkeypatch):
    if kind == "onebitlamb-torch":   # 1-bit LAMB without its compiled stage-2 loop (optim/native.py)
        from onebitlamb.optim import native
        monkeypatch.setattr(native, "usable", lambda *tensors: None)
        kind = "onebitlamb"
    steps, freeze = 60, 20
    wds = [weight_decay, 0.0, weight_decay, weight_decay]
    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    opt = make_optimizer(kind, params, LRS, wds, freeze, bias_correction=bias_correction,
                         **({} if kind == "lamb" else {"bound_direction": bound}))
    ref = Reference(initial_params(), kind, LRS, wds, freeze_step=None if kind == "lamb" else freeze,
                    bias_correction=bias_correction, bound_direction=bound)
    for t in range(1, steps + 1):
        for p, g in zip(params, grads_for(params, 0, t)):
            p.grad = g
        opt.step()
        ref.step([grads_for(ref.x, 0, t)])
        for p, x in zip(params, ref.x):
            assert rel_err(p.detach(), x) < 1e-6, f"step {t}"
    assert opt.stage == ("warmup" if kind == "lamb" else "compression")


# ---------------------------------------------------------------- multi-process
def _distributed_run(rank, n, kind, steps, freeze, resume_at, **options):
    """Each rank: a full run (params after every step, bytes per step), then a run stopped at each
    ``resume_at`` step, checkpointed through bytes, restored into fresh objects and finished."""
    torch.manual_seed(0)

    def fresh(init):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        return params, make_optimizer(kind, params, LRS, [0.01, 0.0, 0.01, 0.0], freeze, **options)

    def run(params, opt, start, stop):
        history, nbytes, stages = [], [], []
        for t in range(start, stop + 1):
            for p, g in zip(params, grads_for(params, rank, t)):
                p.grad = g
            stages.append(opt.stage)
            opt.step()
            history.append([p.detach().clone() for p in params])
            nbytes.append(opt.last_step_bytes)
        return history, nbytes, stages

    params, opt = fresh(initial_params())
    history, nbytes, stages = run(params, opt, 1, steps)
    errors = {k: opt.state["flat"][k].norm().item() for k in ("worker_error", "server_error")
              if k in opt.state["flat"]}
    resumed = {}
    for stop in resume_at:
        params, opt = fresh(initial_params())
        run(params, opt, 1, stop)
        params, opt = through_a_checkpoint(params, opt, fresh)
        h, _, _ = run(params, opt, stop + 1, steps)
        resumed[stop] = h[-1]
    return {"history": history, "bytes": nbytes, "stages": stages, "errors": errors, "resumed": resumed,
            "numel": sum(p.numel() for p in params)}


def _assert_ranks_agree_and_resume_exactly(out):
    """Every rank of a ``_distributed_run`` ends with rank 0's parameters, to the bit, and every run
    resumed from a checkpoint ends where the uninterrupted one did."""
    for r in range(1, len(out)):
        for a, b in zip(out[0]["history"][-1], out[r]["history"][-1]):
            assert torch.equal(a, b), f"rank {r} differs from rank 0 at the end"
    for r in range(len(out)):
        for stop, final in out[r]["resumed"].items():
            for a, b in zip(final, out[r]["history"][-1]):
                assert torch.equal(a, b), f"rank {r}: resume after step {stop}"


@pytest.mark.parametrize("n,space,ratio,bound", [(2, "momentum", "frozen", False), (4, "momentum", "frozen", True),
                                                 (2, "update", "frozen", True), (2, "update", "live", False)])
def test_ranks_bit_identical_match_simulation_bytes_and_resume(n, space, ratio, bound):
    steps, freeze = 30, 10
    kind = "onebitlamb"
    out = run_ranks(functools.partial(_distributed_run, compression_space=space, trust_ratio_after_freeze=ratio,
                                      bound_direction=bound),
                    n, (kind, steps, freeze, (5, 17)), timeout_s=180)
    # bit-identical on all ranks after every step
    for t in range(steps):
        for r in range(1, n):
            for a, b in zip(out[0]["history"][t], out[r]["history"][t]):
                assert torch.equal(a, b), f"rank {r} differs from rank 0 at step {t + 1}"
    # the same trajectory as a one-process simulation of the n workers
    ref = Reference(initial_params(), kind, LRS, [0.01, 0.0, 0.01, 0.0], freeze_step=freeze, n=n,
                    compression_space=space, trust_ratio_after_freeze=ratio, bound_direction=bound)
    for t in range(1, steps + 1):
        ref.step([grads_for(ref.x, r, t) for r in range(n)])
        for a, x in zip(out[0]["history"][t - 1], ref.x):
            assert rel_err(a, x) < 1e-5, f"step {t}"
    # bytes: an fp32 all-reduce of every gradient in warm-up, one compressed all-reduce after
    d = out[0]["numel"]
    D = onebitlamb.padded_size(d, n)
    warm = 2 * (n - 1) * 4 * d // n
    # signs and scales, and the 4-byte flag that agrees the step's gradients are finite everywhere
    compressed = 2 * (n - 1) * D // 8 // n + 2 * (n - 1) * 4 + 2 * (n - 1) * 4 // n
    assert out[0]["stages"] == ["warmup"] * freeze + ["compression"] * (steps - freeze)
    assert out[0]["bytes"] == [warm] * freeze + [compressed] * (steps - freeze)
    # exact resume from a checkpoint in warm-up and in the compression stage
    _assert_ranks_agree_and_resume_exactly(out)


def _convergence_run(rank, n, kind, steps, freeze, lr):
    """A small real problem: an MLP regressing a fixed random teacher, each rank its own data."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 4))
    kw = {} if kind == "lamb" else {"freeze_step": freeze}
    opt = CLASSES[kind](model.parameters(), lr=lr, weight_decay=0.01, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 10) * (1 - t / steps))
    x_eval = torch.randn(512, 16, generator=torch.Generator().manual_seed(99))
    y_eval = teacher(x_eval).detach()
    gen = torch.Generator().manual_seed(rank + 1)
    error_norms = []
    for t in range(steps):
        x = torch.randn(64, 16, generator=gen)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
            loss.backward()
            return loss

        opt.step(closure)
        sched.step()
        if "worker_error" in opt.state["flat"]:
            error_norms.append(opt.state["flat"]["worker_error"].norm().item())
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x_eval), y_eval).item(), error_norms


def test_convergence_onebit_lamb_close_to_lamb():
    steps, freeze = 200, 60
    lamb, _ = run_ranks(_convergence_run, 2, ("lamb", steps, freeze, 0.02), timeout_s=180)[0]
    onebit, errs = run_ranks(_convergence_run, 2, ("onebitlamb", steps, freeze, 0.02), timeout_s=180)[0]
    init, _ = run_ranks(_convergence_run, 2, ("lamb", 1, freeze, 0.0), timeout_s=180)[0]
    assert lamb < 0.5 * init, (lamb, init)  # the problem is learnt at all
    # 1-bit LAMB's held-out loss against LAMB's at equal samples: 1.148 here with either codec, 1.151 on
    # another machine of the same kind, so rounding moves it by tenths of a percent; without error feedback
    # (both error buffers zeroed before every exchange) it is 1.60. The bound sits between the two.
    assert onebit < 1.3 * lamb, (onebit, lamb)
    # error feedback keeps the worker error bounded: no growth over the compression stage
    half = len(errs) // 2
    assert max(errs[half:]) <= 2.0 * max(errs[:half]), errs


# ---------------------------------------------------------------- edge cases
def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


@pytest.mark.parametrize("kind", ["onebitlamb", "onebitadam"])
def test_empty_zero_none_frozen_params(kind):
    torch.manual_seed(0)
    live = torch.nn.Parameter(torch.randn(6))
    empty = torch.nn.Parameter(torch.empty(0))
    always_zero = torch.nn.Parameter(torch.randn(4))
    sometimes_none = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    partly = torch.nn.Parameter(torch.randn(4, 3))  # rows 2-3 never get a gradient
    params = [live, empty, always_zero, sometimes_none, frozen, partly]
    before = {id(p): p.detach().clone() for p in params}
    opt = CLASSES[kind](params, lr=0.01, freeze_step=3)
    for t in range(8):
        live.grad = torch.randn(6)
        always_zero.grad = torch.zeros(4)
        sometimes_none.grad = None if t % 2 else torch.randn(3)
        g = torch.zeros(4, 3)
        g[:2] = torch.randn(2, 3)
        partly.grad = g
        prev_m = opt.state["flat"]["exp_avg"].clone() if "flat" in opt.state else None
        opt.step()
        if t % 2 and prev_m is not None and t < 3:  # a None gradient still decays the momentum
            sl = slice(6 + 4, 6 + 4 + 3)
            assert torch.allclose(opt.state["flat"]["exp_avg"][sl], 0.9 * prev_m[sl])
    for p in params:
        assert torch.isfinite(p).all()
    assert torch.equal(always_zero.detach(), before[id(always_zero)])
    assert torch.equal(frozen.detach(), before[id(frozen)])
    assert torch.equal(partly.detach()[2:], before[id(partly)][2:])  # masked: never moves
    assert not torch.equal(live.detach(), before[id(live)])
    flat = opt.state["flat"]
    assert flat["layer_numels"] == [6, 4, 3, 12]  # empty and frozen parameters left out
    assert flat["momentum_mask"].tolist() == [True] * 6 + [False] * 4 + [True] * 3 + [True] * 6 + [False] * 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_state(dtype):
    torch.manual_seed(0)
    p16 = torch.nn.Parameter(torch.randn(32).to(dtype))
    p32 = torch.nn.Parameter(torch.randn(8))
    opt = onebitlamb.OneBitLamb([p16, p32], lr=0.01, freeze_step=2)
    for _ in range(4):
        p16.grad = torch.randn(32).to(dtype)
        p32.grad = torch.randn(8)
        opt.step()
    assert p16.dtype == dtype and torch.isfinite(p16.float()).all()
    sd = opt.state_dict()
    opt2 = onebitlamb.OneBitLamb([p16, p32], lr=0.01, freeze_step=2)
    opt2.load_state_dict(sd)
    for key, value in opt2.state["flat"].items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert value.dtype == torch.float32, key


def test_param_groups_schedulers_closure_and_diagnostics():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
    opt = onebitlamb.OneBitLamb([{"params": [a], "weight_decay": 0.1}, {"params": [b], "lr": 0.0}],
                                lr=0.01, freeze_step=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    b0 = b.detach().clone()
    for t in range(4):
        def closure():
            opt.zero_grad()
            loss = (a ** 2).sum() + (b ** 2).sum()
            loss.backward()
            return loss
        loss = opt.step(closure)
        assert loss is not None
        sched.step()
    assert torch.equal(b.detach(), b0)  # lr 0 in its group
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 / 16)
    diag = opt.layer_diagnostics()
    assert len(diag) == 2 and diag[0]["frozen_coeff"] is not None and diag[0]["factor"] is not None
    assert diag[0]["trust_ratio"] == pytest.approx(diag[0]["frozen_coeff"] * diag[0]["factor"], rel=1e-6)


def test_world_size_and_rank_checks_on_load():
    """Only the compression errors are per rank: a state that holds them must be loaded on its own
    rank and world size, refused by load_state_dict itself (naming the fix, nothing changed);
    one without them (LAMB, or before the freeze) is the same on every rank and loads on any
    world size."""
    p = torch.nn.Parameter(torch.randn(16))
    opt = onebitlamb.OneBitLamb([p], lr=0.01, freeze_step=1)
    p.grad = torch.randn(16)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["world_size"] = 4
    portable = onebitlamb.OneBitLamb([p], lr=0.01, freeze_step=1)
    portable.load_state_dict(sd)
    portable.step()  # one process never builds error buffers
    assert portable.state["flat"]["world_size"] == 1
    for world, rank, match in ((4, 0, r"saved with world size 4.*reshard_state_dicts\(state_dicts, 1\)"),
                               (1, 3, "rank 3's compression errors and is loaded on rank 0")):
        bad = copy.deepcopy(opt.state_dict())
        entry = bad["state"][0]
        del entry["rank0"]
        entry.update({"world_size": world, f"rank{rank}": {"worker_error": torch.zeros(16),
                                                           "server_error": torch.zeros(4)}})
        opt2 = onebitlamb.OneBitLamb([p], lr=0.01, freeze_step=1)
        with pytest.raises(ValueError, match=match):
            opt2.load_state_dict(bad)
        assert opt2.state["flat"]["step"] == 0  # nothing changed
    for warmup_dtype in (torch.float32, torch.bfloat16):  # the class is named, not a setting that differs
        with pytest.raises(ValueError, match="saved by OneBitLamb and is loaded into OneBitAdam"):
            onebitlamb.OneBitAdam([p], lr=0.01, freeze_step=1, warmup_dtype=warmup_dtype).load_state_dict(
                opt.state_dict())
    with pytest.raises(ValueError, match=r"the model has 1 of sizes \[8\]"):
        onebitlamb.OneBitLamb([torch.nn.Parameter(torch.zeros(8))], freeze_step=1).load_state_dict(opt.state_dict())
    adam = torch.optim.Adam([p])
    adam.step()
    with pytest.raises(ValueError, match="saved by another optimizer"):
        onebitlamb.OneBitLamb([p], freeze_step=1).load_state_dict(adam.state_dict())


def test_sparse_gradient_is_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = onebitlamb.Lamb(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("cls,kwargs,match", [
    (onebitlamb.Lamb, {"lr": -1.0}, "learning rate"),
    (onebitlamb.Lamb, {"lr": float("nan")}, "learning rate"),
    (onebitlamb.Lamb, {"lr": float("inf")}, "learning rate"),
    (onebitlamb.Lamb, {"betas": (1.0, 0.999)}, "beta1"),
    (onebitlamb.Lamb, {"betas": (0.9, -0.1)}, "beta2"),
    (onebitlamb.Lamb, {"eps": 0.0}, "eps"),
    (onebitlamb.Lamb, {"weight_decay": -0.1}, "weight_decay"),
    (onebitlamb.Lamb, {"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff"),
    (onebitlamb.OneBitLamb, {"freeze_step": 0}, "freeze_step"),
    (onebitlamb.OneBitLamb, {"freeze_step": 2.5}, "freeze_step"),
    (onebitlamb.OneBitLamb, {"freeze_step": 5, "factor_min": 4.0, "factor_max": 1.0}, "factor_min"),
    (onebitlamb.OneBitLamb, {"freeze_step": 5, "factor_threshold": 1.0}, "factor_threshold"),
    (onebitlamb.OneBitLamb, {"freeze_step": 5, "coeff_beta": 1.0}, "coeff_beta"),
    (onebitlamb.OneBitLamb, {"freeze_step": 5, "min_coeff": 20.0}, "min_coeff"),
    (onebitlamb.OneBitAdam, {"freeze_step": -3}, "freeze_step"),
    (onebitlamb.OneBitAdam, {"freeze_step": 5, "betas": (0.9, 1.5)}, "beta2"),
])
def test_invalid_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_group_overrides_only_lr_and_weight_decay():
    with pytest.raises(ValueError, match="betas"):
        onebitlamb.Lamb([{"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (0.5, 0.9)}])
    with pytest.raises(ValueError, match="lr"):
        onebitlamb.Lamb([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -1}])


# ---------------------------------------------------------------- the freeze policy
def _auto(total, floor=None, cap=None, **kw):
    """``AutoFreeze`` with its floor and cap given as steps."""
    fractions = {}
    if floor is not None:
        fractions["min_fraction"] = floor / total
    if cap is not None:
        fractions["max_fraction"] = cap / total
    return onebitlamb.AutoFreeze(total_steps=total, **fractions, **kw)


def test_freeze_step_is_required_and_validated():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for cls in (onebitlamb.OneBitLamb, onebitlamb.OneBitAdam):
        with pytest.raises(TypeError, match="freeze_step"):
            cls(p, lr=0.01)
        for bad in ("auto", 0, -3, 2.5, True, None):
            with pytest.raises(ValueError, match=f"Invalid freeze_step for {cls.__name__}: {bad!r}"):
                cls(p, freeze_step=bad)
        with pytest.raises(TypeError, match="unfreeze_rise"):  # the experiments' switches are gone
            cls(p, freeze_step=5, unfreeze_rise=3.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"total_steps": 0}, "Invalid total_steps: 0"),
    ({"total_steps": 100.0}, "Invalid total_steps: 100.0"),
    ({"total_steps": 100, "max_fraction": 1.5}, "Invalid max_fraction: 1.5"),
    ({"total_steps": 100, "max_fraction": 0}, "Invalid max_fraction: 0"),
    ({"total_steps": 100, "min_fraction": 0.9}, "Invalid min_fraction: 0.9"),
    ({"total_steps": 100, "min_fraction": float("nan")}, "Invalid min_fraction: nan"),
    ({"total_steps": 100, "window": 0}, "Invalid window: 0"),
    ({"total_steps": 100, "tolerance": 0}, "Invalid tolerance: 0"),
    ({"total_steps": 100, "transient": -1.0}, "Invalid transient: -1.0"),
    ({"total_steps": 100, "transient_end": 5.0}, "Invalid transient_end: 5.0"),
    ({"total_steps": 100, "trust_tolerance": -0.1}, "Invalid trust_tolerance: -0.1"),
    ({"total_steps": 100, "trust_tolerance": float("inf")}, "Invalid trust_tolerance: inf"),
])
def test_invalid_auto_freeze(kwargs, match):
    with pytest.raises(ValueError, match=match):
        onebitlamb.AutoFreeze(**kwargs)


def test_auto_freeze_floor_and_cap_are_fractions_of_the_run():
    policy = onebitlamb.AutoFreeze(total_steps=400)
    lamb = onebitlamb.OneBitLamb([torch.nn.Parameter(torch.zeros(2))], freeze_step=policy).freeze_stats()
    adam = onebitlamb.OneBitAdam([torch.nn.Parameter(torch.zeros(2))], freeze_step=policy).freeze_stats()
    assert (lamb["floor_step"], lamb["cap_step"]) == (120, 300)  # 30% and 75%: 1-bit LAMB waits
    assert (adam["floor_step"], adam["cap_step"]) == (20, 300)  # 5%: 1-bit Adam has no trust ratio
    own = onebitlamb.AutoFreeze(total_steps=400, min_fraction=0.1, max_fraction=0.5)
    stats = onebitlamb.OneBitLamb([torch.nn.Parameter(torch.zeros(2))], freeze_step=own).freeze_stats()
    assert (stats["floor_step"], stats["cap_step"], stats["stage"], stats["frozen_at"]) == (40, 200, "warmup", None)
    fixed = onebitlamb.OneBitAdam([torch.nn.Parameter(torch.zeros(2))], freeze_step=7).freeze_stats()
    assert (fixed["floor_step"], fixed["cap_step"]) == (7, 7)


EXCHANGE_OPTIONS = ("process_group", "warmup_dtype", "bucket_cap_mb", "overlap_with_backward")


def _argument_entry(doc, name):
    """The Args entry of ``name`` in a docstring: its line (names may share one, "a, b (...)")."""
    import re
    lines = [line for line in doc.splitlines() if re.match(rf"\s+(\w+, )*{name}(, \w+)* \(", line)]
    assert len(lines) == 1, (name, lines)
    return lines[0]


@pytest.mark.parametrize("kind", list(CLASSES))
def test_the_constructors_follow_the_contributors_rules(kind):
    """docs/contributing.md: how the ranks talk is keyword-only; every argument's docstring states
    its default; every setting that changes the numbers is a hyper-parameter (in ``defaults``, so
    in the saved state, where a resume checks it)."""
    import inspect

    cls = CLASSES[kind]
    signature = inspect.signature(cls)
    for name in EXCHANGE_OPTIONS:
        assert signature.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert cls.__doc__ and "arXiv" in cls.__doc__
    for name, parameter in signature.parameters.items():
        if name != "params":
            entry = _argument_entry(cls.__doc__, name)
            assert ("required" if parameter.default is inspect.Parameter.empty else "default") in entry, entry
    opt = cls([torch.nn.Parameter(torch.zeros(2))], **({} if kind == "lamb" else {"freeze_step": 5}))
    assert {"warmup_dtype", "bucket_cap_mb"} <= set(opt.defaults) and "overlap_with_backward" not in opt.defaults


PINNED_RUNS = ("lamb-None", "onebitlamb-0.35", "onebitlamb-auto", "onebitadam-0.35", "onebitadam-auto")


def _pinned_run(rank, n):
    """The five runs of tests/data/pinned_runs.json on this rank. Returns, for each, what was pinned:
    the freeze step, the bytes sent, the parameters when the warm-up ended (at the end for LAMB) and
    the final loss on the whole data set."""
    out = {}
    for name in PINNED_RUNS:
        kind, freeze = name.split("-")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 1))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(512, 8, generator=g)
        y = (x @ torch.randn(8, 1, generator=g)).tanh()
        groups = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.01},
                  {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
        if kind == "lamb":
            opt = onebitlamb.Lamb(groups, lr=1e-2)
        else:
            freeze_step = onebitlamb.AutoFreeze(total_steps=200) if freeze == "auto" else 70
            # pinned with the paper's stage 2, the default before compression_space was an option
            paper = {"compression_space": "momentum"} if kind == "onebitlamb" else {}
            opt = CLASSES[kind](groups, lr=1e-2, freeze_step=freeze_step, **paper)
        warmup_params = None
        for t in range(1, 201):
            rows = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(1000 * t + rank))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
            if warmup_params is None and (opt.state["flat"]["frozen_at"] == t or t == 200):
                warmup_params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(model(x), y).item()
        out[name] = {"frozen_at": opt.state["flat"]["frozen_at"], "bytes_sent": opt.comm_stats.bytes_sent,
                     "warmup_params": warmup_params, "final_loss": loss}
    return out


# How far rounding alone moves these runs, measured by running them with ONEBITLAMB_NATIVE=0,
# ATEN_CPU_CAPABILITY=avx2 and every initial weight moved up by one ulp (torch.nextafter): the freeze
# steps and bytes never moved; the warm-up (uncompressed LAMB) keeps a rounding difference at rounding
# scale, at most 6e-7 of the parameters' norm after 200 LAMB steps; after the freeze a rounding difference
# can flip one element's sign in the 1-bit exchange, and such cascades moved the final loss by up to 3.0%
# (onebitlamb-0.35 with ONEBITLAMB_NATIVE=0). The tolerances sit well above those and below what a change
# of the algorithm does: dropping the bias correction moves the warm-up's parameters by 3% to 81% of
# their norm, the 1-bit runs' final losses by 35% to 58% and two of the four freeze steps.
WARMUP_PARAMS_RTOL = 1e-5
FINAL_LOSS_RTOL = 0.10


def test_same_runs_as_before_the_freeze_policy_api():
    """A fixed 35% freeze and AutoFreeze with its defaults (a 30% floor for 1-bit LAMB, 5% for 1-bit
    Adam, a 75% cap) give, on 2 gloo ranks, what the optimizers gave before the freeze policy became an
    object: tests/data/pinned_runs.json (its ``produced_by`` says how it was recorded). Freeze steps and
    bytes are exact on any machine; parameters and losses are compared within the rounding tolerances
    above, since another machine's kernels round differently. The automatic 1-bit LAMB run froze at 97,
    between its floor (60) and cap (150), so the wait for the trust peak decided it."""
    import json
    import os

    with open(os.path.join(os.path.dirname(__file__), "data", "pinned_runs.json")) as f:
        pinned = json.load(f)["optimizer_runs"]
    out = run_ranks(_pinned_run, 2, (), timeout_s=240)
    assert out[0] == out[1]  # the ranks agree bit for bit: the same machine
    for name in PINNED_RUNS:
        got, pin = out[0][name], pinned[name]
        assert (got["frozen_at"], got["bytes_sent"]) == (pin["frozen_at"], pin["bytes_sent"]), name
        params, pinned_params = torch.tensor(got["warmup_params"]), torch.tensor(pin["warmup_params"])
        assert rel_err(params, pinned_params) <= WARMUP_PARAMS_RTOL, (name, rel_err(params, pinned_params))
        assert got["final_loss"] == pytest.approx(pin["final_loss"], rel=FINAL_LOSS_RTOL), name


def test_a_state_saved_with_another_freeze_policy_is_a_clear_error():
    p = torch.nn.Parameter(torch.randn(8))
    fixed = onebitlamb.OneBitLamb([p], freeze_step=50)
    p.grad = torch.randn(8)
    fixed.step()
    for policy, found in ((_auto(100), "none"), (_auto(100, window=5), "a window of 20 steps")):
        saved = fixed if found == "none" else onebitlamb.OneBitLamb([p], freeze_step=_auto(100))
        if saved is not fixed:
            saved.step()
        resumed = _through_a_checkpoint(saved, lambda: onebitlamb.OneBitLamb([p], freeze_step=policy))
        with pytest.raises(ValueError, match=f"has {found} for freeze_history"):
            resumed.step()
    automatic = onebitlamb.OneBitLamb([p], freeze_step=_auto(100))
    automatic.step()
    as_fixed = _through_a_checkpoint(automatic, lambda: onebitlamb.OneBitLamb([p], freeze_step=50))
    as_fixed.step()  # a fixed step needs no history: the automatic one's is carried along unread
    assert as_fixed.state["flat"]["step"] == 2


def test_auto_freeze_same_step_on_all_ranks_and_exact_resume():
    """AutoFreeze on 2 ranks: the ranks agree bit for bit (so they froze at the same step), the
    freeze falls between the floor and the cap, and resume is exact in either stage."""
    policy = _auto(40, floor=8, cap=25, window=5, tolerance=0.5)
    out = run_ranks(_distributed_run, 2, ("onebitlamb", 40, policy, (12, 30)), timeout_s=180)
    stages = out[0]["stages"]
    assert stages == out[1]["stages"]
    frozen_at = stages.index("compression")
    assert 8 <= frozen_at <= 25, frozen_at
    _assert_ranks_agree_and_resume_exactly(out)


def test_settled_criterion_by_hand():
    from onebitlamb.optim.functional import settled, window_spread
    flat = torch.zeros(5, 4)
    assert settled(window_spread(flat, count=5), tolerance=0.1)
    assert window_spread(flat, count=4) is None and not settled(None, tolerance=0.1)  # the window is not full yet
    drifting = flat.clone()
    drifting[:, 2] = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4])  # one layer still moving by 0.4
    assert window_spread(drifting, count=9) == pytest.approx(0.4)
    assert not settled(window_spread(drifting, count=9), tolerance=0.1)
    assert settled(window_spread(drifting, count=9), tolerance=0.5)
    no_gradient_yet = flat.clone()
    no_gradient_yet[0, 1] = -float("inf")  # log of a zero variance: ignored
    assert settled(window_spread(no_gradient_yet, count=5), tolerance=0.1)


def test_auto_freeze_waits_for_a_plateau_exit_and_respects_the_cap():
    """Gradients that grow 5% a step until step 60 (a layer leaving a plateau), then hold: the
    variance keeps moving, so the automatic freeze (1-bit Adam's: the criterion alone) must wait
    until it has settled."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    opt = onebitlamb.OneBitAdam([p], lr=1e-3, freeze_step=_auto(150, floor=10, cap=150, window=10, tolerance=0.2))
    gen = torch.Generator().manual_seed(1)
    for t in range(1, 151):
        p.grad = math.exp(0.05 * min(t, 60)) * (1 + 0.1 * torch.randn(64, generator=gen))
        opt.step()
        if opt.stage == "compression":
            break
    frozen_at = opt.state["flat"]["frozen_at"]
    assert 60 < frozen_at < 150, frozen_at
    assert opt.freeze_stats()["frozen_at"] == frozen_at
    for cls in (onebitlamb.OneBitLamb, onebitlamb.OneBitAdam):
        capped = cls([p], lr=1e-3, freeze_step=_auto(7, cap=7))
        for t in range(1, 8):
            p.grad = math.exp(0.5 * t) * torch.ones(64)  # never settles
            capped.step()
        assert capped.state["flat"]["frozen_at"] == 7


def test_freeze_stats_levels_are_the_log_norms_of_the_bias_corrected_variance():
    """A constant gradient g makes v_hat = g^2 exactly (Adam's bias correction), so the level of a
    64-element layer with g = 2 is log ||4 * ones(64)|| = log 32; a layer with no gradient is -inf."""
    ps = [torch.nn.Parameter(torch.ones(64)), torch.nn.Parameter(torch.ones(8))]
    opt = onebitlamb.OneBitLamb(ps, lr=1e-3, freeze_step=_auto(3, cap=3))
    assert opt.freeze_stats()["levels"] is None  # nothing recorded yet
    for _ in range(2):
        ps[0].grad, ps[1].grad = torch.full((64,), 2.0), torch.zeros(8)
        opt.step()
    levels = opt.freeze_stats()["levels"]
    assert levels[0] == pytest.approx(math.log(32.0), rel=1e-5) and levels[1] == -math.inf
    ps[0].grad, ps[1].grad = torch.full((64,), 2.0), torch.zeros(8)
    opt.step()  # the cap: frozen at the end of this step, whose levels are the freeze's own
    stats = opt.freeze_stats()
    assert stats["stage"] == "compression" and stats["frozen_at"] == 3
    assert stats["levels"][0] == pytest.approx(math.log(32.0), rel=1e-5)
    ps[0].grad, ps[1].grad = torch.full((64,), 2.0), torch.zeros(8)
    opt.step()  # a frozen step: the levels are no longer watched
    stats = opt.freeze_stats()
    assert stats["levels"] is None and stats["spread"] is None and stats["frozen_at"] == 3
    fixed = onebitlamb.OneBitLamb([torch.nn.Parameter(torch.ones(4))], lr=1e-3, freeze_step=5)
    fixed.param_groups[0]["params"][0].grad = torch.ones(4)
    fixed.step()
    assert fixed.freeze_stats()["levels"] is None  # only the automatic freeze watches the levels


def test_transient_criterion_by_hand():
    from onebitlamb.optim.functional import transient_passed
    assert not transient_passed(None, peak=12.0, transient=5.0, end=2.5)  # window not full
    assert not transient_passed(1.0, peak=4.9, transient=5.0, end=2.5)   # no transient seen yet
    assert not transient_passed(2.6, peak=12.0, transient=5.0, end=2.5)  # not yet back to the end
    assert transient_passed(2.5, peak=12.0, transient=5.0, end=2.5)
    assert transient_passed(2.5, peak=5.0, transient=5.0, end=2.5)


def _through_a_checkpoint(opt, fresh):
    """A new optimizer from ``fresh()``, loaded with ``opt``'s state after a round trip through bytes."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = fresh()
    resumed.load_state_dict(torch.load(buffer))
    return resumed


def _plateau_exit_run(transient=5.0, end=2.5, resume_at=None):
    """Layer 0 sits on a plateau (gradients 1e-3) and leaves it over steps 30-40 (gradients grow
    1000x); layer 1 drifts slowly all along. The criterion alone (1-bit Adam). Returns the freeze
    step and the spread per step; with ``resume_at``, the run continues from a checkpoint taken
    after that step, in a new optimizer."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(32))]
    policy = _auto(150, floor=5, cap=150, window=10, tolerance=0.2, transient=transient, transient_end=end)
    opt = onebitlamb.OneBitAdam(ps, lr=1e-3, freeze_step=policy)
    gen = torch.Generator().manual_seed(1)
    spreads = []
    for t in range(1, 151):
        ps[0].grad = 1e-3 * 1000 ** (min(max(t - 30, 0), 10) / 10) * (1 + 0.1 * torch.randn(64, generator=gen))
        ps[1].grad = 0.97 ** t * (1 + 0.1 * torch.randn(32, generator=gen))
        opt.step()
        spreads.append(opt.freeze_stats()["spread"])
        if opt.stage == "compression":
            break
        if t == resume_at:
            opt = _through_a_checkpoint(opt, lambda: onebitlamb.OneBitAdam(ps, lr=1e-3, freeze_step=policy))
    return opt.state["flat"]["frozen_at"], spreads


def test_auto_freeze_after_the_transient_and_not_before():
    """With the transient rule the freeze comes once the plateau exit is over (its spread back to
    the transient's end), not on the plateau and not in the middle of the exit; with a transient
    too tall to be seen, only when every layer has settled, later. A checkpoint taken after the
    peak remembers it; a lower end waits longer."""
    frozen_at, spreads = _plateau_exit_run()
    peak = max(s for s in spreads if s is not None)
    assert peak > 8 and frozen_at > 40, (frozen_at, peak)
    assert spreads[-2] > 2.5      # the step before the freeze was still above the end
    assert spreads[-1] <= 2.5     # the freeze's own step records the spread that decided it
    assert _plateau_exit_run(resume_at=frozen_at - 3)[0] == frozen_at
    settled_at, _ = _plateau_exit_run(transient=1e9)
    assert settled_at > frozen_at + 10, (settled_at, frozen_at)
    later, spreads_later = _plateau_exit_run(end=1.0)
    assert later > frozen_at and spreads_later[-2] > 1.0 >= spreads_later[-1], (later, frozen_at)
    assert _plateau_exit_run(end=1.0, resume_at=later - 3)[0] == later


def _spike_on_a_drifting_plateau_run(spike: bool) -> int:
    """Both layers on a plateau whose variance drifts up slowly (gradients x1.05 a step: a spread of
    about 0.7 per 10-step window, above the tolerance, below the transient's end); with ``spike``,
    one step (30) has gradients 1000x larger. Default thresholds. Returns the freeze step."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(32))]
    opt = onebitlamb.OneBitAdam(ps, lr=1e-3, freeze_step=_auto(150, floor=5, cap=150, window=10))
    gen = torch.Generator().manual_seed(1)
    for t in range(1, 151):
        scale = 1e-3 * 1.05 ** t * (1000.0 if spike and t == 30 else 1.0)
        ps[0].grad = scale * (1 + 0.1 * torch.randn(64, generator=gen))
        ps[1].grad = 0.5 * scale * (1 + 0.1 * torch.randn(32, generator=gen))
        opt.step()
        if opt.stage == "compression":
            break
    return opt.state["flat"]["frozen_at"]


def test_a_spike_on_a_plateau_that_is_not_left_still_freezes_it():
    """The documented limit of the transient rule (docs/convergence.md), pinned so that a change to
    it shows: a one-step spike marks a transient, and once it has left the window the plateau's slow
    drift is below the transient's end, so the freeze comes exactly one window after the spike, on
    the plateau. Without the spike nothing but the cap freezes this plateau."""
    assert _spike_on_a_drifting_plateau_run(spike=True) == 30 + 10
    assert _spike_on_a_drifting_plateau_run(spike=False) == 150


def test_trust_rise_by_hand():
    from onebitlamb.optim.functional import trust_peak_passed, trust_rise
    history = torch.zeros(4, 3)
    history[:, 0] = torch.tensor([0.0, 0.1, 0.2, 0.3])   # rising by 0.3 over the window
    history[:, 1] = torch.tensor([1.0, 1.2, 1.1, 0.9])   # peaked inside it, now 0.1 below its start
    history[:, 2] = torch.tensor([0.5, 0.5, 0.6, 0.7])   # rising by 0.2
    assert trust_rise(history, count=4) == pytest.approx(0.2)  # the median layer
    assert not trust_peak_passed(0.2, 0.15) and trust_peak_passed(0.2, 0.25) and trust_peak_passed(0.15, 0.15)
    assert trust_rise(history, count=3) is None and not trust_peak_passed(None, 1.0)  # the window is not full yet
    history[3, 2] = 0.4  # the middle layer now 0.1 below its start
    assert trust_rise(history, count=9) == pytest.approx(-0.1) and trust_peak_passed(-0.1, 0.0)
    history[:, 1] = -math.inf  # a layer whose trust ratio was never defined is left out
    assert trust_rise(history, count=9) == pytest.approx(-0.1)  # the lower middle of (0.3, -0.1)
    assert trust_rise(torch.full((4, 2), -math.inf), count=9) is None


def _rising_trust_run(steps=120, resume_at=None, floor=5, trust_tolerance=0.0):
    """A small regression net whose trust ratios rise for a while after its variance has settled
    (its weights grow, its Adam direction does not). Returns the optimizer, the step-by-step
    trust ratios (layer_diagnostics) and freeze statistics. The wait ends at a rise of 0 unless
    told otherwise: this net's ratios rise by less than the default tolerance a window."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(256, 8)
    y = (x @ torch.randn(8, 1)).tanh()
    policy = _auto(100, floor=floor, cap=100, window=10, tolerance=1.0, trust_tolerance=trust_tolerance)
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=policy)
    ratios, stats = [], []
    for t in range(1, steps + 1):
        rows = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(t))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        ratios.append([d["trust_ratio"] for d in opt.layer_diagnostics()])
        stats.append(opt.freeze_stats())
        if t == resume_at:
            opt = _through_a_checkpoint(
                opt, lambda: onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=policy))
        if opt.stage == "compression":
            break
    return opt, ratios, stats


@pytest.mark.parametrize("tolerance", [0.0, 0.02])
def test_one_bit_lamb_waits_until_the_median_trust_ratio_stops_rising(tolerance):
    """The variance criterion first holds at the step R where the spread is within the tolerance;
    the freeze comes at the first step from R + window on (a window that starts at R) where the
    median layer's running-average trust ratio is at most ``trust_tolerance`` higher (log scale)
    than ``window`` steps before. Both recomputed here: R from the spreads, the rise from the
    trust ratios each step applied (bias-corrected average with coeff_beta 0.9, as the frozen
    coefficient is)."""
    opt, ratios, stats = _rising_trust_run(trust_tolerance=tolerance)
    ready = next(t for t, s in enumerate(stats, start=1) if s["spread"] is not None and s["spread"] <= 1.0)
    assert opt.freeze_stats()["ready_step"] == ready
    window, beta = 10, 0.9
    average, levels = torch.zeros(4), []
    for t, row in enumerate(ratios, start=1):
        average = beta * average + (1 - beta) * torch.tensor(row)
        levels.append(torch.log(average / (1 - beta ** t)))
    expected = next(t for t in range(ready + window, len(levels) + 1)
                    if float((levels[t - 1] - levels[t - 1 - window]).sort().values[1]) <= tolerance)
    frozen_at = opt.state["flat"]["frozen_at"]
    assert frozen_at == expected and frozen_at > ready + window, (frozen_at, expected, ready)
    rises = [s["trust_rise"] for s in stats]
    assert rises[ready - 1:ready + window - 1] == [None] * window  # the window restarted at R
    assert all(r > tolerance for r in rises[ready + window - 1:frozen_at - 1])  # waited while it rose
    assert rises[frozen_at - 1] <= tolerance                   # the freeze's own step decided it
    assert opt.freeze_stats()["trust_peak_step"] == frozen_at
    resumed, _, _ = _rising_trust_run(resume_at=ready + 2, trust_tolerance=tolerance)  # taken while it waited
    assert resumed.state["flat"]["frozen_at"] == frozen_at


def test_a_rise_within_the_trust_tolerance_ends_the_wait_at_once():
    """With the default tolerance (0.15) this net's slow rise does not hold the freeze: it comes
    one window after the criterion held, where the wait for 0 came later."""
    exact, _, _ = _rising_trust_run()
    lenient, _, stats = _rising_trust_run(trust_tolerance=onebitlamb.AutoFreeze(total_steps=1).trust_tolerance)
    ready = lenient.freeze_stats()["ready_step"]
    assert ready == exact.freeze_stats()["ready_step"]
    assert lenient.state["flat"]["frozen_at"] == ready + 10 < exact.state["flat"]["frozen_at"]
    assert 0 < stats[ready + 10 - 1]["trust_rise"] <= 0.15


def test_with_the_wait_the_floor_bounds_the_freeze_not_the_criterion():
    """A floor above the step the wait ends at freezes at the floor, with the criterion and the
    wait judged from the start as without it (a floor on the criterion would restart the wait's
    window there and freeze a window or more later); one at or below it changes nothing."""
    plain, _, _ = _rising_trust_run()
    ready, frozen_at = plain.freeze_stats()["ready_step"], plain.state["flat"]["frozen_at"]
    assert plain.freeze_stats()["trust_peak_step"] == frozen_at and ready > 5
    assert _rising_trust_run(floor=frozen_at)[0].state["flat"]["frozen_at"] == frozen_at
    assert _rising_trust_run(floor=ready + 1)[0].state["flat"]["frozen_at"] == frozen_at
    floor = frozen_at + 7
    floored, _, stats = _rising_trust_run(floor=floor)
    assert floored.state["flat"]["frozen_at"] == floor
    assert (floored.freeze_stats()["ready_step"], floored.freeze_stats()["trust_peak_step"]) == (ready, frozen_at)
    assert any(s["trust_rise"] > 0 for s in stats[frozen_at:floor])  # the ratios rose again; the wait had ended
    resumed, _, _ = _rising_trust_run(resume_at=frozen_at + 2, floor=floor)
    assert resumed.state["flat"]["frozen_at"] == floor  # the wait's end is part of the state


def test_a_fixed_freeze_and_one_bit_adam_have_no_wait():
    fixed = onebitlamb.OneBitLamb([torch.nn.Parameter(torch.ones(2))], freeze_step=10)
    adam = onebitlamb.OneBitAdam([torch.nn.Parameter(torch.ones(2))], freeze_step=_auto(20, cap=20))
    for opt in (fixed, adam):
        for _ in range(3):
            opt.param_groups[0]["params"][0].grad = torch.ones(2)
            opt.step()
        stats = opt.freeze_stats()
        assert stats["trust_rise"] is None and stats["ready_step"] is None and "trust_history" not in opt.state["flat"]


def test_the_wait_still_freezes_at_the_cap():
    """Trust ratios that rise at every step (the weights grow, the gradient stays the same) never
    pass the peak: the cap freezes the run."""
    p = torch.nn.Parameter(torch.ones(16))
    opt = onebitlamb.OneBitLamb([p], lr=1e-1, freeze_step=_auto(30, cap=30, window=5, tolerance=1.0))
    for _ in range(30):
        p.grad = -torch.ones(16)  # a constant descent direction: |x| grows, |u| stays 4
        opt.step()
    ready = opt.freeze_stats()["ready_step"]
    assert ready is not None and ready < 30
    assert opt.state["flat"]["frozen_at"] == 30


@pytest.mark.parametrize("kind", list(CLASSES))
def test_maximize_climbs_what_the_default_descends(kind):
    """maximize on -f takes exactly the steps the default takes on f (torch.optim's convention)."""
    finals = []
    for maximize in (False, True):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6, 4))
        kw = {} if kind == "lamb" else {"freeze_step": 3}
        opt = CLASSES[kind]([w], lr=0.05, weight_decay=0.01, maximize=maximize, **kw)
        for step in range(8):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            loss = (x @ w).square().mean()
            opt.zero_grad()
            (-loss if maximize else loss).backward()
            opt.step()
        finals.append(w.detach().clone())
    assert torch.equal(finals[0], finals[1])
    with pytest.raises(ValueError, match="Invalid maximize: 1"):
        CLASSES[kind]([w], lr=0.05, maximize=1, **({} if kind == "lamb" else {"freeze_step": 3}))


@pytest.mark.parametrize("kind", list(CLASSES))
def test_torch_compile_of_step_runs_the_step_as_it_is(kind):
    """PyTorch's compiled-optimizer recipe, torch.compile(opt.step), gives the eager steps bit for
    bit (the step is excluded from compilation: its fused kernels would round differently)."""
    finals = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = CLASSES[kind](model.parameters(), lr=0.01, **({} if kind == "lamb" else {"freeze_step": 3}))
        step = torch.compile(opt.step) if compiled else opt.step
        for i in range(6):
            opt.zero_grad()
            model(torch.randn(3, 8, generator=torch.Generator().manual_seed(i))).sum().backward()
            step()
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize("saved_at", [2, 5])  # before and after the freeze (at 3)
def test_state_dict_has_torch_optims_form_and_the_earlier_form_still_loads(kind, saved_at):
    kw = {} if kind == "lamb" else {"freeze_step": 3}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)
    opt = CLASSES[kind](model.parameters(), lr=0.01, **kw)

    def train(opt, steps):
        for i in steps:
            opt.zero_grad()
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).square().sum().backward()
            opt.step()

    train(opt, range(saved_at))
    saved = copy.deepcopy(opt.state_dict())
    earlier_form = {"state": {"flat": copy.deepcopy(opt.state["flat"])}, "param_groups": saved["param_groups"]}
    # one entry per trainable parameter (index 1, the frozen bias, has none), the first holds it all
    assert sorted(saved["state"]) == [0, 2, 3] and all(not saved["state"][i] for i in (2, 3))
    assert saved["state"][0]["step"] == saved_at and "rank0" in saved["state"][0]
    start = [p.detach().clone() for p in model.parameters()]
    train(opt, range(saved_at, 8))
    expected = [p.detach().clone() for p in model.parameters()]
    for state in (saved, earlier_form):
        with torch.no_grad():
            for p, s in zip(model.parameters(), start):
                p.copy_(s)
        resumed = CLASSES[kind](model.parameters(), lr=0.01, **kw)
        resumed.load_state_dict(state)
        train(resumed, range(saved_at, 8))
        assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))


@pytest.mark.parametrize("setting, saved, loaded", [("warmup_dtype", torch.bfloat16, torch.float32),
                                                    ("bucket_cap_mb", 1e-4, None),
                                                    ("compression_space", "update", "momentum"),
                                                    ("trust_ratio_after_freeze", "live", "frozen")])
def test_a_state_saved_with_another_exchange_setting_is_refused(setting, saved, loaded):
    """warmup_dtype, bucket_cap_mb and compression_space change the numbers: a state saved with one
    value is refused, naming both, by an optimizer built with another, before anything changes; a
    state saved before they were options (no key) had float32, one bucket and the momentum space."""
    params = initial_params()
    opt = onebitlamb.OneBitLamb(params, freeze_step=2, **{setting: saved})
    for step in range(1, 4):
        _step(opt, params, grads_for(params, 0, step))
    state = opt.state_dict()
    other = onebitlamb.OneBitLamb(params, freeze_step=2, **{setting: loaded})
    name = {torch.bfloat16: "'bfloat16'", torch.float32: "'float32'", 1e-4: "0.0001", None: "None",
            "update": "'update'", "momentum": "'momentum'", "live": "'live'", "frozen": "'frozen'"}
    with pytest.raises(ValueError, match=f"saved with {setting}={name[saved]} .* with {setting}={name[loaded]}"):
        other.load_state_dict(state)
    assert other.state["flat"]["step"] == 0 and str(other.param_groups[0][setting]) in name[loaded]  # unchanged
    # a state saved before the options: float32, one bucket, the paper's stage 2 (the momentum
    # space, which is no longer the default: such a state needs compression_space="momentum")
    default = onebitlamb.OneBitLamb(params, freeze_step=2, compression_space="momentum")
    old = default.state_dict()
    for group in old["param_groups"]:
        del group["warmup_dtype"], group["bucket_cap_mb"], group["compression_space"], group["trust_ratio_after_freeze"]
    with pytest.raises(ValueError, match="saved with compression_space='momentum' .* with compression_space='update'"):
        onebitlamb.OneBitLamb(params, freeze_step=2).load_state_dict(copy.deepcopy(old))
    default.load_state_dict(old)
    assert default.param_groups[0]["warmup_dtype"] == "float32" and default.param_groups[0]["bucket_cap_mb"] is None
    assert default.param_groups[0]["compression_space"] == "momentum"
    assert default.param_groups[0]["trust_ratio_after_freeze"] == "frozen"
