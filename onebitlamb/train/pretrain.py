"""Masked-language-model pretraining of a small BERT with LAMB, 1-bit LAMB or 1-bit Adam.

    onebitlamb pretrain --optimizer onebitlamb --preset demo --out runs/onebitlamb
    torchrun --nnodes 2 --nproc-per-node 8 ... -m onebitlamb pretrain --optimizer onebitlamb ...

The command and its launcher. The rest of the main job, one module each: ``config`` (TrainConfig,
the presets, the flags), ``loop`` (one rank's run, top to bottom), ``checkpoints`` (the
checkpoint store and OUT's files), ``metrics`` (evaluation and results), ``ranks`` (where the
ranks train and how they agree).

Launching: without torchrun this process prepares the corpus, then starts ``--workers`` local
processes joined by a gloo group on loopback. Under torchrun (``RANK``/``WORLD_SIZE`` set) every
process is one rank and the group comes from the environment: nccl with a GPU per rank, gloo over
CUDA tensors where the ranks of a node outnumber its GPUs (NCCL refuses two ranks on one device),
gloo on the CPU without CUDA.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist

from onebitlamb.train.checkpoints import check_resumable, prepare_out_dir
from onebitlamb.train.config import SetupError, TrainConfig, add_arguments, config_from_args
from onebitlamb.train.loop import RankTimeout, prepare_corpus, train_rank
from onebitlamb.train.ranks import check_shared_out, gpus_shared, under_torchrun

# what onebitlamb.cli calls: add_arguments(parser) and run(args); train(cfg) for a script of one's own
__all__ = ["add_arguments", "run", "train", "report_timeout", "exit_code"]


def run(args: argparse.Namespace) -> int:
    """0: done (or stopped by --stop-after-steps), 130: interrupted, 1: stopped by a non-finite
    loss, 2: refused at the start (the message says why)."""
    from onebitlamb.comm.launch import WorkerError

    try:
        result = train(config_from_args(args))
    except SetupError as exc:
        print(f"onebitlamb pretrain: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (RankTimeout, WorkerError) as exc:
        return report_timeout(exc, "onebitlamb pretrain")
    return exit_code(result)


def report_timeout(exc: Exception, prog: str) -> int:
    """A rank that gave up waiting: its message alone, exit status 1 (anything else is raised again)."""
    # a local worker's error carries the worker's traceback, whose last line says it
    gave_up = [line.split("RankTimeout: ", 1)[1] for line in str(exc).splitlines() if "RankTimeout: " in line]
    if not isinstance(exc, RankTimeout) and not gave_up:
        raise exc
    print(f"{prog}: error: {gave_up[0] if gave_up else exc}", file=sys.stderr, flush=True)
    return 1


def exit_code(result: dict) -> int:
    if result.get("error"):
        return 1
    return 0 if result["completed"] or not result["interrupted"] else 130


# ----------------------------------------------------------------------------------------------
# Launching


def train(cfg: TrainConfig) -> dict:
    """Run one pretraining job to its end (or to a stop); returns rank 0's summary: ``completed``,
    ``interrupted``, ``step`` and, when a non-finite loss stopped it, ``error`` (the message).
    Raises SetupError before anything starts when the run is refused."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        cfg.check(world)
        if cfg.resume:
            check_resumable(cfg)
        else:
            prepare_out_dir(cfg, remove=rank == 0)  # every rank refuses alike; rank 0 alone removes
        if rank == 0:
            prepare_corpus(cfg)
        if not dist.is_initialized():  # once per process: `compare` trains three times in it
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            backend = "gloo" if gpus_shared() or not torch.cuda.is_available() else "nccl"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
            atexit.register(_leave_together)
        check_shared_out(cfg.out, rank, world)
        dist.barrier()  # rank 0 has written the corpus cache (shared folder assumed)
        return train_rank(rank, world, cfg)

    from onebitlamb.comm.launch import spawn_local

    cfg.check(cfg.workers)
    # fail here, before starting anything
    if cfg.resume:
        check_resumable(cfg)
    else:
        prepare_out_dir(cfg)
    # the slow part of a first run, done once here instead of once per worker
    prepare_corpus(cfg)
    with _forward_interrupts():
        results = spawn_local(_local_worker, cfg.workers, args=(cfg,), timeout_s=7 * 24 * 3600,
                              collective_timeout_s=cfg.timeout, threads_per_worker=cfg.threads)
    return results[0]


def _local_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    return train_rank(rank, world_size, cfg)


def _leave_together() -> None:
    """At exit under torchrun: wait for every rank, then tear the group down (rank 0 writes the
    results while the others are done). For a user's own script that calls ``train``; the command
    line leaves earlier, ``onebitlamb.cli``."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class _forward_interrupts:
    """While local workers run, Ctrl-C asks them to checkpoint and stop at the end of the step
    instead of killing them; a second Ctrl-C kills them (the last periodic checkpoint remains)."""

    def __enter__(self):
        self.previous = signal.getsignal(signal.SIGINT)
        self.count = 0
        signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        import multiprocessing

        self.count += 1
        if self.count > 1:
            signal.signal(signal.SIGINT, self.previous)
            raise KeyboardInterrupt
        print("\ninterrupt: checkpointing at the end of this step (Ctrl-C again to kill)", file=sys.stderr)
        for child in multiprocessing.active_children():  # the workers may not share our terminal
            try:
                os.kill(child.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
        return False
