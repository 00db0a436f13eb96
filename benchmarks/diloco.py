"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105) as a reference implementation, outside the package: ``benchmarks.netsim``'s
worker times its steps on emulated hosts (``worker.DiLoCoSteps``; ``benchmarks.network``'s rows).

The algorithm (``DiLoCo``). Every worker starts from the same parameters theta and takes H inner
steps with its own optimizer, here LAMB (``onebitlamb.Lamb`` on a process group of its one rank:
it sends nothing, and its moments stay this worker's). Then each worker's outer gradient is
``theta - theta_i``, what its H steps moved it by; the workers average it with one float32
all-reduce, and an outer optimizer steps theta with the average: SGD with Nesterov momentum, the
paper's lr 0.7 and momentum 0.9. Every worker continues from the new theta, the same bits on every
rank; the inner moments are not reset. With H = 1, outer lr 1 and no momentum it is parameter
averaging after every step, which for an inner SGD without momentum is synchronous SGD on the mean
gradient (the tests check that, and H > 1 against a loop of n workers in one process). The bytes
are counted as the library counts its float32 all-reduce (``onebitlamb.comm.allreduce_mean_`` into
a ``CommStats``): ``2 (n-1)/n * 4 d`` bytes per sync for ``d`` parameters, LAMB's bytes of one step.

Its runner on the main job (``python -m benchmarks.diloco``, which wrote the "diloco" section of
BENCHMARKS.md and the ``diloco-H<H>`` runs the network benchmark's whole-run table reads) is
retired: ``docs/lab/retired_benchmarks.md``.
"""
from __future__ import annotations

import contextlib
import datetime
import math
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from onebitlamb.comm import CommStats, allreduce_mean_

# the paper's outer optimizer: SGD with Nesterov momentum
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def flatten(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' values, one float32 vector (a copy), in ``params``' order."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


@torch.no_grad()
def load_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into the parameters, in place (``vector_to_parameters`` would make each
    parameter a view of ``flat`` instead)."""
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.copy_(chunk.view_as(p))


class DiLoCo:
    """DiLoCo's state on one rank: the parameters of the last sync (``anchor``, float32, the same on
    every rank), the outer optimizer that steps them, H, the counters and the bytes sent.

    Call ``step()`` after each step of the inner optimizer (which must not communicate: a
    ``torch.optim`` optimizer, or ``onebitlamb.Lamb`` on a process group of this rank alone). Every
    ``H``-th call syncs: the outer gradient ``anchor - params`` averaged over ``process_group``
    (one float32 all-reduce), the outer optimizer's step on the anchor with it, and the anchor
    copied into the parameters. ``step(sync=True)`` syncs now (the run's last step)."""

    def __init__(self, params: Iterable[torch.Tensor], H: int, *, outer_lr: float = OUTER_LR,
                 outer_momentum: float = OUTER_MOMENTUM, process_group: Optional[dist.ProcessGroup] = None) -> None:
        if isinstance(H, bool) or not isinstance(H, int) or H < 1:
            raise ValueError(f"H must be a number of inner steps >= 1, got {H!r}")
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got {outer_lr!r}, {outer_momentum!r}")
        unique: Dict[int, torch.Tensor] = {}
        for p in params:  # a tied weight once, as the optimizers take it
            if p.requires_grad and p.numel() > 0:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        self.H, self.process_group = H, process_group
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.anchor = flatten(self.params)
        self.outer = torch.optim.SGD([self.anchor], lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.comm_stats = CommStats()
        self.since_sync = 0  # inner steps since the last sync
        self.syncs = 0
        self.failed = False  # an inner step of this rank failed since the last sync

    @property
    def numel(self) -> int:
        return self.anchor.numel()

    def step(self, sync: bool = False, finite: bool = True) -> bool:
        """One inner step is done; sync when it is the H-th since the last sync (or ``sync``).
        ``finite=False``: this rank's inner step failed (its model is lost); it goes on to the next
        sync, which every rank reaches at the same step, and sends NaN there, so that every rank
        stops at that sync alike. Returns whether this step synced."""
        self.since_sync += 1
        self.failed = self.failed or not finite
        if not (sync or self.since_sync >= self.H):
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step, on every rank alike; FloatingPointError on every rank when the averaged
        outer gradient is not finite (on any rank), the parameters left as they were."""
        outer_grad = self.anchor - flatten(self.params)
        if self.failed:
            outer_grad.fill_(math.nan)
        allreduce_mean_(outer_grad, self.process_group, self.comm_stats)  # one float32 all-reduce, counted
        if not bool(torch.isfinite(outer_grad).all()):
            raise FloatingPointError(f"DiLoCo: the averaged outer gradient of sync {self.syncs + 1} is not finite "
                                     f"(a rank's model diverged in its inner steps)")
        self.anchor.grad = outer_grad
        self.outer.step()
        self.anchor.grad = None
        load_flat(self.params, self.anchor)
        self.since_sync = 0
        self.syncs += 1

    @contextlib.contextmanager
    def synced_parameters(self) -> Iterator[None]:
        """Inside: the parameters are the last sync's (what the run has agreed on), e.g. to evaluate
        between two syncs; after: this rank's own again, bit for bit."""
        if self.since_sync == 0:
            yield
            return
        own = flatten(self.params)
        load_flat(self.params, self.anchor)
        try:
            yield
        finally:
            load_flat(self.params, own)


def own_group(rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """A process group of this rank alone, for an inner optimizer that must not communicate
    (every rank makes every rank's group: ``dist.new_group`` is collective)."""
    groups = [dist.new_group([r], timeout=datetime.timedelta(seconds=timeout_s)) for r in range(world)]
    return groups[rank]


@dataclass(frozen=True)
class Settings:
    """DiLoCo's own settings, and the name of its run's folder (``benchmarks.network`` reads ``diloco-H16``)."""
    H: int
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM

    @property
    def name(self) -> str:
        """The run's folder and row: ``diloco-H8``, with the outer settings when not the paper's."""
        paper = (self.outer_lr, self.outer_momentum) == (OUTER_LR, OUTER_MOMENTUM)
        return f"diloco-H{self.H}" + ("" if paper else f"-olr{self.outer_lr:g}-om{self.outer_momentum:g}")
