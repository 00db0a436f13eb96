"""What the optimizers refuse before anything moves (misuse, ranks that disagree) and how a
non-finite gradient is contained: skipped on every rank alike, state untouched."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import onebitlamb
from onebitlamb.optim.staged import MAX_CONSECUTIVE_SKIPS
from onebitlamb.optim.state_format import flat_of
from rank_pool import run_ranks

CLASSES = {"lamb": onebitlamb.Lamb, "onebitlamb": onebitlamb.OneBitLamb, "onebitadam": onebitlamb.OneBitAdam}


def _make(kind, params, **kw):
    if kind != "lamb":
        kw.setdefault("freeze_step", 3)
    return CLASSES[kind](params, lr=0.01, **kw)


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def _assert_untouched(opt, params, snapshot):
    before_params, before_state = snapshot
    for a, b in zip(params, before_params):
        assert torch.equal(a.detach(), b)
    now = flat_of(opt.state_dict())
    for key, value in flat_of(before_state).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(now[key], value), key
        else:
            assert now[key] == value, key


@pytest.mark.parametrize("kind", list(CLASSES))
def test_misuse_at_construction_is_a_clear_error(kind):
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="given to .* twice"):
        _make(kind, [p, p])
    for dtype in (torch.float64, torch.complex64):
        with pytest.raises(ValueError, match=f"got {dtype}"):
            _make(kind, [torch.nn.Parameter(torch.zeros(3, dtype=dtype))])


@pytest.mark.parametrize("kind", list(CLASSES))
def test_misuse_after_the_first_step_is_a_clear_error_before_anything_moves(kind):
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    opt = _make(kind, [a, b])
    a.grad, b.grad = torch.randn(4), torch.randn(3)
    opt.step()
    with pytest.raises(ValueError, match="add_param_group after"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    edits = [("lr", float("nan"), "Invalid lr in param group 0: nan"),
             ("lr", -1.0, "Invalid lr in param group 0: -1.0"),
             ("weight_decay", float("inf"), "Invalid weight_decay"),
             ("betas", (0.9, 0.99), "betas=\\(0.9, 0.99\\) in param group 0.*not beta2")]
    for key, value, match in edits:
        snapshot = _snapshot(opt, [a, b])
        saved = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=match):
            opt.step()
        _assert_untouched(opt, [a, b], snapshot)
        opt.param_groups[0][key] = saved
    snapshot = _snapshot(opt, [a, b])
    b.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable parameters changed"):
        opt.step()
    _assert_untouched(opt, [a, b], snapshot)
    b.requires_grad_(True)
    opt.step()  # back as it was: fine
    snapshot = _snapshot(opt, [a, b])
    kept = b.data
    b.data, b.grad = torch.randn(5), torch.randn(5)  # resized through .data: the same tensor object
    with pytest.raises(ValueError, match=r"parameter 1 .* has 5 elements .* 3 at the first step"):
        opt.step()
    b.data, b.grad = kept, torch.randn(3)
    _assert_untouched(opt, [a, b], snapshot)


def _disagreeing_run(rank, n, what):
    """Each rank builds its optimizer; ``what`` makes rank 1's differ. Returns the error each rank saw."""
    shapes = [(6, 4), (4,)]
    if what == "split" and rank == 1:
        shapes = [(4, 4), (12,)]  # the same 28 elements, split into layers differently
    if what == "count" and rank == 1:
        shapes = shapes + [(5,)]
    params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
    if what == "values" and rank == 1:
        params[1].data[2] = 1.5  # a per-rank seed, or a checkpoint loaded on one rank only
    kw = {"lr": 0.02 if what == "lr" and rank == 1 else 0.01}
    kw["freeze_step"] = 7 if what == "freeze" and rank == 1 else 5
    opt = onebitlamb.OneBitLamb(params, **kw)
    for p in params:
        p.grad = torch.ones_like(p)
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what,named", [("lr", "param groups \\(lr, weight_decay\\): rank 0 \\[\\(0.01, 0.0\\)\\], "
                                               "rank 1 \\[\\(0.02, 0.0\\)\\]"),
                                        ("freeze", "freeze_step: rank 0 'freeze_step=5', rank 1 'freeze_step=7'"),
                                        ("split", "parameter sizes: rank 0 \\[24, 4\\], rank 1 \\[16, 12\\]"),
                                        ("count", "parameter sizes: rank 0 \\[24, 4\\], rank 1 \\[24, 4, 5\\]"),
                                        ("values", "parameter values \\(crc32 of each tensor\\): rank 0 \\[\\d+, "
                                                   "(\\d+)\\], rank 1 \\[\\d+, (?!\\1)\\d+\\]")])
