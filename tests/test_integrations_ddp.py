"""register_ddp on 2 real gloo ranks: DDP averages the warm-up, sends nothing after the freeze,
and the run is the plain usage's; a DDP-wrapped model without it is stopped at the first step."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import onebitlamb
from rank_pool import run_ranks

STEPS, FREEZE = 12, 5


def _model():
    torch.manual_seed(0)  # the same start on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)


def _optimizer(kind, params, warmup_dtype=torch.float32):
    if kind == "Lamb":
        return onebitlamb.Lamb(params, lr=0.02, warmup_dtype=warmup_dtype)
    if kind == "ZeroOneAdam":  # variance steps 1, 2 and 4, 1-bit steps 3 and 5, then syncs and local steps
        return onebitlamb.ZeroOneAdam(params, lr=0.02, var_freeze_step=FREEZE, var_update_scaler=2,
                                      local_step_scaler=2, local_step_clipper=2, warmup_dtype=warmup_dtype)
    return getattr(onebitlamb, kind)(params, lr=0.02, freeze_step=FREEZE, warmup_dtype=warmup_dtype)


def _run(rank, n, kind, mode, warmup_dtype=torch.float32):
    """``mode``: "plain" (the optimizer averages), "registered" (DDP + register_ddp), "ddp" (DDP
    alone), "no_sync" (registered, but the backward runs under no_sync). Returns the final
    parameters and, per step, the all_reduce calls made from Python during the backward."""
    model = _model()
    net = DistributedDataParallel(model) if mode != "plain" else model
    opt = _optimizer(kind, model.parameters(), warmup_dtype)
    if mode in ("registered", "no_sync"):
        onebitlamb.register_ddp(net, opt)
    calls, real_all_reduce = [0], dist.all_reduce

    def counting(*args, **kw):
        calls[0] += 1
        return real_all_reduce(*args, **kw)

    per_step = []
    try:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            opt.zero_grad()
            calls[0], dist.all_reduce = 0, counting
            try:
                if mode == "no_sync":  # DDP reads no_sync() at the forward
                    with net.no_sync():
                        torch.nn.functional.cross_entropy(net(x), y).backward()
                else:
                    torch.nn.functional.cross_entropy(net(x), y).backward()
            finally:
                dist.all_reduce = real_all_reduce
            per_step.append((opt.stage, calls[0]))
            opt.step()
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return [p.detach().clone() for p in model.parameters()], per_step, opt.comm_stats.bytes_sent


# DDP's hook follows the stage, not the class: OneBitLamb's run averages the warm-up and is silent
# after its freeze; the other two classes only in the slow run
@pytest.mark.parametrize("kind", ["OneBitLamb", pytest.param("OneBitAdam", marks=pytest.mark.slow),
                                  pytest.param("Lamb", marks=pytest.mark.slow)])
def test_registered_ddp_follows_the_plain_run_and_is_silent_after_the_freeze(kind):
    plain = run_ranks(_run, 2, (kind, "plain"), timeout_s=120, collective_timeout_s=60)
    registered = run_ranks(_run, 2, (kind, "registered"), timeout_s=120, collective_timeout_s=60)
    for (p_params, p_steps, p_bytes), (r_params, r_steps, r_bytes) in zip(plain, registered):
        # 2 ranks: a+b is exact either way round, so DDP's buckets and the flat buffer agree bitwise
        assert all(torch.equal(a, b) for a, b in zip(p_params, r_params))
        assert all(calls == 0 for _, calls in p_steps)
        warmup = [calls for stage, calls in r_steps if stage == "warmup"]
        compression = [calls for stage, calls in r_steps if stage == "compression"]
        assert len(warmup) == (STEPS if kind == "Lamb" else FREEZE)
        assert all(calls >= 1 for calls in warmup)  # DDP averaged through the hook
        assert compression == [0] * len(compression)  # and sent nothing once compressing
        assert r_bytes == p_bytes  # the same bytes, now counted in the hook
    assert all(torch.equal(a, b) for a, b in zip(registered[0][0], registered[1][0]))


def test_registered_ddp_averages_only_at_zero_one_adams_variance_steps():
    """0/1 Adam under DDP: DDP's hook averages at the variance steps only, and sends nothing at the
    1-bit steps, the syncs and the local steps; every rank as in the plain run, bit for bit."""
    plain = run_ranks(_run, 2, ("ZeroOneAdam", "plain"), timeout_s=120, collective_timeout_s=60)
    registered = run_ranks(_run, 2, ("ZeroOneAdam", "registered"), timeout_s=120, collective_timeout_s=60)
    for (p_params, p_steps, p_bytes), (r_params, r_steps, r_bytes) in zip(plain, registered):
        assert all(torch.equal(a, b) for a, b in zip(p_params, r_params))
        assert {stage for stage, _ in r_steps} == {"warmup", "compression", "local"}
        assert all((calls >= 1) == (stage == "warmup") for stage, calls in r_steps)
        assert r_bytes == p_bytes


def test_registered_ddp_sends_the_warmup_in_bfloat16_as_the_optimizer_does():
    """With warmup_dtype=torch.bfloat16 DDP's hook averages in bfloat16 too: the same run as the
    plain usage's, bit for bit, at half the warm-up bytes of the float32 run."""
    full = run_ranks(_run, 2, ("OneBitLamb", "plain"), timeout_s=120, collective_timeout_s=60)
    half = ("OneBitLamb", "plain", torch.bfloat16)
    plain = run_ranks(_run, 2, half, timeout_s=120, collective_timeout_s=60)
    registered = run_ranks(_run, 2, ("OneBitLamb", "registered", torch.bfloat16), timeout_s=120,
                             collective_timeout_s=60)
    for (f_params, _, f_bytes), (p_params, _, p_bytes), (r_params, _, r_bytes) in zip(full, plain, registered):
        assert all(torch.equal(a, b) for a, b in zip(p_params, r_params)) and p_bytes == r_bytes
        assert not all(torch.equal(a, b) for a, b in zip(p_params, f_params))  # bfloat16 did round
        assert all(torch.allclose(a, b, atol=0.02) for a, b in zip(p_params, f_params))
        assert p_bytes < 0.6 * f_bytes  # the warm-up is most of these bytes; it halved


