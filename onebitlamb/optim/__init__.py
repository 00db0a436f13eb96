"""LAMB, 1-bit LAMB, 1-bit Adam and 0/1 Adam: one staged machinery, their update rules, the schedules.

functional.py   the maths on flat buffers (pure functions)
layout.py       the flat layout of the parameters and the state built on it
freeze.py       when the warm-up ends: a fixed step or AutoFreeze
checks.py       what is refused, what the ranks must agree on, non-finite steps
staged.py       the two stages and the freeze, shared by the three optimizers
optimizers.py   the public classes
zero_one.py     0/1 Adam: the thinning variance schedule, then local steps
local_steps.py  local steps after a freeze and the syncs that average them (0/1 Adam's second phase)
elastic.py      a checkpoint of n ranks re-sharded for m
"""
from onebitlamb.optim.elastic import reshard_state_dicts
from onebitlamb.optim.freeze import AutoFreeze
from onebitlamb.optim.optimizers import Lamb, OneBitAdam, OneBitLamb
from onebitlamb.optim.staged import COMPRESSION, LOCAL, WARMUP, StagedOptimizer
from onebitlamb.optim.zero_one import ZeroOneAdam

__all__ = ["AutoFreeze", "COMPRESSION", "LOCAL", "Lamb", "OneBitAdam", "OneBitLamb", "StagedOptimizer", "WARMUP",
           "ZeroOneAdam", "reshard_state_dicts"]
