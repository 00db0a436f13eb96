"""1-bit optimizers under PyTorch Lightning: a ``DDPStrategy`` that lets DDP and the optimizer split
the communication, and whose checkpoints hold every rank's optimizer state.

Lightning's ``DDPStrategy`` gets two things wrong for a 1-bit optimizer:

- it wraps the model in ``DistributedDataParallel``, which all-reduces every gradient, and the
  optimizer then exchanges its own (the average again in the warm-up, the 1-bit momentum after);
  ``DDPStrategy(ddp_comm_hook=...)`` does not help, Lightning registers the hook on CUDA only and
  before the optimizers exist. Here :func:`~onebitlamb.register_ddp` is called once the optimizer
  is built, on every device: DDP averages the warm-up and sends nothing once the optimizer compresses.
- its checkpoint holds rank 0's ``optimizer.state_dict()`` and every rank loads it, but the
  compression errors are per rank. Here rank 0 gathers every rank's state into the checkpoint
  entry and each rank loads its own on resume (re-sharded if the number of ranks changed).

Before each checkpoint and at the end of a fit the ranks' parameters are synchronized
(``optimizer.synchronize()``: 0/1 Adam between its syncs; nothing for the others), so that the
model in the checkpoint is every rank's.

The checkpoint stays one file, so everything Lightning does with it (``ModelCheckpoint``'s top-k
rotation, ``last.ckpt``, remote ``CheckpointIO``) keeps working. The price is that rank 0 holds
all ``n`` ranks' optimizer states while it writes, on the CPU; for runs where that does not fit,
write per-rank files with :func:`~onebitlamb.integrations.save_rank_state` from a callback instead.
The entry is rank 0's state dict plus the list, so a plain ``DDPStrategy`` loading it gives every
rank rank 0's errors, which the optimizer refuses at its next step rather than drifting.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from onebitlamb.comm import world_size_of
from onebitlamb.integrations.ddp import register_ddp
from onebitlamb.optim import StagedOptimizer, reshard_state_dicts

RANK_STATES = "onebitlamb_rank_states"  # the checkpoint entry's list: rank r's state dict at index r


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class OneBitDDPStrategy(DDPStrategy):
    """``DDPStrategy`` for a ``LightningModule`` whose ``configure_optimizers`` returns a onebitlamb
    optimizer (``OneBitLamb``, ``OneBitAdam`` or ``Lamb``)::

        trainer = lightning.pytorch.Trainer(strategy=OneBitDDPStrategy(), devices=2)
        trainer.fit(model)  # DDP averages the warm-up, then sends nothing
        # later, a fresh Trainer: every rank resumes with its own compression errors
        trainer.fit(model, ckpt_path="checkpoints/epoch=1.ckpt")

    Takes ``DDPStrategy``'s arguments, except the comm hook ones: its hook is the one it registers.
    The onebitlamb optimizer must be the only one and hold every trainable parameter, because after
    the freeze DDP averages no gradient at all.
    """

    def __init__(self, **kwargs: Any) -> None:
        taken = [k for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
                 if kwargs.get(k) is not None]
        if taken:
            raise ValueError(f"OneBitDDPStrategy registers its own DDP comm hook (onebitlamb.register_ddp); "
                             f"it does not take {', '.join(taken)}")
        super().__init__(**kwargs)

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        # only fitting wraps the model in DDP, and only there do the optimizers exist
        if trainer.state.fn == TrainerFn.FITTING:
            self._register()

    def _register(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        optimizers = [_unwrap(o) for o in self.optimizers]
        staged = [o for o in optimizers if isinstance(o, StagedOptimizer)]
        names = [type(o).__name__ for o in optimizers]
        if len(staged) != 1 or len(optimizers) != 1:
            raise ValueError(f"OneBitDDPStrategy needs configure_optimizers to return one onebitlamb optimizer "
                             f"(OneBitLamb, OneBitAdam or Lamb) and no other, got {names or 'none'}: DDP's "
                             f"hook follows one optimizer's stage (use DDPStrategy for other optimizers)")
        opt = staged[0]
        if opt.process_group not in (None, dist.group.WORLD):
            raise ValueError("the optimizer's process_group must be the default one: Lightning's DDP and its "
                             "checkpoints span every rank")
        register_ddp(self.model, opt)

    def _synchronize(self) -> None:
        for optimizer in self.optimizers:
            opt = _unwrap(optimizer)
            if isinstance(opt, StagedOptimizer):
                opt.synchronize()

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        """Called on every rank for each checkpoint (before the optimizer states): 0/1 Adam's ranks
        between syncs hold other parameters, synchronized first, so that the model rank 0 writes is
        every rank's (``optimizer.synchronize()``; a no-op for the other optimizers)."""
        self._synchronize()
        return super().lightning_module_state_dict()

    def on_train_end(self) -> None:
        """The model a fit ends with is the same on every rank (``optimizer.synchronize()``)."""
        self._synchronize()
        super().on_train_end()

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """Called on every rank while Lightning builds the checkpoint; rank 0's, which it writes,
        gets every rank's state."""
        opt = _unwrap(optimizer)
        state = super().optimizer_state(opt)
        if not isinstance(opt, StagedOptimizer) or world_size_of(opt.process_group) == 1:
            return state
        # CPU copies: a CUDA tensor unpickled on rank 0 would land on the sending rank's device
        mine = state if self.global_rank == 0 else move_data_to_device(state, "cpu")
        gathered: Optional[List[Any]] = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return state
        gathered[0] = state  # the same tensors as the entry's own, which torch.save stores once
        return {**state, RANK_STATES: gathered}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Every rank loads its own state from the entry (or its share, re-sharded, when the
        checkpoint was written by another number of ranks)."""
        entries = []
        for optimizer, entry in zip(self.optimizers, checkpoint["optimizer_states"]):
            ranks = entry.get(RANK_STATES)
            if ranks is not None and isinstance(_unwrap(optimizer), StagedOptimizer):
                entry = ranks[self.global_rank] if len(ranks) == self.world_size else \
                    reshard_state_dicts(ranks, self.world_size)[self.global_rank]
            entries.append(entry)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": entries})