@pytest.mark.parametrize("kind", ["OneBitLamb", "Lamb"])
def test_a_ddp_model_without_register_ddp_is_stopped_at_the_first_step(kind):
    errors = run_ranks(_run, 2, (kind, "ddp"), timeout_s=120, collective_timeout_s=60)
    assert errors[0] == errors[1]
    assert "identical on all 2 ranks" in errors[0] and "onebitlamb.register_ddp(ddp_model, optimizer)" in errors[0]


def test_a_registered_optimizer_refuses_gradients_ddp_did_not_average():
    errors = run_ranks(_run, 2, ("OneBitLamb", "no_sync"), timeout_s=120, collective_timeout_s=60)
    assert all("DDP averaged no gradient since the last step" in e for e in errors)


def test_register_ddp_refuses_what_it_cannot_serve():
    model = _model()
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=3)
    with pytest.raises(ValueError, match="needs the DistributedDataParallel-wrapped model, got Sequential"):
        onebitlamb.register_ddp(model, opt)
    with pytest.raises(ValueError, match="needs a onebitlamb optimizer .* got SGD"):
        onebitlamb.register_ddp(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _mismatched_params(rank, n):
    model, other = _model(), torch.nn.Linear(2, 2)
    net = DistributedDataParallel(model)
    errors = []
    for params in (list(model.parameters()) + list(other.parameters()), list(model.parameters())[:-1]):
        try:
            onebitlamb.register_ddp(net, onebitlamb.OneBitLamb(params, lr=0.01, freeze_step=3))
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_register_ddp_refuses_parameters_the_two_do_not_share():
    """An optimizer's parameter outside DDP would never be averaged in the warm-up; a DDP parameter
    outside the optimizer, never after the freeze (the hook then sends no bucket)."""
    for extra, missing in run_ranks(_mismatched_params, 2, (), timeout_s=60, collective_timeout_s=30):
        assert "2 of OneBitLamb's trainable parameters are not parameters of the DDP model" in extra
        assert "1 of the DDP model's trainable parameters are not OneBitLamb's (2.bias)" in missing


# --------------------------------------------------------------------------- the int8 warm-up under DDP
# A model of just over 1 MiB: DDP puts it in one bucket at the first backward, then re-cuts it into
# two (its first bucket closes at 1 MiB); the optimizer's cap cuts it into four others. The int8
# errors must follow the optimizer's buckets whatever DDP's are.
OPT_BUCKET_MB = 0.1


def _wide_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 10))


