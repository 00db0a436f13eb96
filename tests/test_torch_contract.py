"""The optimizers behave as torch optimizers do where people rely on it: copies, the
state-dict hooks, a step without gradients, GradScaler's loop, schedulers
that move beta1, and the first-step check against a double DDP average without false alarms.
The checks at load time are in test_optimizers.py (test_world_size_and_rank_checks_on_load)."""
from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist

import onebitlamb
from rank_pool import run_ranks

CLASSES = {"lamb": onebitlamb.Lamb, "onebitlamb": onebitlamb.OneBitLamb, "onebitadam": onebitlamb.OneBitAdam,
           "zerooneadam": onebitlamb.ZeroOneAdam}
FREEZE = 3
# 0/1 Adam through every phase in a few steps: variance steps 1 and 2, a 1-bit step 3, the freeze
# after it, then syncs at every step, then at every second
ZERO_ONE = dict(var_freeze_step=FREEZE, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2)


def _make(kind, params, **kw):
    if kind == "zerooneadam":
        kw = {**ZERO_ONE, **kw}
    elif kind != "lamb":
        kw.setdefault("freeze_step", FREEZE)
    return CLASSES[kind](params, lr=0.01, **kw)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _batch(step, rank=0):
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model, opt, steps, rank=0):
    for t in steps:
        opt.zero_grad()
        model(_batch(t, rank)).square().mean().backward()
        opt.step()


# ---------------------------------------------------------------- copies
@pytest.mark.parametrize("kind", list(CLASSES))
def test_deepcopy_and_pickle_step_bit_for_bit_like_the_original(kind):
    """Copied in the warm-up; the three go on through the freeze (at 3) side by side."""
    model = _model()
    opt = _make(kind, model.parameters())
    _train(model, opt, range(2))
    copies = [copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))]
    for m, o in copies:
        assert o.stage == opt.stage and o.process_group is None and o.comm_stats == opt.comm_stats
        assert o.state_dict()["state"][0]["step"] == 2
    for t in range(2, 6):
        for m, o in [(model, opt), *copies]:
            _train(m, o, [t])
    for m, o in copies:
        assert o.stage == opt.stage and o.last_step_bytes == opt.last_step_bytes
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), model.parameters()))


def _copied_run(rank, n):
    """Two ranks: a copy made after the freeze steps as the original does, on the default group;
    one on a group that is not the world cannot be copied."""
    model = _model()
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=2)
    _train(model, opt, range(3), rank)
    m2, o2 = copy.deepcopy((model, opt))
    for t in range(3, 6):
        _train(model, opt, [t], rank)
        _train(m2, o2, [t], rank)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
    groups = [dist.new_group([r]) for r in range(n)]
    sub = onebitlamb.OneBitLamb(torch.nn.Linear(2, 2).parameters(), freeze_step=2, process_group=groups[rank])
    try:
        copy.deepcopy(sub)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return same, o2.stage, o2.comm_stats.bytes_sent > 0, [p.detach() for p in model.parameters()], refused


def test_a_copy_on_several_ranks_uses_the_default_group_and_steps_like_the_original():
    out = run_ranks(_copied_run, 2, (), timeout_s=120, collective_timeout_s=30)
    for same, stage, sent, _, refused in out:
        assert same and stage == "compression" and sent
        assert "not the whole world cannot be copied" in refused and "load_state_dict" in refused
    assert all(torch.equal(a, b) for a, b in zip(out[0][3], out[1][3]))


