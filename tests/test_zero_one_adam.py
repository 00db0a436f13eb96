"""0/1 Adam (``onebitlamb.ZeroOneAdam``) against the reference of docs/algorithm.md
(``tests/reference.py``, with the errors kept in their unit across a variance step: ``Reference``
below) on 1, 2 and 4 ranks through every phase, exact resume inside each phase, DeepSpeed's rule
(``compression_space="momentum"``), the schedules as fractions, and what is refused. Against
DeepSpeed's own code: ``tests/test_deepspeed_code.py``."""
from __future__ import annotations

import contextlib
import functools
import inspect
from unittest import mock

import pytest
import torch

import onebitlamb
from onebitlamb.optim.zero_one import VarianceThinning
from rank_pool import run_ranks
from reference import ZeroOneReference, ZeroOneRescaledReference

from toy import SHAPES, SCALES, grads_for, initial_params, through_a_checkpoint  # noqa: E402,F401
LRS = [0.02, 0.01, 0.02, 0.05]
WDS = [0.01, 0.0, 0.01, 0.0]
# small intervals, so that 30 steps pass through every phase: variance steps at 1, 2, 3 (interval
# 1), 4, 6, 8 (interval 2) and 12 (interval 4), 1-bit steps at 5, 7, 9, 10, 11; the freeze after 12;
# syncs at 13-16 (interval 1), 18, 20 (interval 2), 24, 28 (interval 4, the clipper); local steps between
SCHEDULE = dict(var_freeze_step=12, var_update_scaler=3, local_step_scaler=4, local_step_clipper=4)
STEPS = 30
STAGES = (["warmup"] * 4 + ["compression", "warmup", "compression", "warmup"] + ["compression"] * 3
          + ["warmup"] + ["compression"] * 4 + ["local", "compression"] * 2 + (["local"] * 3 + ["compression"]) * 2
          + ["local"] * 2)
RESUME_AT = (2, 7, 14, 21)  # dense variance steps, sparse ones, syncs every step, inside a local interval



# the reference's direction is the paper's and DeepSpeed's, unbounded
UNBOUNDED = ({"bound_direction": False} if "bound_direction" in inspect.signature(onebitlamb.ZeroOneAdam).parameters
             else {})


def make(params, **kw):
    groups = [{"params": [p], "lr": lr, "weight_decay": wd} for p, lr, wd in zip(params, LRS, WDS)]
    return onebitlamb.ZeroOneAdam(groups, lr=LRS[0], **{**SCHEDULE, **UNBOUNDED, **kw})


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def _run(rank, n, resume_at, kw):
    """Each rank: a full run (its parameters and the collectives it called after every step), then
    runs stopped after each ``resume_at`` step, checkpointed through bytes, restored into fresh
    objects and finished; and the state dict at the end."""
    def fresh(init):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        return params, make(params, **kw)

    def run(params, opt, start, stop):
        history, calls, stages = [], [], []
        for t in range(start, stop + 1):
            for p, g in zip(params, grads_for(params, rank, t)):
                p.grad = g
            stages.append(opt.stage)
            before = opt.comm_stats.calls
            opt.step()
            calls.append(opt.comm_stats.calls - before)
            history.append([p.detach().clone() for p in params])
        return history, calls, stages

    params, opt = fresh(initial_params())
    history, calls, stages = run(params, opt, 1, STEPS)
    final_state = opt.state_dict()
    resumed = {}
    for stop in resume_at:
        params, opt = fresh(initial_params())
        run(params, opt, 1, stop)
        params, opt = through_a_checkpoint(params, opt, fresh)
        resumed[stop] = run(params, opt, stop + 1, STEPS)[0][-1]
    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    momentum_space = run(params, make(params, compression_space="momentum"), 1, STEPS)[0]
    return {"history": history, "calls": calls, "stages": stages, "resumed": resumed, "state": final_state,
            "momentum_space": momentum_space}


@functools.lru_cache(maxsize=None)
def _spawned(n):
    """Both multi-rank comparisons run in one start of ``n`` ranks (starting them is most of the time)."""
    return run_ranks(_run, n, (RESUME_AT, {}), timeout_s=180)


Reference = ZeroOneRescaledReference