def test_ranks_that_built_different_optimizers_fail_at_the_first_step(what, named):
    """Before: a different lr or layer split drifted apart silently, a different freeze_step hung
    until the process group's timeout, a different parameter count aborted inside gloo."""
    errors = run_ranks(_disagreeing_run, 2, (what,), timeout_s=120, collective_timeout_s=60)
    assert errors[0] == errors[1] and errors[0] is not None
    assert "the ranks built different optimizers" in errors[0]
    import re
    assert re.search(named, errors[0]), errors[0]


def _one_rank_differs(rank, n, what):
    """Rank 0 alone overlaps, or alone passes the node groups every rank made."""
    groups = onebitlamb.comm.node_groups(2) if what == "node groups" else None
    params = [torch.nn.Parameter(torch.ones(6, 4))]
    kw = ({"overlap_with_backward": rank == 0, "bucket_cap_mb": 1.0} if what == "overlap"
          else {"process_group": groups if rank == 0 else None})
    opt = _make("onebitlamb", params, **kw)
    params[0].grad = torch.full((6, 4), float(rank + 1))
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what,named", [("overlap", "overlap_with_backward"),
                                        ("node groups", "ranks per node")])
def test_a_setting_of_one_rank_only_is_an_error_on_every_rank_not_a_wait(what, named):
    """The overlap made its thread's process group (a collective) at construction: a rank built
    without it left the others waiting there until the timeout."""
    for message in run_ranks(_one_rank_differs, 2, (what,), timeout_s=60, collective_timeout_s=20):
        assert message is not None and "built different optimizers" in message and named in message, message


def _one_rank_refused_at_construction(rank, n):
    """Rank 0's constructor refuses an argument it alone was given; rank 1 steps."""
    import time
    p = torch.nn.Parameter(torch.ones(8))
    started = time.monotonic()
    try:
        opt = onebitlamb.ZeroOneAdam([p], var_freeze_step=4, overlap_with_backward=rank == 0)
        p.grad = torch.ones(8)
        opt.step()
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e), time.monotonic() - started
    return None


def test_a_constructor_error_on_one_rank_is_named_by_the_rank_left_waiting():
    """Rank 0's constructor raises; rank 1, built fine, waits in its first step's agreement. Its
    error, when the other rank's process is gone or the wait times out, names the first step's
    agreement and the likely cause (a constructor that refused an argument on another rank), not
    only gloo's words."""
    (kind0, said0, _), (kind1, said1, waited) = run_ranks(_one_rank_refused_at_construction, 2, (),
                                                          timeout_s=60, collective_timeout_s=4)
    assert kind0 == "ValueError" and "overlap_with_backward" in said0
    assert kind1 == "RuntimeError" and "rank 1 waited in the first step's agreement" in said1, said1
    assert "constructor refused an argument given on that rank only" in said1 and waited < 30


