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
import contextlib
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist

from onebitlamb.train import files
from onebitlamb.train.checkpoints import check_resumable, prepare_out_dir
from onebitlamb.train.config import RunError, SetupError, TrainConfig, add_arguments, config_from_args
from onebitlamb.train.loop import prepare_corpus, train_rank
from onebitlamb.train.ranks import check_shared_out, gpus_shared, under_torchrun

# what onebitlamb.cli calls: add_arguments(parser) and run(args); train(cfg) for a script of one's own
__all__ = ["add_arguments", "run", "train", "report_stop", "exit_code"]


def run(args: argparse.Namespace) -> int:
    """0: done (or stopped by --stop-after-steps), 130: interrupted (Ctrl-C, SIGTERM), 1: stopped
    partway (a non-finite loss, too many skipped steps, a rank that died or stopped answering, a
    link where a checkpoint goes), 2: refused at the start. Each says why in one line."""
    from onebitlamb.comm.launch import WorkerError

    try:
        result = train(config_from_args(args))
    except (SetupError, files.OutError) as exc:
        print(f"onebitlamb pretrain: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (RunError, WorkerError) as exc:
        return report_stop(exc, "onebitlamb pretrain")
    except StoppedTwice as exc:
        print(f"onebitlamb pretrain: error: {exc}", file=sys.stderr, flush=True)
        return 130
    return exit_code(result)


# the errors a worker may end with whose message says it all (the last line of its traceback)
_ONE_LINE = ("RankTimeout: ", "RunError: ", "OutError: ", "SetupError: ")


def report_stop(exc: Exception, prog: str) -> int:
    """A run that stopped partway for a stated reason (``RunError``: a rank that gave up waiting,
    a link where a checkpoint goes, ranks that drifted apart; a local worker killed): its message
    alone, exit status 1. Anything else is raised again, with its traceback."""
    from onebitlamb.comm.launch import WorkerError

    if isinstance(exc, WorkerError) and exc.killed:
        message = f"{exc}; the last checkpoint is complete: continue with --resume"
    elif isinstance(exc, RunError):
        message = str(exc)
    else:  # a local worker's error carries the worker's traceback, whose last line says it
        said = [line.split(m, 1)[1] for line in str(exc).splitlines() for m in _ONE_LINE if m in line]
        if not said:
            raise exc
        message = said[0]
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return 1


def exit_code(result: dict) -> int:
    if result.get("error"):
        return 1
    return 0 if result["completed"] or not result["interrupted"] else 130


# ----------------------------------------------------------------------------------------------
# Launching


def train(cfg: TrainConfig) -> dict:
    """Run one pretraining job to its end (or to a stop); returns rank 0's summary: ``completed``,
    ``interrupted``, ``step`` and, when the run stopped partway, ``error`` (the message).
    Raises SetupError or files.OutError before anything starts when the run is refused (OUT
    missing on --resume, a file, read-only, used by another run; an earlier run in it)."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _exit_with_agent()
        # rank 0 holds OUT for the run's life; the other ranks of a second run wait in the group's
        # start until torchrun ends them when rank 0 is refused
        with _started(cfg, world, leader=rank == 0):
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

    with _started(cfg, cfg.workers, leader=True), _forward_stops():  # this process holds OUT until its workers are done
        results = spawn_local(_local_worker, cfg.workers, args=(cfg,), timeout_s=7 * 24 * 3600,
                              collective_timeout_s=cfg.timeout, threads_per_worker=cfg.threads)
    return results[0]


@contextlib.contextmanager
def _started(cfg: TrainConfig, world: int, leader: bool):
    """What every launch does before its ranks train, in this order, whichever the launcher:
    the settings checked against the world, OUT usable, OUT held (by the leader: the local
    launcher, or rank 0 under torchrun) for the run's life, the earlier run refused or the
    checkpoint checked (every rank refuses alike), the corpus prepared once, by the leader (the
    slow part of a first run, which must not run once per rank), and only then what the run
    removes from OUT removed, by the leader (checkpoints.OutPlan). Refusals raise SetupError or
    files.OutError before anything starts, and before anything in OUT changes."""
    cfg.check(world)
    files.usable_out(cfg.out, cfg.resume)
    with files.RunLock(cfg.out) if leader else contextlib.nullcontext():
        plan = (check_resumable if cfg.resume else prepare_out_dir)(cfg, remove=False)
        if leader:
            prepare_corpus(cfg)  # a damaged cache is refused before anything in OUT is removed
            plan.apply()
        yield


def _local_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    return train_rank(rank, world_size, cfg)


def _leave_together() -> None:
    """At exit under torchrun: wait for every rank, then tear the group down (rank 0 writes the
    results while the others are done). For a user's own script that calls ``train``; the command
    line leaves earlier, ``onebitlamb.cli``."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _exit_with_agent() -> None:
    """Under torchrun: stop when the agent that started this worker is gone. The agent forwards
    Ctrl-C and SIGTERM to its workers (which checkpoint and stop, ``loop``), but killed with
    SIGKILL it forwards nothing, and its workers trained on for hours, moving the checkpoint.
    A thread polls the parent pid twice a second (``comm.launch.exit_with``, as the local
    launcher's workers do); the last complete checkpoint stays."""
    from onebitlamb.comm.launch import exit_with

    exit_with(os.getppid(), f"onebitlamb pretrain: error: rank {os.environ.get('RANK')}: its torchrun agent "
                            f"(pid {os.getppid()}) is gone, so it stops; the last complete checkpoint stays: "
                            f"continue with --resume")


class StoppedTwice(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM while the workers checkpoint: they are killed; the message says
    what stays (the command prints it alone, exit 130)."""


class _forward_stops:
    """While local workers run, Ctrl-C or SIGTERM asks them to checkpoint and stop at the end of the
    step instead of killing them; a second one kills them (the last periodic checkpoint remains)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.count = 0
        for s in self.SIGNALS:
            signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        import multiprocessing

        self.count += 1
        name = signal.Signals(signum).name
        if self.count > 1:
            for s in self.SIGNALS:  # a third one, while the workers are killed, must not interrupt that
                signal.signal(s, signal.SIG_IGN)
            if self.count == 2:  # (a signal raised inside the first one's handling comes here too)
                raise StoppedTwice(f"{'Ctrl-C' if signum == signal.SIGINT else name} again: the workers were "
                                   f"killed before their checkpoint of this step; the last complete checkpoint "
                                   f"stays: continue with --resume")
            return
        print(f"\n{'interrupt' if signum == signal.SIGINT else name}: checkpointing at the end of this step "
              f"({'Ctrl-C' if signum == signal.SIGINT else name} again to kill)", file=sys.stderr, flush=True)
        for child in multiprocessing.active_children():  # the workers may not share our terminal
            try:
                os.kill(child.pid, signum)  # a worker stops at the end of its step on either (loop.py)
            except ProcessLookupError:
                pass

    def _restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def __exit__(self, *exc):
        self._restore()
        return False