def _reference_run(n, steps=STEPS, **kw):
    ref = Reference(initial_params(), LRS, WDS, n=n, **{**SCHEDULE, **kw})
    out = []
    for t in range(1, steps + 1):
        ref.step([grads_for(ref.x[r], r, t) for r in range(n)])
        out.append([[x.clone() for x in ref.x[r]] for r in range(n)])
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_every_phase_matches_the_reference_and_resumes_exactly(n):
    out = _spawned(n)
    assert out[0]["stages"] == STAGES
    # the reference of docs/algorithm.md, every worker simulated: each rank's own parameters
    # (they part between syncs) after every step, within float32 rounding of the two computations
    ref = _reference_run(n)
    for t in range(STEPS):
        for r in range(n):
            for a, x in zip(out[r]["history"][t], ref[t][r]):
                assert rel_err(a, x) < 1e-5, f"rank {r}, step {t + 1} ({STAGES[t]})"
    # bit for bit alike on every rank after every variance step, 1-bit step and sync
    for t, stage in enumerate(STAGES):
        for r in range(1, n):
            same = all(torch.equal(a, b) for a, b in zip(out[0]["history"][t], out[r]["history"][t]))
            assert same == (stage != "local"), f"rank {r}, step {t + 1} ({stage})"
    # rounds: one all-reduce at a variance step; the finite flag, all-to-all and all-gather at a
    # 1-bit step or sync; the flag alone at a local step
    rounds = {"warmup": 1, "compression": 3, "local": 1}
    assert out[0]["calls"] == [rounds[s] for s in STAGES]
    # resumed inside each phase: where the uninterrupted run ended, to the bit
    for r in range(n):
        for stop, final in out[r]["resumed"].items():
            for a, b in zip(final, out[r]["history"][-1]):
                assert torch.equal(a, b), f"rank {r}: resume after step {stop}"


@pytest.mark.parametrize("n", [2, 4])
def test_deepspeeds_compression_space_matches_the_reference(n):
    """compression_space="momentum": the 1-bit steps average the gradients and a sync the update
    sums times the denominator, unscaled (DeepSpeed's rule), on four layers of their own scales."""
    out, ref = _spawned(n), _reference_run(n, compression_space="momentum")
    for t in range(STEPS):
        for r in range(n):
            for a, x in zip(out[r]["momentum_space"][t], ref[t][r]):
                assert rel_err(a, x) < 1e-5, f"rank {r}, step {t + 1} ({STAGES[t]})"
    # the two spaces part at the first 1-bit step (step 5) and not before
    assert all(torch.equal(a, b) for a, b in zip(out[0]["momentum_space"][3], out[0]["history"][3]))
    assert not all(torch.equal(a, b) for a, b in zip(out[0]["momentum_space"][4], out[0]["history"][4]))


def _scales_held(rank, n):
    """DeepSpeed's rule where each compression sees one layer, so that it compresses alike at any
    constant scale: on the world (flat) with every tensor a bucket of its own; on 2 nodes x 2 ranks
    likewise, and with two layers of 16 elements in one bucket of 32, of which each local rank
    compresses one layer's half across the nodes. The run whose layer scales follow each variance
    step, and the run whose scales are held at 1."""
    from onebitlamb.comm import node_groups

    out = {}
    nodes = node_groups(2)
    for name, group, shapes, cap in (("flat", None, SHAPES, 1e-9), ("nodes", nodes, SHAPES, 1e-9),
                                     ("nodes, a layer a chunk", nodes, [(16,), (16,)], None)):
        for held in (False, True):
            params = [torch.nn.Parameter(t.clone()) for t in initial_params(shapes)]
            opt = make(params, compression_space="momentum", bias_correction=False, bucket_cap_mb=cap,
                       process_group=group)
            ones = torch.ones(len(shapes))
            # the phase's layer scales held at 1 for the whole run (the class's, for this run only)
            holding = (mock.patch.object(VarianceThinning, "_layer_scales", lambda self, ctx, sent: ones) if held
                       else contextlib.nullcontext())
            history = []
            with holding:
                for t in range(1, SCHEDULE["var_freeze_step"] + 1):
                    for p, g in zip(params, grads_for(params, rank, t)):
                        p.grad = g
                    opt.step()
                    history.append([p.detach().clone() for p in params])
            out[name, held] = history
    return out