def _one_rank_refuses_its_state(rank, n):
    """1-bit LAMB past its freeze on both ranks; then rank 0 loads its own state and rank 1 rank 0's
    (whose compression errors are rank 0's: refused), and both step."""
    import torch.distributed as dist
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = _make("onebitlamb", params, freeze_step=2)
    for call in range(1, 4):
        for p, g in zip(params, _grads(rank, call)):
            p.grad = g
        opt.step()
    states = [copy.deepcopy(opt.state_dict())]
    dist.broadcast_object_list(states, src=0)
    resumed = _make("onebitlamb", params, freeze_step=2)
    try:
        resumed.load_state_dict(opt.state_dict() if rank == 0 else states[0])
        for p, g in zip(params, _grads(rank, 4)):
            p.grad = g
        resumed.step()
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


def test_a_state_refused_on_one_rank_is_named_on_every_rank():
    """Rank 1's load_state_dict refuses the state it is given (rank 0's): before, rank 0 loaded its
    own, waited in its next step's agreement and then blamed a constructor that had refused an
    argument on another rank; now load_state_dict's verdict is agreed, and rank 0 raises too,
    naming rank 1 and its reason, with nothing loaded."""
    (kind0, said0), (kind1, said1) = run_ranks(_one_rank_refuses_its_state, 2, (), timeout_s=60,
                                               collective_timeout_s=4)
    reason = "the optimizer state holds rank 0's compression errors and is loaded on rank 1"
    assert kind1 == "ValueError" and reason in said1, said1
    assert kind0 == "ValueError" and "refused the optimizer state on rank(s) 1" in said0 and reason in said0, said0
    assert "constructor" not in said0


def _drifting_run(rank, n, kind, what):
    """Rank 1 alone changes its lr or its model after step 1; the ranks compare every 3 steps."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = _make(kind, params, agree_every=3)
    for call in range(1, 7):
        if call == 2 and rank == 1:
            if what == "lr":
                opt.param_groups[0]["lr"] = 0.02
            else:
                params[1].data[0] += 1.0
        for p, g in zip(params, _grads(rank, call)):
            p.grad = g
        try:
            opt.step()
        except ValueError as e:
            return call, str(e)
    return None


@pytest.mark.parametrize("kind,what,named", [("lamb", "lr", "param groups"), ("onebitlamb", "model", "parameter values"),
                                             ("onebitadam", "lr", "param groups")])
def test_ranks_that_drift_apart_after_the_first_step_fail_at_the_next_agreement(kind, what, named):
    """``agree_every`` (1000 by default): the drift is named at the next comparison, on every rank."""
    for out in run_ranks(_drifting_run, 2, (kind, what), timeout_s=120, collective_timeout_s=60):
        assert out is not None and out[0] == 3, out
        assert "drifted apart by step 3" in out[1] and named in out[1], out[1]


def _grads(rank, call):
    g = torch.Generator().manual_seed(100 * call + rank)
    return [torch.randn(6, 4, generator=g), torch.randn(4, generator=g)]


def _nan_run(rank, n, kind, poisoned_calls, omitted_calls, value=None):
    """Steps 1..12 of a 2-rank run (freeze at 5); at the ``poisoned_calls`` rank 1's gradient holds
    a NaN (or an inf; or ``value``), the ``omitted_calls`` are not made at all. Returns the final
    parameters, the skip count, what each call reported, and the state after every call."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = _make(kind, params, freeze_step=5) if kind != "lamb" else _make(kind, params)
    skipped, states = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(1, 13):
            if call in omitted_calls:
                continue
            grads = _grads(rank, call)
            if call in poisoned_calls and rank == 1:
                poison = value if value is not None else float("nan") if call % 3 else float("inf")
                grads[call % 2].view(-1)[3] = poison
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
            skipped.append(opt.last_step_skipped)
            states.append({k: v.clone() for k, v in flat_of(opt.state_dict()).items() if isinstance(v, torch.Tensor)})
    return {"params": [p.detach().clone() for p in params], "skipped_steps": opt.skipped_steps,
            "skipped": skipped, "warnings": [str(w.message) for w in caught], "stage": opt.stage,
            "states": states}


