"""LAMB, 1-bit LAMB and 1-bit Adam: one staged machinery, three update rules, two freeze schedules.

functional.py   the maths on flat buffers (pure functions)
layout.py       the flat layout of the parameters and the state built on it
freeze.py       when the warm-up ends: a fixed step or AutoFreeze
checks.py       what is refused, what the ranks must agree on, non-finite steps
staged.py       the two stages and the freeze, shared by the three optimizers
optimizers.py   the public classes
elastic.py      a checkpoint of n ranks re-sharded for m
"""
from onebitlamb.optim.elastic import reshard_state_dicts
from onebitlamb.optim.freeze import AutoFreeze
from onebitlamb.optim.optimizers import Lamb, OneBitAdam, OneBitLamb
from onebitlamb.optim.staged import COMPRESSION, WARMUP, StagedOptimizer

__all__ = ["AutoFreeze", "COMPRESSION", "Lamb", "OneBitAdam", "OneBitLamb", "StagedOptimizer", "WARMUP",
           "reshard_state_dicts"]