def test_the_errors_keep_their_unit_across_a_variance_step():
    """A variance step sets new layer scales ``k_l`` while the 1-bit steps' errors carry over; they
    are rescaled to the new ones (zero_one.py, ``_rescale_errors_``). A bucket of one tensor
    compresses alike at any constant scale, so with the errors rescaled the scales change nothing
    but rounding, on a flat group and on a hierarchical one (whose ranks hold the errors of a
    chunk: the rescaling must pick the right one). Left in the old unit, the runs part at step 7,
    the first 1-bit step after a variance step that moved the scales."""
    ranks = run_ranks(_scales_held, 4, (), timeout_s=120, collective_timeout_s=60)
    for r, out in enumerate(ranks):
        for name in ("flat", "nodes", "nodes, a layer a chunk"):
            for t, (a, b) in enumerate(zip(out[name, False], out[name, True]), start=1):
                assert max(rel_err(x, y) for x, y in zip(a, b)) < 1e-6, f"rank {r}, {name}, step {t} ({STAGES[t - 1]})"


@pytest.mark.parametrize("bias_correction", [True, False])
def test_one_process_matches_the_reference(bias_correction):
    """One process: nothing is compressed, the momentum takes the gradient at every step (DeepSpeed's
    ignores it at the steps without a variance update)."""
    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    opt = make(params, bias_correction=bias_correction)
    ref = ZeroOneReference(initial_params(), LRS, WDS, n=1, bias_correction=bias_correction, **SCHEDULE)
    for t in range(1, STEPS + 1):
        for p, g in zip(params, grads_for(params, 0, t)):
            p.grad = g
        opt.step()
        ref.step([grads_for(ref.x[0], 0, t)])
        for p, x in zip(params, ref.x[0]):
            assert rel_err(p.detach(), x) < 1e-6, f"step {t}"
    assert opt.comm_stats.calls == 0


def test_weight_decay_reaches_the_synchronized_momentum_tenfold():
    """DeepSpeed's rule puts weight decay in the update sums a sync averages, so the momentum keeps
    it: with every step a sync and the gradient gone, a step moves x by lr * wd * x / (1 - b1), not
    lr * wd * x (docs/algorithm.md). Pinned so that a change of the rule is seen, not inferred."""
    lr, wd, beta1 = 1e-2, 0.01, 0.9
    p = torch.nn.Parameter(torch.ones(64))
    opt = onebitlamb.ZeroOneAdam([p], lr=lr, weight_decay=wd, betas=(beta1, 0.999), var_freeze_step=10,
                                 var_update_scaler=100, local_step_scaler=1000, local_step_clipper=1)
    gen = torch.Generator().manual_seed(0)
    ratios = []
    for t in range(1, 121):
        p.grad = torch.randn(64, generator=gen) if t <= 10 else torch.zeros(64)
        before = p.detach().clone()
        opt.step()
        ratios.append(float(((before - p.detach()) / (lr * wd * before)).median()))
    assert opt.stage == "compression"  # every step after the freeze a sync
    assert abs(ratios[-1] - 1 / (1 - beta1)) < 0.05 * (1 / (1 - beta1))


# ---------------------------------------------------------------- schedules, validation
def _opt(**kw):
    return onebitlamb.ZeroOneAdam([torch.nn.Parameter(torch.zeros(4))], **kw)


def test_schedules_as_fractions_of_the_run():
    opt = _opt(var_freeze_step=0.25, local_step_scaler=0.1, total_steps=512)
    assert (opt.defaults["var_freeze_step"], opt.defaults["local_step_scaler"]) == (128, 51)
    assert _opt(var_freeze_step=1.0, total_steps=7).defaults["var_freeze_step"] == 7
    assert _opt(var_freeze_step=0.001, total_steps=100).defaults["var_freeze_step"] == 1
    # DeepSpeed's ints as they are
    plain = _opt(var_freeze_step=100, local_step_scaler=32678)
    assert (plain.defaults["var_freeze_step"], plain.defaults["local_step_scaler"]) == (100, 32678)


