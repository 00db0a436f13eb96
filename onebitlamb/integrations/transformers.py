"""1-bit optimizers under the Hugging Face ``Trainer``: :class:`OneBitTrainer`.

On several ranks the plain ``Trainer`` gets two things wrong for a 1-bit optimizer:

- it wraps the model in ``DistributedDataParallel``, which all-reduces every gradient while the
  optimizer exchanges its own (the optimizer stops this at its first step);
- it saves rank 0's ``optimizer.state_dict()`` and loads it on every rank, but the compression
  errors are per rank, so rank 1 would resume with rank 0's (the optimizer refuses that too).

``OneBitTrainer`` is the ``Trainer`` with both fixed: at its first training step it registers
:func:`onebitlamb.register_ddp` on the DDP model the Trainer built (DDP averages the warm-up and
sends nothing after the freeze), every rank writes its own optimizer state into each
``checkpoint-N`` folder, and ``train(resume_from_checkpoint=...)`` has every rank load its own
state after the Trainer's load (re-sharded if the number of ranks changed). Before each checkpoint
and at the end of training the ranks' parameters are synchronized (``optimizer.synchronize()``:
0/1 Adam between its syncs; nothing for the others), so that the model the Trainer saves from rank
0 is every rank's.

A callback cannot do this: callbacks see neither the DDP-wrapped model nor the folder a run
resumes from. The class only extends the Trainer's methods, so it mixes into other Trainers
(``class MySFTTrainer(OneBitTrainer, SFTTrainer)``).

Only DDP data parallelism is served: FSDP and DeepSpeed shard or own the optimizer state.
``max_grad_norm`` (on by default) clips the averaged gradient in the warm-up and each rank's own
gradient after the freeze, when DDP no longer averages; LAMB bounds each layer's update by its
trust ratio anyway, so ``max_grad_norm=0`` is a reasonable choice.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer

from onebitlamb.comm import world_size_of
from onebitlamb.integrations.ddp import register_ddp
from onebitlamb.integrations.rank_files import load_rank_state, own_state_instead_of_rank_0s, save_rank_state
from onebitlamb.optim import StagedOptimizer


class OneBitTrainer(Trainer):
    """A ``transformers.Trainer`` for ``OneBitLamb``, ``OneBitAdam`` and ``Lamb``; use it as the
    Trainer, passing the optimizer in ``optimizers``::

        opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-3, freeze_step=onebitlamb.AutoFreeze(steps))
        trainer = OneBitTrainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))
        trainer.train()  # or train(resume_from_checkpoint=True): every rank resumes its own state

    Launch with ``torchrun`` as for any Trainer run.
    """

    def onebit_optimizer(self) -> StagedOptimizer:
        """The onebitlamb optimizer (accelerate's ``AcceleratedOptimizer`` wraps it once prepared)."""
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        if not isinstance(opt, StagedOptimizer):
            raise ValueError(f"OneBitTrainer needs a onebitlamb optimizer (Lamb, OneBitLamb, OneBitAdam), got "
                             f"{type(opt).__name__}: pass optimizers=(onebitlamb.OneBitLamb(model.parameters(), "
                             f"...), None), or optimizer_cls_and_kwargs=(onebitlamb.OneBitLamb, {{...}})")
        return opt

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        # the Trainer calls this at the start of every train(), before wrapping anything: the place
        # to refuse a run this class cannot serve before it spends any time
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("OneBitTrainer serves DistributedDataParallel only: DeepSpeed and FSDP shard or own "
                             "the optimizer state and its communication")
        self.onebit_optimizer()
        return optimizer

    def training_step(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the first place, after the Trainer's wrapping, that runs before the first backward
        opt = self.onebit_optimizer()
        if opt.exchange.ddp_link is None:
            ddp = model
            while not isinstance(ddp, DistributedDataParallel) and hasattr(ddp, "_orig_mod"):
                ddp = ddp._orig_mod  # torch.compile wraps outside DDP
            if isinstance(ddp, DistributedDataParallel):
                register_ddp(ddp, opt)
            elif world_size_of(opt.process_group) > 1:
                raise ValueError(f"OneBitTrainer runs on {world_size_of(opt.process_group)} ranks, but the "
                                 f"Trainer did not wrap the model in DistributedDataParallel (got "
                                 f"{type(model).__name__}): only DDP data parallelism is supported")
        return super().training_step(model, *args, **kwargs)

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        # every rank passes here before the model is saved (from rank 0): 0/1 Adam between its syncs
        # holds other parameters on every rank, so they are synchronized first (a no-op otherwise)
        self.onebit_optimizer().synchronize()
        super()._save_checkpoint(*args, **kwargs)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # the end of the training loop, before the Trainer loads the best checkpoint (if asked to):
        # the model the run ends with, and that save_model() writes, is the same on every rank
        self.onebit_optimizer().synchronize()
        return super()._finalize_training(*args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # every rank passes here (the Trainer writes its files on rank 0 only): each adds its own
        # state, compression errors included, to the checkpoint-N folder
        super()._save_optimizer_and_scheduler(output_dir)
        save_rank_state(self.onebit_optimizer(), output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # the Trainer loads rank 0's state on every rank: each rank loads its own instead, and again
        # after (should the Trainer have loaded none); a checkpoint without the per-rank files (saved
        # by a plain Trainer, or cut short while saving) raises FileNotFoundError rather than
        # resuming on rank 0's errors
        with own_state_instead_of_rank_0s(self.onebit_optimizer(), lambda: checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            load_rank_state(self.onebit_optimizer(), checkpoint)


__all__ = ["OneBitTrainer"]
