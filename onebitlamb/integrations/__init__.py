"""Where people train: each framework's one entry point, built on the optimizers' public API.

ddp.py          register_ddp: DistributedDataParallel averages the warm-up, sends nothing after
rank_files.py   every rank's optimizer state beside a framework's checkpoint (they save rank 0's)
"""
from onebitlamb.integrations.ddp import DDPLink, register_ddp
from onebitlamb.integrations.rank_files import load_rank_state, save_rank_state

__all__ = ["DDPLink", "load_rank_state", "register_ddp", "save_rank_state"]