@pytest.mark.parametrize("kwargs, match", [
    (dict(var_freeze_step=0), "var_freeze_step: 0"),
    (dict(var_freeze_step=-3), "var_freeze_step: -3"),
    (dict(var_freeze_step=1.5, total_steps=10), "var_freeze_step: 1.5"),
    (dict(var_freeze_step=0.0, total_steps=10), "var_freeze_step: 0.0"),
    (dict(var_freeze_step=0.5), "var_freeze_step: 0.5 is a fraction of the run; pass total_steps"),
    (dict(var_freeze_step=11, total_steps=10), "var_freeze_step: 11 is beyond the run"),
    (dict(var_freeze_step="10"), "var_freeze_step: '10'"),
    (dict(var_freeze_step=5, var_update_scaler=0), "var_update_scaler: 0"),
    (dict(var_freeze_step=5, local_step_scaler=0), "local_step_scaler: 0"),
    (dict(var_freeze_step=5, local_step_scaler=1.2, total_steps=10), "local_step_scaler: 1.2"),
    (dict(var_freeze_step=5, local_step_clipper=-1), "local_step_clipper: -1"),
    (dict(var_freeze_step=5, total_steps=0), "total_steps: 0"),
    (dict(var_freeze_step=5, bias_correction=1), "bias_correction: 1"),
    (dict(var_freeze_step=5, overlap_with_backward=True), "overlap_with_backward"),
    (dict(var_freeze_step=5, eps=0.0), "eps"),
])
def test_bad_schedule_values_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _opt(**kwargs)


def test_var_freeze_step_is_required():
    with pytest.raises(TypeError, match="var_freeze_step"):
        onebitlamb.ZeroOneAdam([torch.nn.Parameter(torch.zeros(4))])


def _disagreeing(rank, n):
    p = torch.nn.Parameter(torch.ones(8))
    opt = onebitlamb.ZeroOneAdam([p], var_freeze_step=10 + rank)
    p.grad = torch.ones(8)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_ranks_that_disagree_on_the_schedule_stop_at_the_first_step():
    messages = run_ranks(_disagreeing, 2, (), timeout_s=60)
    assert all(m is not None and "var_freeze_step" in m and "rank 0" in m and "rank 1" in m for m in messages)


# ---------------------------------------------------------------- non-finite, elastic
def _nan_on_one_rank_at_a_local_step(rank, n):
    """A run whose rank 1 sees a NaN gradient at a 1-bit step (call 5) and at a local step (call 18,
    the optimizer's step 17 after the first skip)."""
    import warnings
    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    opt = make(params)
    skipped, reference, stages = [], None, []
    for t in range(1, 20):
        grads = grads_for(params, rank, t)
        if t in (5, 18):
            stages.append(opt.stage)
            if rank == 1:
                grads[0][0, 0] = float("nan")
        for p, g in zip(params, grads):
            p.grad = g
        before = [p.detach().clone() for p in params]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
        if opt.last_step_skipped:
            skipped.append(t)
            reference = all(torch.equal(a, b.detach()) for a, b in zip(before, params))
    # buckets of at most 26 elements (three: each its own compression scale and error regions), 20 steps
    # ending with a sync
    bucketed = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    opt2 = make(bucketed, bucket_cap_mb=1e-4)
    for t in range(1, 21):
        for p, g in zip(bucketed, grads_for(bucketed, rank, t)):
            p.grad = g
        opt2.step()
    return {"skipped": skipped, "unchanged": reference, "step": opt.state_dict()["state"][0]["step"],
            "stages": stages, "state": opt.state_dict(), "buckets": len(opt2.exchange.buckets),
            "bucketed": [p.detach() for p in bucketed]}


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank_and_resharding_and_buckets():
    out = run_ranks(_nan_on_one_rank_at_a_local_step, 2, (), timeout_s=120)
    assert out[0]["buckets"] == 3 and all(
        torch.equal(a, b) and bool(torch.isfinite(a).all()) for a, b in zip(out[0]["bucketed"], out[1]["bucketed"]))
    for r in out:
        assert r["stages"] == ["compression", "local"]
        assert r["skipped"] == [5, 18] and r["unchanged"] and r["step"] == 17
    # two ranks' states inside a local interval (their momenta and update sums differ) re-sharded
    # for one process: their means, and the last sync's parameters
    from onebitlamb.optim.state_format import flat_of
    flats = [flat_of(r["state"]) for r in out]
    assert not torch.equal(flats[0]["exp_avg"], flats[1]["exp_avg"])
    (one,) = onebitlamb.reshard_state_dicts([r["state"] for r in out], 1)
    flat = flat_of(one)
    assert torch.allclose(flat["exp_avg"], (flats[0]["exp_avg"] + flats[1]["exp_avg"]) / 2)
    assert torch.allclose(flat["update_sum"], (flats[0]["update_sum"] + flats[1]["update_sum"]) / 2)
    assert torch.equal(flat["sync_params"], flats[0]["sync_params"]) and "worker_error" not in flat
    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    opt = make(params)
    opt.load_state_dict(one)
    for p, g in zip(params, grads_for(params, 0, 20)):
        p.grad = g
    assert opt.stage == "compression"  # step 18: a sync, on one process
    opt.step()
    assert opt.state_dict()["state"][0]["step"] == 18 and all(bool(torch.isfinite(p).all()) for p in params)
    ends = torch.tensor([p.numel() for p in params]).cumsum(0).tolist()  # the flat layout: the params in order
    sync = flat_of(opt.state_dict())["sync_params"]
    assert all(torch.equal(p.detach().reshape(-1), sync[end - p.numel():end]) for p, end in zip(params, ends))


