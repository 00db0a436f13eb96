"""Start N local worker processes joined by a gloo process group on loopback.

Used by the pretraining CLI's default launcher, the benchmarks and the multi-process tests: one
place that knows how to pick a free port, time out instead of hanging, and bring a worker's
traceback back to the parent. (Under ``torchrun`` none of this is used: the environment already
describes the group.)
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence


class WorkerError(RuntimeError):
    """A worker raised; the message carries its rank and traceback."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exit_with(parent: int) -> None:
    """Leave as soon as the launching process is gone. Killed by a signal it cannot clean up
    after (SIGTERM, SIGKILL), it leaves its daemon workers behind, and they would train on alone
    for hours, writing checkpoints into the run's folder."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


def _worker(fn, rank, world_size, init_method, timeout_s, threads, args, results, parent) -> None:
    import torch
    import torch.distributed as dist

    _exit_with(parent)
    code = 0
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # serialised here: tensors put on the queue directly would be shared through file
        # descriptors that vanish when this process exits before the parent reads them
        payload = io.BytesIO()
        torch.save(out, payload)
        results.put((rank, True, payload.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
        code = 1
    # Leave without the interpreter's teardown, once the report is on its way: there a gloo worker
    # has aborted after a finished run ("terminate called without an active exception", exit -6),
    # and the parent then took the crash for a failed run and killed the ranks still writing their
    # files. A torchrun worker leaves the same way (cli.py).
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn_local(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    collective_timeout_s: Optional[float] = None,
    threads_per_worker: Optional[int] = 1,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return each
    rank's return value (which must be picklable), in rank order.

    Every collective times out after ``collective_timeout_s`` (default: ``timeout_s``) and the whole
    run after ``timeout_s``: a bug makes this raise, never hang. ``fn`` must be importable by name
    (a module-level function), since workers are spawned, not forked: forking after torch has
    started its thread pool can deadlock.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctimeout = timeout_s if collective_timeout_s is None else collective_timeout_s
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(fn, r, world_size, init_method, ctimeout, threads_per_worker, tuple(args), results,
                          os.getpid()))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict = {}
    failures: List[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(outputs) + len(failures) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(f"{world_size} workers did not finish within {timeout_s:.0f}s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # a rank that reported and then crashed on its way out has lost nothing
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead and results.empty():
                    raise WorkerError(f"worker(s) died without a report: exit codes "
                                      f"{[p.exitcode for p in procs]}")
                continue
            if ok:
                import torch

                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank}:\n{value}")
                # the other ranks are probably blocked in a collective with the dead one
                break
        if failures:
            raise WorkerError("\n".join(failures))
        for p in procs:
            p.join(timeout=30)
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