def _int8_run(rank, n, mode, nan_at=None, save_at=None, resume=None):
    """OneBitLamb with the int8 warm-up for STEPS steps through its freeze at FREEZE. ``mode``:
    "plain" (no DDP, the optimizer averages) or "registered" (DDP + register_ddp). ``nan_at``: a
    step whose gradient is NaN on rank 1. ``save_at``: the states (optimizer's, model's) after that
    many steps are returned too. ``resume``: (step, every rank's saved states): start from this
    rank's and run the remaining steps. Returns the final parameters, per step the bytes the step
    sent and the buckets DDP handed over, the states saved, the optimizer's stats and buckets."""
    import copy
    import warnings

    model = _wide_model()
    net = DistributedDataParallel(model) if mode == "registered" else model
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.02, freeze_step=FREEZE, warmup_dtype="int8",
                                bucket_cap_mb=OPT_BUCKET_MB)
    link = onebitlamb.register_ddp(net, opt) if mode == "registered" else None
    start, saved = 0, None
    if resume is not None:
        start, states = resume
        model.load_state_dict(states[rank][1])
        opt.load_state_dict(states[rank][0])
    per_step = []
    for step in range(start, STEPS):
        if step == save_at:
            saved = (copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict()))
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        if step == nan_at and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        buckets = link.buckets_since_step if link is not None else 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skipped step's
            opt.step()
        per_step.append((opt.stats()["last_step_bytes"], buckets))
    return [p.detach().clone() for p in model.parameters()], per_step, saved, opt.stats(), opt.state["flat"]["buckets"]


def _int8_warmup_bytes(ranges):
    """What a warm-up step sends on 2 ranks: the 4-byte flag that every rank's gradient is finite,
    and each of the optimizer's buckets in int8 codes, every parameter starting a block."""
    from onebitlamb.comm import quantized_wire_bytes
    from onebitlamb.comm.stats import allreduce_bytes

    numels = [p.numel() for p in _wide_model().parameters()]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    codes = sum(quantized_wire_bytes(b - a, 2, "int8", segments=[n for o, n in zip(offsets, numels) if a <= o < b])
                for a, b in ranges)
    return allreduce_bytes(4, 2) + codes, allreduce_bytes(4 * sum(numels), 2)


def test_registered_ddp_averages_the_int8_warmup_as_the_optimizer_does():
    """DDP + register_ddp with warmup_dtype="int8": the hook holds DDP's buckets until the last one,
    then the optimizer's own exchange averages them with the errors of its own buckets. Through the
    freeze every rank's parameters are the plain run's bit for bit (no tolerance: the same code on
    the same flat layout; DDP's buckets only say where the gradients are), and every warm-up step
    sends the int8 bytes, counted in opt.stats()."""
    plain = run_ranks(_int8_run, 2, ("plain",), timeout_s=120, collective_timeout_s=60)
    registered = run_ranks(_int8_run, 2, ("registered",), timeout_s=120, collective_timeout_s=60)
    for (p_params, p_steps, _, p_stats, ranges), (r_params, r_steps, _, r_stats, _) in zip(plain, registered):
        assert all(torch.equal(a, b) for a, b in zip(p_params, r_params))
        assert r_stats["freeze_step"] == p_stats["freeze_step"] == FREEZE and r_stats["stage"] == "compression"
        assert len(ranges) == 4 and [b for _, b in r_steps[:FREEZE]] == [1] + [2] * (FREEZE - 1)
        int8, float32 = _int8_warmup_bytes(ranges)
        assert [b for b, _ in r_steps] == [b for b, _ in p_steps]
        assert [b for b, _ in r_steps[:FREEZE]] == [int8] * FREEZE and int8 < 0.3 * float32
        assert r_stats["bytes_sent"] == p_stats["bytes_sent"]
    assert all(torch.equal(a, b) for a, b in zip(registered[0][0], registered[1][0]))