# ---------------------------------------------------------------- surface, rounds
def test_the_constructor_follows_the_contributors_rules():
    """docs/contributing.md, as for the other optimizers (tests/test_optimizers.py): the exchange
    options keyword-only, every argument's default stated, the settings that change the numbers in
    ``defaults``; DeepSpeed's argument names."""
    import inspect

    from test_optimizers import EXCHANGE_OPTIONS, _argument_entry

    cls = onebitlamb.ZeroOneAdam
    signature = inspect.signature(cls)
    for name in EXCHANGE_OPTIONS + ("var_freeze_step", "var_update_scaler", "local_step_scaler",
                                    "local_step_clipper", "betas", "eps", "weight_decay", "bias_correction"):
        assert signature.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert list(signature.parameters)[:2] == ["params", "lr"] and "arXiv 2202.06009" in cls.__doc__
    for name, parameter in signature.parameters.items():
        if name != "params":
            entry = _argument_entry(cls.__doc__, name)
            assert ("required" if parameter.default is inspect.Parameter.empty else "default") in entry, entry
    opt = _opt(var_freeze_step=5)
    assert {"warmup_dtype", "bucket_cap_mb", "var_freeze_step", "var_update_scaler", "local_step_scaler",
            "local_step_clipper"} <= set(opt.defaults) and "overlap_with_backward" not in opt.defaults


def test_comm_stats_count_rounds_beside_bytes():
    stats = onebitlamb.CommStats()
    stats.record("all_to_all", 10)
    stats.record("all_gather", 4)
    stats.record("all_gather", 4)
    assert (stats.rounds, stats.bytes_sent) == (3, 18)
    assert stats.rounds_by_op == {"all_to_all": 1, "all_gather": 2}
    copy = onebitlamb.CommStats()
    copy.load_state_dict(stats.state_dict())
    assert copy == stats
    old = {k: v for k, v in stats.state_dict().items() if k != "rounds_by_op"}  # saved before rounds_by_op
    copy.load_state_dict(old)
    assert copy.rounds == 3 and copy.rounds_by_op == {}


def _one_refused_step(rank, n, refused):
    """0/1 Adam on 2 ranks (freeze after step 4, syncs every step then every 2), lr 1e38 at call
    ``refused`` (None: no such call) and 1e-2 again after. Returns what each call did, the
    parameters, and the state after the refused call against the state before it."""
    from onebitlamb.optim.state_format import flat_of
    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    opt = onebitlamb.ZeroOneAdam(params, lr=1e-2, var_freeze_step=4, local_step_scaler=2, local_step_clipper=4)
    outcomes, changed = [], None
    for t in range(1, 15):
        if t == refused:
            before = {k: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in flat_of(opt.state_dict()).items()}
            held = [p.detach().clone() for p in params]
        for group in opt.param_groups:
            group["lr"] = 1e38 if t == refused else 1e-2
        for p, g in zip(params, grads_for(params, rank, t)):
            p.grad = g
        try:
            opt.step()
            outcomes.append("ok")
        except FloatingPointError:
            outcomes.append("refused")
        if t == refused:
            now = flat_of(opt.state_dict())
            changed = [k for k, v in before.items()
                       if not (torch.equal(v, now[k]) if isinstance(v, torch.Tensor) else v == now[k])]
            changed += [f"parameter {i}" for i, (a, p) in enumerate(zip(held, params)) if not torch.equal(a, p)]
    return outcomes, changed, [p.detach().clone() for p in params]


