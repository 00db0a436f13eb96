"""Gradient clipping for the optimizers' ranks: one factor for every rank.

``torch.nn.utils.clip_grad_norm_`` before ``opt.step()`` clips each rank's own, un-averaged
gradient, because the optimizer averages (the warm-up, LAMB) or compresses (after the freeze)
inside ``step()``: each rank is scaled by its own factor, so the average the optimizer steps on
leans towards the ranks whose gradients were small, and its norm is not the one bounded.
``clip_grad_norm_`` here scales every rank's gradient by the same factor, agreed with one
all-reduce of a float: the average keeps its direction and its norm is at most ``max_norm``.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    process_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` on every rank of ``process_group`` (the optimizer's;
    default: the world) by one factor, ``min(1, max_norm / r)``, where ``r`` is the root mean
    square of the ranks' gradient norms. ``r`` bounds the norm of the ranks' average gradient, what
    the optimizer steps on, and is that norm when the ranks hold the same gradient (under a
    registered DDP in the warm-up); where their gradients differ it clips harder than a clip of the
    average itself could, which only an all-reduce of the whole gradient would tell. A drop-in for
    ``torch.nn.utils.clip_grad_norm_(parameters, max_norm)``, called on every rank at the same step
    (it is a collective). Returns ``r`` (float64). A non-finite ``r`` leaves every gradient as it
    is, on every rank, for the optimizer to skip the step everywhere."""
    if not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm) or max_norm <= 0:
        raise ValueError(f"Invalid max_norm: {max_norm!r} (must be a finite number > 0)")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [i for i, g in enumerate(grads) if hasattr(g, "to_local")]
    if sharded:  # a shard's norm is a share of its layer's: the sum belongs to the shard group
        raise ValueError(f"clip_grad_norm_ takes whole (unsharded) parameters; {len(sharded)} gradient(s) are "
                         f"DTensors (FSDP2's shards)")
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        square += torch.linalg.vector_norm(g.detach(), dtype=torch.float64).to(device) ** 2
    ranks = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(square, group=process_group)
        ranks = dist.get_world_size(process_group)
    rms = (square / ranks).sqrt()
    if bool(torch.isfinite(rms)):  # the same on every rank after the all-reduce: an agreed choice
        factor = (max_norm / (rms + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.detach().mul_(factor.to(g.device, g.dtype))
    return rms
