"""Start N local worker processes joined by a gloo process group on loopback.

Used by the pretraining CLI's default launcher, the benchmarks and the multi-process tests: one
place that knows how to pick a free port, time out instead of hanging, and bring a worker's
traceback back to the parent. (Under ``torchrun`` none of this is used: the environment already
describes the group.)
"""
from __future__ import annotations

import contextlib
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
from typing import Any, Callable, Iterator, List, Optional, Sequence


class WorkerError(RuntimeError):
    """A worker raised, or died without a report. The message carries the rank and its traceback,
    or, when ``killed``, one line naming each worker that died and how (its signal, or its exit
    status)."""

    def __init__(self, message: str, killed: bool = False) -> None:
        super().__init__(message)
        self.killed = killed

    def __reduce__(self):
        return type(self), (str(self), self.killed)


def _died(procs, reported, grace_s: float = 0.0, signalled: bool = False) -> Optional[str]:
    """The workers that ended without a report (``signalled``: killed by a signal), waiting up to
    ``grace_s`` for one (a peer's error from the broken connection may be reported before the
    killed worker is reaped)."""
    deadline = time.monotonic() + grace_s
    while True:
        dead = [(r, p) for r, p in enumerate(procs)
                if p.exitcode not in (None, 0) and r not in reported and (p.exitcode < 0 or not signalled)]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not dead:
        return None
    import signal

    def how(code: int) -> str:
        if code < 0:
            try:
                return f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    return "; ".join(f"worker rank {r} (pid {p.pid}) {how(p.exitcode)} without a report" for r, p in dead)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_with(parent: int, message: Optional[str] = None) -> None:
    """Leave (exit status 1, ``message`` on stderr first) within half a second of the launching
    process ``parent`` being gone. Killed by a signal it cannot clean up after (SIGKILL), it leaves
    its workers behind, and they would train on alone for hours, writing checkpoints into the run's
    folder. A thread polls the parent pid, which is portable and sees the parent's death whichever
    thread of it started this process (``PR_SET_PDEATHSIG`` fires when that thread ends). Once per
    process."""
    global _watching
    if _watching:
        return
    _watching = True

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        if message:
            print(message, file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


_watching = False


def _worker(fn, rank, world_size, init_method, timeout_s, threads, args, results, parent) -> None:
    import torch
    import torch.distributed as dist

    exit_with(parent)
    code = 0
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # Every rank through the rendezvous before any runs fn: rank 0 holds the store, and with a
        # fn that calls no collective it could finish and exit while another rank still read the
        # store to join ("Failed to recv, got 0 bytes", seen under load).
        dist.barrier()
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


@contextlib.contextmanager
def _passive_waits_if_oversubscribed(threads: int) -> Iterator[None]:
    """Workers started inside see ``OMP_WAIT_POLICY=PASSIVE`` when their threads outnumber the
    cores (unless the user set it): OpenMP threads spin while they wait for work, and with more of
    them than cores the spinners take the cores from the threads that work (4 workers of 2
    threads on 2 cores ran 12x slower). Waiting changes no number, only who gets the core."""
    if threads <= (os.cpu_count() or 1) or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        del os.environ["OMP_WAIT_POLICY"]


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
    with _passive_waits_if_oversubscribed(world_size * (threads_per_worker or 1)):
        for p in procs:
            p.start()
    outputs: dict = {}
    failures: List[str] = []
    failed: set = set()
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
                dead = _died(procs, outputs)
                if dead and results.empty():
                    raise WorkerError(dead, killed=True)
                continue
            if ok:
                import torch

                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank}:\n{value}")
                failed.add(rank)
                # the other ranks are probably blocked in a collective with the dead one
                break
        if failures:
            # a worker killed by a signal breaks its peers' connections: their errors come first,
            # but the kill is the cause
            dead = _died(procs, set(outputs) | failed, grace_s=1.0, signalled=True)
            if dead:
                raise WorkerError(dead, killed=True)
            raise WorkerError("\n".join(failures))
        for p in procs:
            p.join(timeout=30)
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