@pytest.mark.parametrize("refused", [6, 8])
def test_a_refused_step_changes_nothing_and_the_run_goes_on(refused):
    """An lr of 1e38 at one sync after the freeze (step 6: interval 1; step 8: interval 2): the
    synchronized parameters are not finite, the step is refused with ``FloatingPointError`` on
    every rank, and nothing of the state moves (not the momentum, the update sum, the errors or the
    step count), so the run goes on at the next call. Before, the errors kept that step's
    non-finite values and every later sync was refused."""
    out = run_ranks(_one_refused_step, 2, (refused,), timeout_s=120, collective_timeout_s=60)
    for outcomes, changed, _ in out:
        assert outcomes == ["ok"] * (refused - 1) + ["refused"] + ["ok"] * (14 - refused), outcomes
        assert changed == [], changed


# ---------------------------------------------------------------- checkpoints of one model
def _copied(obj):
    """``obj`` through bytes, as a checkpoint file holds it (a state dict's tensors are the live ones)."""
    import io
    blob = io.BytesIO()
    torch.save(obj, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=False)


def _resumed_from(rank, n, saved_at, own_model, strip_checksum=False):
    """The run of ``_run`` saved after step ``saved_at`` and resumed to the end, each rank with its
    own optimizer state and either its own parameters or rank 0's (the usual script: the model saved
    from rank 0, loaded on every rank); its final parameters, or the ValueError's message."""
    import torch.distributed as dist

    def run(params, opt, start, stop):
        for t in range(start, stop + 1):
            for p, g in zip(params, grads_for(params, rank, t)):
                p.grad = g
            opt.step()

    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    opt = make(params)
    run(params, opt, 1, saved_at)
    model, state, synchronized = _copied([p.detach() for p in params]), _copied(opt.state_dict()), \
        opt.parameters_synchronized
    run(params, opt, saved_at + 1, STEPS)
    uninterrupted = [p.detach().clone() for p in params]
    if not own_model:
        for t in model:
            dist.broadcast(t, 0)
    if strip_checksum:  # a state saved before the checksum was recorded
        state["state"][0][f"rank{rank}"].pop("parameters_crc32", None)
    params = [torch.nn.Parameter(t.clone()) for t in model]
    opt = make(params)
    opt.load_state_dict(state)
    try:
        run(params, opt, saved_at + 1, STEPS)
    except ValueError as e:
        return synchronized, str(e), None
    return synchronized, None, all(torch.equal(p.detach(), u) for p, u in zip(params, uninterrupted))


def _checkpoint_patterns(rank, n):
    return {"own model between syncs": _resumed_from(rank, n, 21, own_model=True),
            "rank 0's model between syncs": _resumed_from(rank, n, 21, own_model=False),
            "rank 0's model at a sync": _resumed_from(rank, n, 20, own_model=False),
            "an earlier state, rank 0's model": _resumed_from(rank, n, 21, own_model=False, strip_checksum=True)}


def test_a_resume_with_rank_0s_model_between_syncs_is_refused_on_every_rank():
    """The usual checkpoint (the model saved from rank 0, loaded on every rank, each rank's own
    optimizer state) taken between two syncs, where each rank's parameters are its own: before,
    rank 1 silently went on from rank 0's parameters (another run); now the first step refuses it on
    both ranks, naming the rank and the two fixes. Each rank's own model resumes bit for bit, and so
    does rank 0's model at a sync, where the ranks' parameters agree. A state saved before the
    check (no checksum) still loads and is not checked."""
    out = run_ranks(_checkpoint_patterns, 2, (), timeout_s=180, collective_timeout_s=60)
    for rank, result in enumerate(out):
        assert result["own model between syncs"] == (False, None, True)
        synchronized, message, _ = result["rank 0's model between syncs"]
        assert not synchronized and message is not None
        assert "the parameters of rank 1 are not the ones held when the optimizer state was saved" in message
        for fix in ("each rank's own model", "parameters_synchronized",
                    'python -m onebitlamb.docs optimizers "State and checkpoints"'):
            assert fix in message, message
        assert result["rank 0's model at a sync"] == (True, None, True)
        _, message, same = result["an earlier state, rank 0's model"]
        assert message is None and same is False  # another run (rank 1's updates reach rank 0 at the syncs)


