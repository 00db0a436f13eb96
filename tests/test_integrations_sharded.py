"""FSDP2 and ZeroRedundancyOptimizer, on 2 real gloo ranks: refused with a message naming the
alternative (BENCHMARKS.md, 'Sharded training', measures why), never a crash inside a collective."""
from __future__ import annotations

import torch

import onebitlamb
from onebitlamb.comm.launch import spawn_local
from rank_pool import run_ranks


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def _fsdp(rank, n):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    try:
        onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=3)  # refused here, not at a step
    except ValueError as exc:
        return str(exc)


def _zero(rank, n):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _model()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=onebitlamb.OneBitAdam, lr=0.01, freeze_step=3)
    model(torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))).sum().backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)


def test_fsdp2_parameters_are_refused_at_construction():
    # a fresh process: FSDP2 builds a DeviceMesh, which torch keeps in a process-wide registry that
    # would outlive the process group the persistent ranks destroy after each call
    for message in spawn_local(_fsdp, 2, (), timeout_s=120, collective_timeout_s=60):
        assert "got a sharded parameter (DTensor" in message and "onebitlamb.register_ddp" in message


def test_zero_redundancy_optimizer_is_refused_at_the_first_step():
    for message in run_ranks(_zero, 2, (), timeout_s=120, collective_timeout_s=60):
        assert "the ranks built different optimizers: parameter sizes" in message
        assert "under a ZeroRedundancyOptimizer" in message and "onebitlamb.register_ddp" in message