def _huge_gradient_runs(rank, n, kind, poisoned):
    """The same run with one element of rank 1's gradient at 3e38 and at 1e30 (finite, but its
    square is not), and without those steps."""
    return {"clean": _nan_run(rank, n, kind, (), poisoned),
            **{value: _nan_run(rank, n, kind, poisoned, (), value) for value in (3e38, 1e30)}}


@pytest.mark.parametrize("kind", list(CLASSES))
def test_a_non_finite_gradient_on_one_rank_is_skipped_on_every_rank(kind):
    """NaN or inf on rank 1 at a warm-up step (3) and at compression steps (8, 9): both ranks skip
    those steps and end bit for bit where a run that never made them ends."""
    poisoned = (3, 8, 9)
    out = run_ranks(_nan_run, 2, (kind, poisoned, ()), timeout_s=120, collective_timeout_s=60)
    clean = run_ranks(_nan_run, 2, (kind, (), poisoned), timeout_s=120, collective_timeout_s=60)
    for r in range(2):
        assert out[r]["skipped_steps"] == 3
        assert [i + 1 for i, s in enumerate(out[r]["skipped"]) if s] == list(poisoned)
        skips = [w for w in out[r]["warnings"] if "step skipped on every rank" in w]
        assert len(skips) == 3, out[r]["warnings"]
        for a, b in zip(out[r]["params"], clean[r]["params"]):
            assert torch.isfinite(a).all() and torch.equal(a, b)
        assert out[r]["stage"] == ("warmup" if kind == "lamb" else "compression")


@pytest.mark.parametrize("kind", list(CLASSES))
def test_a_huge_but_finite_gradient_on_one_rank_is_skipped_on_every_rank(kind):
    """A gradient element of 3e38 or 1e30 on rank 1 is finite, and so is the sum the finite check
    looked at, but its square (which enters the second moment and the norms) is not: at a warm-up
    step (3) and a compression step (8) every rank skips, the state stays finite and the same on
    both ranks at every step, and the run ends bit for bit where a run without those steps ends."""
    poisoned = (3, 8)
    out = run_ranks(_huge_gradient_runs, 2, (kind, poisoned), timeout_s=120, collective_timeout_s=60)
    for value in (3e38, 1e30):
        for r in range(2):
            run, clean = out[r][value], out[r]["clean"]
            assert [i + 1 for i, s in enumerate(run["skipped"]) if s] == list(poisoned), value
            for state in run["states"]:
                for key, tensor in state.items():
                    assert torch.isfinite(tensor).all(), (value, key)
            for a, b in zip(run["params"], clean["params"]):
                assert torch.isfinite(a).all() and torch.equal(a, b), value
        shared = [k for k in out[0][value]["states"][-1] if not k.endswith("_error")]
        for key in shared:  # the compression errors are each rank's own
            assert torch.equal(out[0][value]["states"][-1][key], out[1][value]["states"][-1][key]), (value, key)


def test_an_update_that_would_not_be_finite_is_refused_before_the_parameters_move():
    """Parameters at float32's limit: the gradient is fine, but the layer's norms overflow and the
    trust ratio becomes NaN; the parameters must not take it."""
    p = torch.nn.Parameter(torch.full((2,), 3e38))
    opt = onebitlamb.Lamb([p], lr=0.01, weight_decay=1.0)
    p.grad = torch.ones(2)
    held = _snapshot(opt, [p])
    with pytest.raises(FloatingPointError, match="update of step 1 is not finite"):
        opt.step()
    _assert_untouched(opt, [p], held)  # the moments and the step count too