def test_registered_ddp_skips_a_nan_in_the_int8_warmup_as_the_optimizer_does():
    """Rank 1's gradient NaN at step 2: the hook hands NaN back on every rank, every rank skips the
    step with the errors untouched, and the run goes on as the plain run does, bit for bit."""
    plain = run_ranks(_int8_run, 2, ("plain", 2), timeout_s=120, collective_timeout_s=60)
    registered = run_ranks(_int8_run, 2, ("registered", 2), timeout_s=120, collective_timeout_s=60)
    for (p_params, _, _, p_stats, _), (r_params, _, _, r_stats, _) in zip(plain, registered):
        assert r_stats["skipped_steps"] == p_stats["skipped_steps"] == 1
        assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(p_params, r_params))


def test_a_checkpoint_of_the_int8_warmup_under_ddp_resumes_bit_for_bit():
    """Saved in the warm-up (the int8 errors hold something), resumed under DDP, or without it: the
    state is the optimizer's own either way, and both end where the uninterrupted run ends."""
    full = run_ranks(_int8_run, 2, ("registered", None, 3), timeout_s=120, collective_timeout_s=60)
    states = [saved for _, _, saved, _, _ in full]
    errors = [saved[0]["state"][0][f"rank{r}"]["warmup_worker_error"] for r, saved in enumerate(states)]
    assert errors[0].abs().sum() > 0 and not torch.equal(errors[0], errors[1])  # each rank's own, to resume
    for mode in ("registered", "plain"):
        resumed = run_ranks(_int8_run, 2, (mode, None, None, (3, states)), timeout_s=120, collective_timeout_s=60)
        for (params, *_), (whole, *_) in zip(resumed, full):
            assert all(torch.equal(a, b) for a, b in zip(params, whole)), mode


class _Far(torch.nn.Module):
    """The small model and a parameter that takes part in the forward at weight 0: its gradient is 0,
    so a value at float32's limit reaches only the update, whose norm then overflows."""

    def __init__(self):
        super().__init__()
        self.body = _model()
        self.far = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.body(x) + (self.far * 0).sum()


def _refused_update_run(rank, n, mode):
    """Two int8 warm-up steps, then one whose update is not finite (``far`` set to 3e38): step()
    refuses it with FloatingPointError. Returns the warm-up errors before and after that step."""
    model = _Far()
    net = DistributedDataParallel(model) if mode == "registered" else model
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.02, weight_decay=1.0, freeze_step=FREEZE,
                                warmup_dtype="int8")
    if mode == "registered":
        onebitlamb.register_ddp(net, opt)
    errors, refused = [], None
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                model.far.fill_(3e38)
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        errors.append([opt.state["flat"][k].clone() for k in ("warmup_worker_error", "warmup_server_error")])
        try:
            opt.step()
        except FloatingPointError as exc:
            refused = str(exc)
    errors.append([opt.state["flat"][k].clone() for k in ("warmup_worker_error", "warmup_server_error")])
    return errors, refused


def test_an_update_refused_after_the_hooks_int8_average_leaves_its_errors_as_before():
    """The hook averaged (its errors moved) before step() refused the step: the errors go back to what
    they were before the hook, as the plain run's go back to what they were before its exchange."""
    plain = run_ranks(_refused_update_run, 2, ("plain",), timeout_s=120, collective_timeout_s=60)
    registered = run_ranks(_refused_update_run, 2, ("registered",), timeout_s=120, collective_timeout_s=60)
    for (p_errors, p_refused), (r_errors, r_refused) in zip(plain, registered):
        assert "update of step 3 is not finite" in p_refused and "update of step 3 is not finite" in r_refused
        before_hook, after_hook, after_refusal = r_errors[1], r_errors[2], r_errors[3]
        assert not torch.equal(before_hook[0], after_hook[0])  # the hook's average moved them
        assert all(torch.equal(a, b) for a, b in zip(after_refusal, before_hook))
        assert all(torch.equal(a, b) for a, b in zip(after_refusal, p_errors[3]))
