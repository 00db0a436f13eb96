"""LAMB, 1-bit LAMB and 1-bit Adam: one staged machinery, three update rules."""
from onebitlamb.optim.optimizers import Lamb, OneBitAdam, OneBitLamb
from onebitlamb.optim.staged import COMPRESSION, WARMUP, StagedOptimizer

__all__ = ["COMPRESSION", "Lamb", "OneBitAdam", "OneBitLamb", "StagedOptimizer", "WARMUP"]