def _absurd_lr_runs(rank, n, kind, lr, stage):
    """Two runs of 9 calls on the same gradients. In the first, the first call after call 2 whose
    stage is ``stage`` is made with ``lr`` set in param group 0 for that call only: it must be
    refused before anything changes (checked at once), and the run goes on. The second never
    makes that call. Returns what the refusal said and whether the runs ended alike."""
    ended, said, refused_at = [], None, None
    for absurd in (True, False):
        torch.manual_seed(0)
        # the second layer's parameters are large against its update: LAMB's trust ratio there is
        # its maximum, 10, and lr 1e38 times 10 overflows float32 after the first layer has moved
        params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(100 * torch.randn(4))]
        opt = (onebitlamb.ZeroOneAdam(params, lr=0.01, var_freeze_step=2, var_update_scaler=1, local_step_scaler=1)
               if kind == "zerooneadam" else _make(kind, params))
        for call in range(1, 10):
            for p, g in zip(params, _grads(rank, call)):
                p.grad = g
            if absurd and refused_at is None and call > 2 and opt.stage == stage:
                snapshot = _snapshot(opt, params)
                opt.param_groups[0]["lr"] = lr
                with pytest.raises(FloatingPointError) as refusal:
                    opt.step()
                opt.param_groups[0]["lr"] = 0.01
                _assert_untouched(opt, params, snapshot)
                said, refused_at = str(refusal.value), call
                continue
            if call != refused_at:
                opt.step()
        ended.append([p.detach().clone() for p in params])
    return said, all(torch.equal(a, b) for a, b in zip(*ended))


@pytest.mark.parametrize("kind,lr,stage", [("lamb", 1e38, "warmup"), ("onebitlamb", 1e38, "warmup"),
                                           ("onebitlamb", 1e38, "compression"), ("lamb", 3e37, "warmup"),
                                           ("onebitadam", 3e38, "compression"), ("zerooneadam", 3e38, "compression"),
                                           ("zerooneadam", 3e38, "local")])
def test_an_absurd_learning_rate_is_refused_on_every_rank_before_anything_moves(kind, lr, stage):
    """Before: lr 1e38 times LAMB's trust ratio overflowed float32 inside the step, a raw
    RuntimeError after the first layer had moved, with the step count and moments advanced;
    3e37 (LAMB) or 3e38 (Adam's) moved every parameter to about 1e38, silently, and no later step
    moved them. Now every rank refuses the step alike (also 0/1 Adam's local steps, whose updates
    are each rank's own), naming the learning rate, and the run goes on as if the call had not
    been made."""
    out = run_ranks(_absurd_lr_runs, 2, (kind, lr, stage), timeout_s=120, collective_timeout_s=60)
    (said, alike), (said1, alike1) = out
    assert said == said1 and alike and alike1, out
    assert f"lr={lr!r} (param group 0)" in said and "refused on every rank, nothing changed" in said, said
    assert "past 1.84e+19" in said, said


def test_a_run_that_keeps_diverging_ends_with_a_clear_error():
    p = torch.nn.Parameter(torch.ones(4))
    opt = onebitlamb.OneBitLamb([p], freeze_step=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(MAX_CONSECUTIVE_SKIPS - 1):
            p.grad = torch.full((4,), float("nan"))
            opt.step()
        p.grad = torch.ones(4)
        opt.step()  # a good step resets the count
        for _ in range(MAX_CONSECUTIVE_SKIPS - 1):
            p.grad = torch.full((4,), float("nan"))
            opt.step()
        with pytest.raises(FloatingPointError, match=f"{MAX_CONSECUTIVE_SKIPS} steps in a row"):
            opt.step()
    assert torch.isfinite(p).all() and opt.state["flat"]["step"] == 1


def _loss_scaled_run(rank, n):
    """Loss scaling as docs/optimizers.md recommends, with rank 1's gradients overflowing at step 4."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(1, 9):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * t + rank))
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if t == 4 and rank == 1:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            opt.step()
            scaler.update()
            skipped.append(opt.last_step_skipped)
    return [p.detach().clone() for p in model.parameters()], skipped


def test_loss_scaling_recipe_keeps_the_ranks_together():
    out = run_ranks(_loss_scaled_run, 2, (), timeout_s=120, collective_timeout_s=60)
    assert out[0][1] == out[1][1] == [False, False, False, True, False, False, False, False]
    for a, b in zip(out[0][0], out[1][0]):
        assert torch.equal(a, b) and torch.isfinite(a).all()
