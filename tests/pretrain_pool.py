"""The main job's runs that a test only builds on (a run to resume, an uninterrupted run to compare
with), trained on the persistent ranks of ``rank_pool.py`` instead of a launch of the command.

A launch of ``onebitlamb pretrain --preset tiny`` starts a Python that imports torch, then
``--workers`` more that do the same: 10-15 s on an idle 2-core machine (a minute on a busy one),
for 8 steps that take half a second. ``pretrain_on_ranks(*flags)`` does what the command does with
the same flags, without those starts:

- the flags are parsed as the command parses them (``config.config_from_flags``);
- what the local launcher does before its workers start is done here, by the same code
  (``pretrain._started``: the settings checked, OUT held for the run's life, an earlier run refused
  or the checkpoint checked and the leftovers removed, the corpus prepared);
- each rank runs the workers' ``train_rank`` on the session's pool of ``--workers`` ranks, in a
  default gloo group with the run's ``--timeout`` and ``--threads`` intra-op threads, as
  ``spawn_local`` runs it; rank 0's summary comes back, as from ``pretrain.train``.

The numbers are the command's, bit for bit: the tests that resume a pool run with the command, or
compare a pool run with one of the command, check it (tests/test_train_e2e.py).

What it does not give is the launcher's own behaviour: starting the workers, forwarding Ctrl-C and
SIGTERM, the exit status and its one line, a killed worker named. A test of those launches the
command. ``train_rank`` installs handlers for SIGINT and SIGTERM (a stop at the end of the step);
they are put back after the call, as the pool puts back the rest of a rank. The warnings a rank
raised come back (the pool's output is not a test's captured stderr).
"""
from __future__ import annotations

import signal
import warnings
from typing import List, NamedTuple

from onebitlamb.train import config, loop, pretrain
from rank_pool import run_ranks


class PoolRun(NamedTuple):
    summary: dict  # rank 0's, as pretrain.train returns it: completed, interrupted, step (error)
    warnings: List[str]  # the messages of the warnings every rank raised, rank 0's first


def pretrain_config(*flags: str) -> config.TrainConfig:
    """The run ``onebitlamb pretrain *flags`` makes."""
    return config.config_from_flags(flags)


def pretrain_on_ranks(*flags: str, timeout_s: float = 300.0) -> PoolRun:
    """``onebitlamb pretrain *flags`` on the pool's ranks (see the module's docstring)."""
    return train_on_ranks(pretrain_config(*flags), timeout_s=timeout_s)


def train_on_ranks(cfg: config.TrainConfig, timeout_s: float = 300.0) -> PoolRun:
    """``pretrain.train(cfg)`` on the pool's ranks (see the module's docstring)."""
    with pretrain._started(cfg, cfg.workers, leader=True):
        ranks = run_ranks(_train_rank, cfg.workers, (cfg,), timeout_s=timeout_s, collective_timeout_s=cfg.timeout)
    return PoolRun(ranks[0][0], [message for _, said in ranks for message in said])


def _train_rank(rank: int, world: int, cfg: config.TrainConfig):
    import torch

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    torch.set_num_threads(cfg.threads)  # spawn_local's threads_per_worker (the pool puts back 1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            summary = loop.train_rank(rank, world, cfg)
        return summary, [str(w.message) for w in caught]
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
