"""LAMB, 1-bit LAMB and 1-bit Adam: one staged machinery, three update rules, two freeze schedules.

functional.py   the maths on flat buffers (pure functions)
layout.py       the flat layout of the parameters and the state built on it
freeze.py       when the warm-up ends: a fixed step or AutoFreeze
staged.py       the two stages and the freeze, shared by the three optimizers
optimizers.py   the public classes
"""
from onebitlamb.optim.freeze import AutoFreeze
from onebitlamb.optim.optimizers import Lamb, OneBitAdam, OneBitLamb
from onebitlamb.optim.staged import COMPRESSION, WARMUP, StagedOptimizer

__all__ = ["AutoFreeze", "COMPRESSION", "Lamb", "OneBitAdam", "OneBitLamb", "StagedOptimizer", "WARMUP"]
