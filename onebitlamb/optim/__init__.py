"""LAMB, 1-bit LAMB, 1-bit Adam and 0/1 Adam: each a schedule of phases over one shared machinery.

functional.py   the maths on flat buffers (pure functions)
layout.py       the flat layout of the parameters and the state built on it, its scratch buffers
sharding.py     FSDP2's shards (HSDP): whole-layer statistics over the shard group
freeze.py       when the warm-up ends: a fixed step or AutoFreeze
checks.py       what is refused, what the ranks must agree on, non-finite steps
exchange.py     what crosses the ranks: the warm-up's average, the 1-bit all-reduce, behind the backward
context.py      the step context: what a phase works with (state, buffers, shared helpers)
phases.py       what a phase's steps send and how they apply what comes back: the warm-up, 1-bit stage 2
staged.py       the step, the state and its saved form, shared by the four optimizers
optimizers.py   the public classes
zero_one.py     0/1 Adam: its variance phase (the thinning schedule), then local steps
local_steps.py  local steps after a freeze and the syncs that average them (0/1 Adam's second phase)
elastic.py      a checkpoint of n ranks re-sharded for m
clip.py         gradient clipping by one factor agreed by the ranks
"""
from onebitlamb.optim.clip import clip_grad_norm_
from onebitlamb.optim.elastic import reshard_state_dicts
from onebitlamb.optim.freeze import AutoFreeze
from onebitlamb.optim.optimizers import Lamb, OneBitAdam, OneBitLamb
from onebitlamb.optim.staged import COMPRESSION, LOCAL, WARMUP, StagedOptimizer
from onebitlamb.optim.zero_one import ZeroOneAdam

__all__ = ["AutoFreeze", "COMPRESSION", "LOCAL", "Lamb", "OneBitAdam", "OneBitLamb", "StagedOptimizer", "WARMUP",
           "ZeroOneAdam", "clip_grad_norm_", "reshard_state_dicts"]
