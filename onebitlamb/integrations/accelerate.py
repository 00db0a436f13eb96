"""1-bit optimizers under Hugging Face accelerate: one call in place of ``accelerator.prepare``.

``accelerator.prepare`` wraps the model in ``DistributedDataParallel``, which all-reduces every
gradient while the optimizer exchanges its own, and ``accelerator.save_state`` keeps rank 0's
optimizer state only, which ``load_state`` then gives every rank; a 1-bit optimizer's compression
errors are per rank, so rank 1 would resume with rank 0's. :func:`prepare` is
``accelerator.prepare`` plus what fixes both:

- ``register_ddp`` on the DDP model: DDP averages the warm-up and sends nothing after the freeze;
- a save pre-hook: ``accelerator.save_state(dir)`` also writes every rank's own optimizer state
  into ``dir`` (``save_rank_state``), after synchronizing the ranks' parameters
  (``optimizer.synchronize()``: 0/1 Adam between its syncs; nothing for the others), so that the
  model it saves is every rank's (at the end of a run, call ``optimizer.synchronize()`` on every
  rank before ``accelerator.save_model``);
- ``accelerator.load_state(dir)`` checks (a load pre-hook) that ``dir`` holds every rank's file
  before it loads anything, and once accelerate has loaded rank 0's optimizer state into every
  rank, each loads its own over it (``load_rank_state``): ``prepare`` wraps this accelerator's
  ``load_state``, since accelerate has no post-load hook.

Nothing else changes: ``accelerator.accumulate``, ``backward``, schedulers and automatic
checkpoint naming work as before. ``save_state`` must run on every rank (as accelerate asks).
"""
from __future__ import annotations

import functools
from typing import Any, List, Optional

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel

from onebitlamb.docs import pointer
from onebitlamb.integrations.ddp import register_ddp
from onebitlamb.integrations.rank_files import (load_rank_state, own_state_instead_of_rank_0s, save_rank_state,
                                                 saved_worlds)
from onebitlamb.optim import StagedOptimizer

# accelerate replaces or shards DDP and the optimizer state there: neither the hook nor the files apply
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)


def prepare(accelerator: Accelerator, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` for a run whose optimizer is ``Lamb``, ``OneBitLamb`` or
    ``OneBitAdam``; returns what it returns. Call it instead, with the model and the optimizer in
    the same call, before the first backward::

        model, optimizer, loader = onebitlamb.integrations.accelerate.prepare(accelerator, model, optimizer, loader)
        ...
        accelerator.save_state(dir)  # every rank, as always; load_state(dir) restores each rank's own

    Raises ``ValueError`` for what would silently train wrong: no or several onebitlamb optimizers,
    an optimizer already prepared, an accelerator already holding one, fp16 (accelerate wraps
    ``step`` in a function that hides its ``grad_scaler`` parameter from the ``GradScaler``, whose
    update would then read each rank's own overflow: the ranks' loss scales would part),
    DeepSpeed, FSDP, Megatron-LM or XLA, and a distributed run whose model DDP does not wrap.
    """
    optimizer = _the_optimizer(accelerator, objects)
    prepared = accelerator.prepare(*objects)
    results = prepared if isinstance(prepared, tuple) else (prepared,)
    if accelerator.num_processes > 1:
        register_ddp(_ddp_holding(optimizer, results, accelerator), optimizer)
    accelerator.register_save_state_pre_hook(lambda models, weights, folder: save_rank_state(optimizer, folder))
    accelerate_save = accelerator.save_state

    @functools.wraps(accelerate_save)
    def save_state(*args: Any, **kwargs: Any) -> Any:
        # before accelerate takes the model's weights (from rank 0): 0/1 Adam's ranks between syncs
        # hold other parameters, synchronized first (a no-op for the other optimizers)
        optimizer.synchronize()
        return accelerate_save(*args, **kwargs)

    folder: List[Optional[str]] = [None]  # the folder load_state resolved (automatic naming included)

    def check_folder(models: list, input_dir: str) -> None:
        # before accelerate loads anything: a folder without every rank's state must leave the run as it is
        if not any(ranks == list(range(w)) for w, ranks in saved_worlds(input_dir).items()):
            raise FileNotFoundError(f"{input_dir} holds no onebitlamb optimizer state per rank: it was not saved by "
                                    f"accelerator.save_state after onebitlamb.integrations.accelerate.prepare (on "
                                    f"every rank), and rank 0's state alone would not continue the run")
        folder[0] = input_dir

    accelerate_load = accelerator.load_state

    @functools.wraps(accelerate_load)
    def load_state(*args: Any, **kwargs: Any) -> None:
        # accelerate loads rank 0's optimizer state (errors included) on every rank: each rank loads
        # its own instead (load_state_dict refuses another rank's), and again after the whole load,
        # so that nothing accelerate does after the optimizer's load undoes it
        folder[0] = None
        with own_state_instead_of_rank_0s(optimizer, lambda: folder[0]):
            accelerate_load(*args, **kwargs)
        if folder[0] is not None:
            load_rank_state(optimizer, folder[0])

    accelerator.register_load_state_pre_hook(check_folder)
    accelerator.load_state = load_state  # this instance only: every later load_state call goes through it
    accelerator.save_state = save_state
    accelerator._onebitlamb_optimizer = optimizer  # one per accelerator: the rank files have one name
    return prepared


def _the_optimizer(accelerator: Accelerator, objects: tuple) -> StagedOptimizer:
    if any(isinstance(o, AcceleratedOptimizer) for o in objects):
        raise ValueError("pass the optimizer as it was before accelerator.prepare: "
                         "onebitlamb.integrations.accelerate.prepare calls it")
    ours = [o for o in objects if isinstance(o, StagedOptimizer)]
    if len(ours) != 1:
        raise ValueError(f"onebitlamb.integrations.accelerate.prepare needs exactly one onebitlamb optimizer (Lamb, "
                         f"OneBitLamb, OneBitAdam) among the objects, got {len(ours)}")
    if getattr(accelerator, "_onebitlamb_optimizer", None) is not None:
        raise ValueError("this accelerator already holds a onebitlamb optimizer: their per-rank state files "
                         "would overwrite each other")
    if accelerator.distributed_type in _UNSUPPORTED:
        raise ValueError(f"onebitlamb.integrations.accelerate supports DDP (multi-CPU/GPU) and single-process "
                         f"runs, not {accelerator.distributed_type.value}")
    if accelerator.scaler is not None:
        raise ValueError("mixed_precision='fp16' is not supported: accelerate wraps optimizer.step in a function "
                         "that hides its grad_scaler parameter from the GradScaler, whose update() would then read "
                         "each rank's own overflow, so the ranks' loss scales would part; use bf16, or "
                         f"torch.amp.GradScaler in a plain loop ({pointer('optimizers', 'Mixed precision')})")
    return ours[0]


def _ddp_holding(optimizer: StagedOptimizer, results: tuple, accelerator: Accelerator) -> DistributedDataParallel:
    held = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    for obj in results:
        model = getattr(obj, "_orig_mod", obj)  # torch.compile wraps the DDP model
        if isinstance(model, DistributedDataParallel) and held <= {id(p) for p in model.parameters()}:
            return model
    raise ValueError(f"none of the objects accelerate prepared is a DistributedDataParallel model holding the "
                     f"optimizer's parameters (distributed type {accelerator.distributed_type.value}, "
                     f"{accelerator.num_processes} processes): pass the model in the same call")