# ---------------------------------------------------------------- state-dict hooks
@pytest.mark.parametrize("kind", ["lamb", "onebitlamb", "zerooneadam"])
def test_state_dict_hooks_see_what_the_caller_sees(kind):
    model = _model()
    opt = _make(kind, model.parameters())
    _train(model, opt, range(4))
    seen = {}

    first = next(model.parameters())  # the parameter under whose index the optimizer's state is saved

    def pre(optimizer):
        optimizer.state["test"] = 1  # torch's own hook test does this
        optimizer.state[first]["hook_entry"] = torch.full((2,), 7.0)  # beside a parameter's state

    def post(optimizer, state_dict):
        seen["post"] = copy.deepcopy(state_dict)
        state_dict["post_hook_ran"] = True

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert sd["state"]["test"] == 1 and sd["post_hook_ran"]
    assert sorted(k for k in seen["post"]["state"] if k != "test") == [0, 1, 2, 3]
    assert "flat" not in seen["post"]["state"] and seen["post"]["state"][0]["step"] == 4

    # an entry put beside a parameter's state comes back under that parameter, as with AdamW, not
    # inside the optimizer's own state, and is saved again from there
    plain = _make(kind, model.parameters())
    plain.load_state_dict(sd)
    assert torch.equal(plain.state[first]["hook_entry"], torch.full((2,), 7.0))
    assert "hook_entry" not in plain.state["flat"] and "hook_entry" in plain.state_dict()["state"][0]
    adamw = torch.optim.AdamW(model.parameters())
    _train(model, adamw, range(1))
    adamw.register_state_dict_pre_hook(pre)
    adamw_fresh = torch.optim.AdamW(model.parameters())
    adamw_fresh.load_state_dict(adamw.state_dict())
    assert torch.equal(adamw_fresh.state[first]["hook_entry"], plain.state[first]["hook_entry"])

    # a load pre-hook may change the state dict, or return another: what it returns is loaded
    later = _make(kind, model.parameters())
    _train(model, later, range(6))
    later_state = later.state_dict()

    def load_pre(optimizer, state_dict):
        seen["load_pre"] = True
        if state_dict["state"]:
            return {**state_dict, "state": {**later_state["state"], "test": state_dict["state"]["test"]}}

    def load_post(optimizer):
        seen["load_post"] = (optimizer.state_dict()["state"][0]["step"], optimizer.skipped_steps)

    fresh = _make(kind, model.parameters())
    fresh.register_load_state_dict_pre_hook(load_pre)
    fresh.register_load_state_dict_post_hook(load_post)
    fresh.load_state_dict(sd)
    assert seen["load_pre"] and seen["load_post"] == (6, 0)
    assert fresh.state["test"] == 1  # entries others put in the state come back

    # a post-hook after loading a state dict without any optimizer state sees a complete optimizer
    empty = {"state": {}, "param_groups": sd["param_groups"]}
    fresh.load_state_dict(empty)
    assert seen["load_post"] == (0, 0)


# ---------------------------------------------------------------- no gradient at all
def test_a_step_without_any_gradient_counts_them_as_zero():
    """The documented difference from torch.optim (docs/optimizers.md): a missing gradient is a
    zero one, so the step counts and the momentum and weight decay move the parameters."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = onebitlamb.Lamb([p], lr=0.1, weight_decay=0.1)
    p.grad = torch.ones(4)
    opt.step()
    p.grad = None
    before = p.detach().clone()
    opt.step()
    assert opt.state["flat"]["step"] == 2 and not torch.equal(p.detach(), before)


def _no_grad_on_rank_1_run(rank, n):
    model = _model()
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=2)
    for t in range(5):  # the warm-up and the compressed stage
        opt.zero_grad()
        if rank == 0:
            model(_batch(t, rank)).square().mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()], opt.stage


def test_a_rank_without_gradients_enters_every_collective():
    out = run_ranks(_no_grad_on_rank_1_run, 2, (), timeout_s=120, collective_timeout_s=30)
    assert out[0][1] == out[1][1] == "compression"
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0]))


# ---------------------------------------------------------------- GradScaler
def _scaler_run(rank, n, kind, unscale_first):
    """The standard AMP loop; rank 1's gradient overflows at a warm-up step (2) and at a
    compressed one (6), the freeze coming at the end of step 3."""
    model = _model()
    opt = _make(kind, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    skipped, scales = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the scaler's, about passing itself
        for t in range(1, 9):
            opt.zero_grad()
            scaler.scale(model(_batch(t, rank)).square().mean()).backward()
            if rank == 1 and t in (2, 6):
                model[0].weight.grad[0, 0] = float("inf")
            if unscale_first:  # to clip, as torch's AMP examples do
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            skipped.append(opt.last_step_skipped)
            scales.append(scaler.get_scale())
    return [p.detach() for p in model.parameters()], skipped, scales, opt.stage


@pytest.mark.parametrize("kind,unscale_first", [("onebitlamb", False), ("onebitadam", True), ("lamb", False),
                                                ("zerooneadam", False)])
def test_grad_scaler_loop_with_one_rank_overflowing_keeps_the_ranks_together(kind, unscale_first):
    """0/1 Adam: the overflows at a variance step (2) and at a sync (6); its 6 steps end with a sync
    (the ranks' parameters alike), the next step local."""
    out = run_ranks(_scaler_run, 2, (kind, unscale_first), timeout_s=120, collective_timeout_s=30)
    (p0, skipped0, scales0, stage0), (p1, skipped1, scales1, stage1) = out
    assert skipped0 == skipped1 == [t in (2, 6) for t in range(1, 9)]
    assert scales0 == scales1 and scales0[-1] == 2.0 ** 10 * 0.5 ** 2  # backed off twice, on both ranks
    assert stage0 == stage1 == {"lamb": "warmup", "zerooneadam": "local"}.get(kind, "compression")
    assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(p0, p1))


