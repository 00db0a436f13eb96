"""onebitlamb.integrations.accelerate.prepare with real accelerate on 2 real gloo ranks: DDP averages
the warm-up and sends nothing after the freeze, the run is the plain usage's (with and without
``accelerator.accumulate``), and save_state/load_state after the freeze resumes every rank exactly."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import onebitlamb
from rank_pool import run_ranks

STEPS, FREEZE, SAVE_AT = 8, 3, 5  # saved after the freeze, so the compression errors are not zero


def _accelerator(rank, n, accumulation=1):
    # the process group is run_ranks's; accelerate's CPU path reads the ranks from the environment
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                      OMP_NUM_THREADS="1")
    from accelerate import Accelerator

    return Accelerator(cpu=True, gradient_accumulation_steps=accumulation)


def _model(seed=0):
    torch.manual_seed(seed)  # the same start on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _optimizer(model, warmup_dtype="float32"):
    return onebitlamb.OneBitLamb(model.parameters(), lr=0.02, freeze_step=FREEZE, warmup_dtype=warmup_dtype)


class _CountAllReduce:
    """Counts the all_reduce calls made from Python (DDP's hook makes them) inside the block."""

    def __enter__(self):
        self.calls, self._real = 0, dist.all_reduce

        def counting(*args, **kw):
            self.calls += 1
            return self._real(*args, **kw)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def _loss(net, rank, step, micro=0):
    x, y = _batch(rank, step, micro)
    return torch.nn.functional.cross_entropy(net(x), y)


def _train(rank, n, folder, accumulation, warmup_dtype="float32"):
    """The prepared run beside the plain one (no DDP, the optimizer averages), step by step; saves
    its state into ``folder`` after SAVE_AT steps. Returns both runs' parameters, the all_reduce
    calls of each backward with the stage, and this rank's compression error when saved."""
    from onebitlamb.integrations.accelerate import prepare

    accelerator = _accelerator(rank, n, accumulation)
    model = _model()
    net, optimizer = prepare(accelerator, model, _optimizer(model, warmup_dtype))
    plain = _model()
    plain_opt = _optimizer(plain, warmup_dtype)
    calls, error_at_save = [], None
    for step in range(STEPS):
        if step == SAVE_AT:
            accelerator.save_state(folder)
            error_at_save = optimizer.optimizer.state["flat"]["worker_error"].clone()
        for micro in range(accumulation):
            with accelerator.accumulate(net):
                stage = optimizer.optimizer.stage
                with _CountAllReduce() as count:
                    accelerator.backward(_loss(net, rank, step, micro))
                calls.append((stage, micro, count.calls))
                optimizer.step()
                optimizer.zero_grad()
            (_loss(plain, rank, step, micro) / accumulation).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    return ([p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in plain.parameters()],
            calls, error_at_save, optimizer.optimizer.stage)


def _resume(rank, n, folder, unsaved):
    """Fresh objects (another start, so the weights must come from the checkpoint) continue from
    ``folder`` to STEPS; first, the misuse that must raise before anything changes."""
    from accelerate.optimizer import AcceleratedOptimizer

    from onebitlamb.integrations.accelerate import prepare

    accelerator = _accelerator(rank, n)
    model = _model(seed=1)
    errors = []
    for bad in [(model,), (model, torch.optim.SGD(model.parameters(), lr=0.1)),
                (model, AcceleratedOptimizer(_optimizer(model)))]:
        try:
            prepare(accelerator, *bad)
        except ValueError as exc:
            errors.append(str(exc))
    net, optimizer = prepare(accelerator, model, _optimizer(model))
    try:
        prepare(accelerator, _model(), _optimizer(_model()))
    except ValueError as exc:
        errors.append(str(exc))
    before = [p.detach().clone() for p in model.parameters()]
    try:
        accelerator.load_state(unsaved)
    except FileNotFoundError as exc:
        errors.append(str(exc))
    untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    accelerator.load_state(folder)
    loaded_error = optimizer.optimizer.state["flat"]["worker_error"].clone()
    for step in range(SAVE_AT, STEPS):
        accelerator.backward(_loss(net, rank, step))
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], errors, untouched, loaded_error


