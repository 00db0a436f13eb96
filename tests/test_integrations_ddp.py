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