def test_grad_scaler_single_process_matches_unscaling_by_hand():
    """scaler.step(opt) steps as opt.step() on the unscaled gradients; an overflow skips."""
    runs = []
    for via_scaler in (True, False):
        model = _model()
        opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t in range(5):
                opt.zero_grad()
                loss = model(_batch(t)).square().mean()
                if via_scaler:
                    scaler.scale(loss).backward()
                    if t == 3:
                        model[0].bias.grad[0] = float("nan")
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    if t != 3:
                        opt.step()
        runs.append([p.detach() for p in model.parameters()])
        assert not via_scaler or (opt.skipped_steps == 1 and scaler.get_scale() == 2.0 ** 7)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ---------------------------------------------------------------- schedulers moving beta1
def test_one_cycle_lr_with_its_defaults_moves_beta1():
    """OneCycleLR's cycle_momentum sets betas[0] in every group at each step: the step reads it."""
    out = {}
    for cycle in (True, False):
        model = _model()
        opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=FREEZE)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=8, cycle_momentum=cycle)
        first_lr, first_beta1 = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]
        for t in range(8):
            _train(model, opt, [t])
            sched.step()
            if t == 0:
                after_one = [p.detach().clone() for p in model.parameters()]
        out[cycle] = [p.detach() for p in model.parameters()], after_one, first_lr, first_beta1
    (moved, one, lr, beta1), (fixed, _, _, _) = out[True], out[False]
    assert beta1 == 0.95 and not all(torch.equal(a, b) for a, b in zip(moved, fixed))
    # its first step is that of an optimizer built with that beta1
    model = _model()
    _train(model, onebitlamb.OneBitLamb(model.parameters(), lr=lr, betas=(beta1, 0.999), freeze_step=FREEZE), [0])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), one))


def test_beta2_and_beta1_per_group_are_refused_naming_why():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = onebitlamb.OneBitLamb([{"params": [a]}, {"params": [b]}], freeze_step=2)
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    opt.param_groups[0]["betas"] = (0.9, 0.99)
    with pytest.raises(ValueError, match="lets a scheduler move beta1.*not beta2"):
        opt.step()
    opt.param_groups[0]["betas"] = (0.85, 0.999)
    with pytest.raises(ValueError, match="must be the same in every group"):
        opt.step()


def _one_cycle_run(rank, n):
    model = _model()
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=FREEZE)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=8)
    for t in range(8):
        _train(model, opt, [t], rank)
        sched.step()
    return [p.detach() for p in model.parameters()], opt.stage


def test_one_cycle_lr_on_two_ranks_through_the_freeze():
    out = run_ranks(_one_cycle_run, 2, (), timeout_s=120, collective_timeout_s=30)
    assert out[0][1] == out[1][1] == "compression"
    assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(out[0][0], out[1][0]))


# ---------------------------------------------------------------- the first-step check
def _same_batch_run(rank, n, kind):
    model = _model()
    opt = _make(kind, model.parameters())
    _train(model, opt, range(5), rank=0)  # every rank the same batch
    buf = io.BytesIO()
    torch.save([p.detach() for p in model.parameters()], buf)
    return buf.getvalue(), opt.stage


@pytest.mark.parametrize("kind", ["onebitlamb", "lamb"])
def test_the_same_batch_on_every_rank_is_no_false_alarm(kind):
    out = run_ranks(_same_batch_run, 2, (kind,), timeout_s=120, collective_timeout_s=30)
    assert out[0] == out[1]