def test_prepare_silences_ddp_after_the_freeze_and_resumes_every_rank_exactly(tmp_path):
    folder, unsaved = str(tmp_path / "ckpt"), str(tmp_path / "accelerate-only")
    full = run_ranks(_train, 2, (folder, 1), timeout_s=120, collective_timeout_s=60)
    for params, plain, calls, error, stage in full:
        assert stage == "compression"
        assert all(torch.equal(a, b) for a, b in zip(params, plain))  # the plain usage's run, bitwise
        warmup = [c for s, _, c in calls if s == "warmup"]
        compression = [c for s, _, c in calls if s == "compression"]
        assert len(warmup) == FREEZE and all(c >= 1 for c in warmup)  # DDP averaged through the hook
        assert len(compression) == STEPS - FREEZE and compression == [0] * len(compression)  # then sent nothing
        assert error.abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(full[0][0], full[1][0]))
    assert not torch.equal(full[0][3], full[1][3])  # per-rank errors: loading rank 0's on rank 1 would be wrong
    assert sorted(f for f in os.listdir(folder) if f.startswith("onebitlamb-")) == [
        "onebitlamb-optimizer-rank0-of-2.pt", "onebitlamb-optimizer-rank1-of-2.pt"]

    shutil.copytree(folder, unsaved, ignore=shutil.ignore_patterns("onebitlamb-*"))
    resumed = run_ranks(_resume, 2, (folder, unsaved), timeout_s=120, collective_timeout_s=60)
    for rank, (params, errors, untouched, loaded_error) in enumerate(resumed):
        assert torch.equal(loaded_error, full[rank][3])  # this rank's own errors, not rank 0's
        assert all(torch.equal(a, b) for a, b in zip(params, full[rank][0]))  # the uninterrupted run, bitwise
        assert all("exactly one onebitlamb optimizer (Lamb, OneBitLamb, OneBitAdam) among the objects, got 0" in e
                   for e in errors[:2])
        assert "as it was before accelerator.prepare" in errors[2]
        assert "already holds a onebitlamb optimizer" in errors[3]
        assert "holds no onebitlamb optimizer state per rank" in errors[4] and untouched
        assert len(errors) == 5


@pytest.mark.parametrize("warmup_dtype", ["float32", "int8"])
def test_prepare_follows_the_plain_run_under_gradient_accumulation(tmp_path, warmup_dtype):
    """With the int8 warm-up too: DDP's hook hands the backward's buckets to the optimizer's own
    quantised average, so the run is the plain one's, bit for bit."""
    runs = run_ranks(_train, 2, (str(tmp_path / "ckpt"), 2, warmup_dtype), timeout_s=120, collective_timeout_s=60)
    for params, plain, calls, _, _ in runs:
        assert all(torch.equal(a, b) for a, b in zip(params, plain))
        # the first micro-batch runs under no_sync; the second averages in the warm-up, then sends nothing
        assert [c for s, m, c in calls if m == 0] == [0] * STEPS
        assert all(c >= 1 for s, m, c in calls if m == 1 and s == "warmup")
        assert [c for s, m, c in calls if m == 1 and s == "compression"] == [0] * (STEPS - FREEZE)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))



def _zero_one_adam_saved_after_a_local_step(rank, n, folder):
    """0/1 Adam under prepare, its state saved right after a local step (every rank's parameters its
    own until then). Returns this rank's parameters after the save and whether they were apart."""
    from onebitlamb.integrations.accelerate import prepare

    accelerator = _accelerator(rank, n)
    model = _model()
    opt = onebitlamb.ZeroOneAdam(model.parameters(), lr=0.02, var_freeze_step=2, var_update_scaler=1,
                                 local_step_scaler=1)
    net, optimizer = prepare(accelerator, model, opt)
    for step in range(STEPS):
        accelerator.backward(_loss(net, rank, step))
        optimizer.step()
        optimizer.zero_grad()
        if not opt.parameters_synchronized:
            break
    apart = not opt.parameters_synchronized
    accelerator.save_state(folder)
    return [p.detach().clone() for p in model.parameters()], apart, opt.parameters_synchronized


def test_save_state_synchronizes_zero_one_adams_ranks_first(tmp_path):
    """Between 0/1 Adam's syncs every rank holds other parameters, and accelerate saves rank 0's
    model: ``save_state`` synchronizes the ranks first (``optimizer.synchronize()``), so the saved
    model is every rank's."""
    out = run_ranks(_zero_one_adam_saved_after_a_local_step, 2, (str(tmp_path / "ckpt"),), timeout_s=120,
                    collective_timeout_s=60)
    for _, apart, synchronized in out:
        assert apart and synchronized
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0]))
