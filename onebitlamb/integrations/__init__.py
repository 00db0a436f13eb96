"""Where people train: one entry per framework, each built on the optimizers' public API.

ddp.py            register_ddp: DistributedDataParallel averages the warm-up, sends nothing after
rank_files.py     every rank's optimizer state beside a framework's checkpoint (they save rank 0's)
transformers.py   OneBitTrainer: the Hugging Face Trainer
accelerate.py     prepare(accelerator, ...): accelerate
lightning.py      OneBitDDPStrategy: PyTorch Lightning

The framework modules import their framework, so they are imported by name, not from here
(``from onebitlamb.integrations.transformers import OneBitTrainer``).
torch.distributed.checkpoint needs no entry: ``get_state_dict(model, optimizer)`` works as is.
"""
from onebitlamb.integrations.ddp import DDPLink, register_ddp
from onebitlamb.integrations.rank_files import load_rank_state, save_rank_state

__all__ = ["DDPLink", "load_rank_state", "register_ddp", "save_rank_state"]