def _ended_on_a_local_step(rank, n):
    """0/1 Adam through step 31 (a local step; the next sync is at 32), then ``synchronize()``; the
    same run whose step 32, a sync, moves nothing of its own (lr 0); rank 0's model and each rank's
    state after ``synchronize()`` resumed; and 1-bit LAMB's ``synchronize()``."""
    import torch.distributed as dist

    def run(lr_last=None):
        params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
        opt = make(params)
        for t in range(1, 32 + (lr_last is not None)):
            if t == 32:
                for group in opt.param_groups:
                    group["lr"] = lr_last
            for p, g in zip(params, grads_for(params, rank, t)):
                p.grad = g
            opt.step()
        return params, opt

    params, opt = run()
    out = {"apart before": not opt.parameters_synchronized, "stage next": opt.stage}
    sent = opt.stats()["bytes_sent"]
    opt.synchronize()
    out["synchronized"] = opt.parameters_synchronized
    out["bytes"] = opt.stats()["bytes_sent"] - sent
    out["params"] = [p.detach().clone() for p in params]
    sent = opt.stats()["bytes_sent"]
    opt.synchronize()  # nothing left to average: no communication
    out["bytes again"] = opt.stats()["bytes_sent"] - sent
    out["as a sync step"] = all(torch.equal(a, b.detach()) for a, b in zip(out["params"], run(lr_last=0.0)[0]))
    # the usual checkpoint, rank 0's model loaded on every rank, continues
    state, model = _copied(opt.state_dict()), [p.detach().clone() for p in params]
    for t in model:
        dist.broadcast(t, 0)
    resumed = [torch.nn.Parameter(t) for t in model]
    opt = make(resumed)
    opt.load_state_dict(state)
    for p, g in zip(resumed, grads_for(resumed, rank, 32)):
        p.grad = g
    opt.step()
    other = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    lamb = onebitlamb.OneBitLamb(other, freeze_step=2)
    for t in range(1, 5):
        for p, g in zip(other, grads_for(other, rank, t)):
            p.grad = g
        lamb.step()
    held, sent = [p.detach().clone() for p in other], lamb.stats()["bytes_sent"]
    lamb.synchronize()
    out["other optimizers"] = (lamb.stats()["bytes_sent"] - sent,
                               all(torch.equal(a, p.detach()) for a, p in zip(held, other)))
    return out


def test_synchronize_ends_a_run_on_the_same_parameters_on_every_rank():
    """0/1 Adam's last step is most often a local one, after which every rank holds other
    parameters, and nothing said so. ``synchronize()`` averages the ranks' moves as a sync does
    (the parameters bit for bit those of a sync step that adds no move of its own), after which
    the ranks' parameters are bit-identical and a model saved from rank 0 resumes on every rank;
    called again, or on the other optimizers, it sends nothing and changes nothing."""
    out = run_ranks(_ended_on_a_local_step, 2, (), timeout_s=120, collective_timeout_s=60)
    for r in out:
        assert r["apart before"] and r["stage next"] == "compression" and r["synchronized"], r
        assert r["bytes"] > 0 and r["bytes again"] == 0 and r["as a sync step"]
        assert r["other optimizers"] == (0, True)
    assert all(torch.equal(a, b) for a, b in zip(out[0]["params"], out[1]["params"]))


def test_another_model_after_the_freeze_is_refused_and_the_1bit_optimizers_accept_it():
    """On one process too: after the freeze 0/1 Adam's state holds its last sync's parameters (the
    next sync would put them back), so a model other than the one saved with the state is refused;
    before the freeze it holds nothing of them. 1-bit LAMB's and 1-bit Adam's states never do, and
    a model loaded from elsewhere is the caller's choice, as with torch.optim."""
    def resumed(kind, steps, other_model):
        params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
        opt = make(params) if kind is None else kind(params, freeze_step=2)
        for t in range(1, steps + 1):
            for p, g in zip(params, grads_for(params, 0, t)):
                p.grad = g
            opt.step()
        state = _copied(opt.state_dict())
        params = [torch.nn.Parameter(p.detach() + (0.1 if other_model else 0.0)) for p in params]
        opt = make(params) if kind is None else kind(params, freeze_step=2)
        opt.load_state_dict(state)
        for p, g in zip(params, grads_for(params, 0, steps + 1)):
            p.grad = g
        opt.step()

    resumed(None, 17, other_model=False)
    resumed(None, 5, other_model=True)  # the variance phase
    with pytest.raises(ValueError, match="the parameters of every rank are not the ones held"):
        resumed(None, 17, other_model=True)
    for kind in (onebitlamb.OneBitLamb, onebitlamb.OneBitAdam):
        resumed(kind, 4, other_model=True)
