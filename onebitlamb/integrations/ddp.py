"""1-bit optimizers under ``DistributedDataParallel``: one comm hook that follows the stage.

Without it, DDP all-reduces every gradient and the optimizer then exchanges its own (the
averaged gradient in the warm-up, the 1-bit momentum after): more bytes than DDP alone, every
step. With :func:`register_ddp` the two split the work:

- warm-up: DDP's bucketed all-reduce, overlapped with backward, averages the gradients
  (``sum / n``, as the optimizer's own average does); the optimizer takes them as they are. A
  quantised warm-up (``warmup_dtype="int8"``, ...) keeps error buffers in the optimizer's state,
  cut by the optimizer's buckets and agreed finite over the whole gradient first: the hook holds
  DDP's buckets until the last one of the backward is in, then the optimizer's own exchange
  averages them all (``Exchange.average_in_ddp_hook``), with the same errors and the same bytes as
  without DDP, and hands each bucket back averaged;
- compression stage: DDP sends nothing (each bucket is handed back as it came, like DDP's
  ``noop_hook``); the optimizer's 1-bit all-reduce of the momentum is the only exchange.

The hook reads ``optimizer.stage`` when each bucket is ready, so the freeze, decided at the end
of a step, takes effect at the next backward.
"""
# no `from __future__ import annotations`: DDP checks the hook's annotations as objects
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebitlamb.comm import average_, spanning_group, world_size_of
from onebitlamb.optim.staged import WARMUP, StagedOptimizer


class DDPLink:
    """The hook's state (like PowerSGD's ``PowerSGDState``): the optimizer whose stage decides,
    the group, how many buckets DDP handed the hook since the optimizer's last step, which the
    optimizer reads to make sure this step's gradients did go through DDP, and, for a quantised
    warm-up, the buckets of this backward held until the last one. The error buffers stay in the
    optimizer's state, which its checkpoints save."""

    def __init__(self, optimizer: StagedOptimizer, process_group: Optional[dist.ProcessGroup]) -> None:
        self.optimizer = optimizer
        self.process_group = process_group
        self.buckets_since_step = 0
        self._held: List[Tuple[List[torch.Tensor], List[torch.Tensor], torch.Tensor, torch.futures.Future]] = []

    def averages_this_step(self) -> bool:
        """Called by the optimizer's warm-up step: True when DDP averaged at least one bucket
        since the last step (it then resets the count)."""
        seen, self.buckets_since_step = self.buckets_since_step, 0
        return seen > 0

    def hold_for_quantized_average(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The future of ``bucket``'s quantised average: held until DDP hands over the backward's last
        bucket (DDP hands them in order), then all of them averaged at once by the optimizer's
        exchange. Why not bucket by bucket: the average agrees first that every rank's whole gradient
        is finite (a NaN must not reach the errors), and its errors follow the optimizer's buckets,
        not DDP's, which DDP re-cuts after its first backward."""
        if bucket.index() == 0:  # what a backward that raised left behind
            self._held = []
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._held.append((bucket.parameters(), bucket.gradients(), bucket.buffer(), done))
        if bucket.is_last():
            held, self._held = self._held, []
            with torch.no_grad():
                self.optimizer.prepare_state()  # the first backward, or the first after a load
                self.optimizer.exchange.average_in_ddp_hook(
                    [(p, g) for params, grads, _, _ in held for p, g in zip(params, grads)])
            for _, _, buffer, future in held:  # the gradients are views of the buffers, averaged in place
                future.set_result(buffer)
        return done


def _stage_hook(link: DDPLink, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    link.buckets_since_step += 1
    buffer = bucket.buffer()
    if link.optimizer.stage != WARMUP:  # compression, or 0/1 Adam's local steps: DDP sends nothing
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    exchange = link.optimizer.exchange  # the warm-up's average, as the optimizer itself takes it
    if exchange.quantizes_warmup:
        return link.hold_for_quantized_average(bucket)
    return average_(buffer, link.process_group, exchange.comm_stats, exchange.wire, async_op=True)


def register_ddp(ddp_model: DistributedDataParallel, optimizer: StagedOptimizer) -> DDPLink:
    """Let ``ddp_model`` average the warm-up's gradients for ``optimizer`` and send nothing once it
    compresses. Call it once, after wrapping the model and building the optimizer, before the
    first backward::

        model = DistributedDataParallel(model)
        opt = onebitlamb.OneBitLamb(model.parameters(), lr=..., freeze_step=AutoFreeze(steps))
        onebitlamb.register_ddp(model, opt)

    The trajectory is the plain usage's (an unwrapped model, the optimizer averaging); what
    changes is that the warm-up's all-reduce runs bucket by bucket behind the backward pass (a
    quantised warm-up, ``warmup_dtype="int8"``, runs once DDP's last bucket is in: its errors are
    the optimizer's state, as without DDP).
    Every optimizer step must follow a backward through ``ddp_model`` that synchronised (the last
    micro-batch outside ``no_sync()``): a warm-up step whose gradients DDP did not average raises.
    Returns the hook's state object.
    """
    if not isinstance(optimizer, StagedOptimizer):
        raise ValueError(f"register_ddp needs a onebitlamb optimizer (Lamb, OneBitLamb, OneBitAdam), got "
                         f"{type(optimizer).__name__}")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"register_ddp needs the DistributedDataParallel-wrapped model, got "
                         f"{type(ddp_model).__name__}")
    if optimizer.exchange.ddp_link is not None:
        raise ValueError(f"{type(optimizer).__name__} is already registered with a DDP model")
    if optimizer.exchange.overlap_with_backward:
        raise ValueError(f"{type(optimizer).__name__} exchanges behind the backward itself (overlap_with_backward=True): "
                         f"use that or register_ddp, not both")
    ddp_size, opt_size = world_size_of(ddp_model.process_group), world_size_of(optimizer.process_group)
    if ddp_size != opt_size:
        raise ValueError(f"the DDP model's process group has {ddp_size} ranks, the optimizer's {opt_size}: they "
                         f"must average over the same group")
    held = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    synced = {id(p) for p in ddp_model.parameters() if p.requires_grad}
    if not held <= synced:
        raise ValueError(f"{len(held - synced)} of {type(optimizer).__name__}'s trainable parameters are not "
                         f"parameters of the DDP model: DDP would not average their gradients")
    missed = [name for name, p in ddp_model.module.named_parameters() if p.requires_grad and id(p) not in held]
    if missed:
        raise ValueError(f"{len(missed)} of the DDP model's trainable parameters are not "
                         f"{type(optimizer).__name__}'s ({', '.join(missed[:4])}): once it compresses the hook "
                         f"sends no bucket, so their gradients would no longer be averaged (give them to the "
                         f"optimizer, or set requires_grad=False)")
    # DDP averages over one process group: a hierarchical optimizer's warm-up goes flat under DDP
    link = DDPLink(optimizer, spanning_group(optimizer.process_group))
    optimizer.exchange.attach_ddp(link)
    ddp_model.register_comm_hook(link, _stage_hook)
    return link
