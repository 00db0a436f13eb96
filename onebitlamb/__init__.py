"""onebitlamb: 1-bit LAMB, 1-bit Adam, 0/1 Adam and LAMB on plain torch.distributed.

Public API: the optimizers ``Lamb``, ``OneBitLamb``, ``OneBitAdam`` and ``ZeroOneAdam``; the freeze policy
``AutoFreeze``; the collective ``compressed_allreduce`` with ``padded_size``; ``CommStats`` for
the bytes sent; ``reshard_state_dicts`` to resume a checkpoint on another number of ranks;
``register_ddp`` for a model wrapped in ``DistributedDataParallel`` (the other frameworks'
entries live in ``onebitlamb.integrations``); ``clip_grad_norm_``, gradient clipping by one factor
for every rank.
"""
from onebitlamb.comm import CommStats, compressed_allreduce, padded_size
from onebitlamb.integrations.ddp import register_ddp
from onebitlamb.optim import AutoFreeze, Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam, clip_grad_norm_, reshard_state_dicts

__version__ = "0.1.0"

__all__ = ["AutoFreeze", "CommStats", "Lamb", "OneBitAdam", "OneBitLamb", "compressed_allreduce", "padded_size",
           "ZeroOneAdam", "clip_grad_norm_", "register_ddp", "reshard_state_dicts", "__version__"]
