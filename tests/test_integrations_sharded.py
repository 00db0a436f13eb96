"""ZeroRedundancyOptimizer, on 2 real gloo ranks: refused with a message naming the alternative,
never a crash inside a collective. FSDP2's shards are taken under HSDP, and its other set-ups
refused by name: tests/test_hsdp.py."""
from __future__ import annotations

import torch

import onebitlamb
from rank_pool import run_ranks


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def _zero(rank, n):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _model()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=onebitlamb.OneBitAdam, lr=0.01, freeze_step=3)
    model(torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))).sum().backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)


def test_zero_redundancy_optimizer_is_refused_at_the_first_step():
    for message in run_ranks(_zero, 2, (), timeout_s=120, collective_timeout_s=60):
        assert "the ranks built different optimizers: parameter sizes" in message
        assert "under a ZeroRedundancyOptimizer" in message and "onebitlamb.register_ddp" in message
