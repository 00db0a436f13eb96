"""Persistent rank processes for the multi-process tests: ``run_ranks`` is ``spawn_local`` without
starting a fresh interpreter (and importing torch) for every call.

Most of the suite's time went into starting processes: every multi-rank test spawned 2-4 fresh
interpreters that imported torch, for one function call each. Here a pool per world size is
started once per pytest session, on the first call that needs it, and then runs each submitted
function on every rank. The contract is ``onebitlamb.comm.launch.spawn_local``'s:

- ``fn(rank, world_size, *args)`` runs on every rank; ``fn`` must be a module-level function (or a
  ``functools.partial`` of one), its arguments and return values anything ``torch.save`` takes;
  the results come back in rank order;
- a worker's exception comes back as ``WorkerError`` with its rank and traceback, a worker that dies
  without a report as ``WorkerError(killed=True)``;
- every collective times out after ``collective_timeout_s`` (default ``timeout_s``) and the whole
  call after ``timeout_s`` (``TimeoutError``): nothing hangs.

Each call gets a default gloo process group of its own, with the call's collective timeout, on a
store that rank 0 holds for the pool's life (building the group on loopback takes milliseconds; the
fresh interpreter took seconds). After the call every process group is destroyed, which also
removes the groups the function created, so a call starts with none but its own default group, as
in a fresh process. The group's rendezvous, and a barrier on it before the function runs, are
the barrier between two calls.

Between calls a rank is put back as a fresh worker of ``spawn_local`` would find it: environment
variables, working directory, ``sys.path``, warning filters (and the "already warned" registries),
torch's default dtype and device, a fresh random seed for torch, ``random`` and numpy, one intra-op
thread, gradients enabled, no anomaly detection, no deterministic mode; torch.compile's caches,
accelerate's process-wide state and the library's ``GLOBAL_STATS`` emptied; any function of
``torch.distributed`` a test replaced (to count calls) put back. (No ``gc.collect()``: with torch
loaded it took 0.15-0.3 s a call.) What cannot be put back (a module-level attribute a function
patched and did not restore, a thread it left running, modules it put in ``sys.modules``) is for
the caller to avoid: such a function keeps using ``spawn_local``.

When a call fails, times out, or a rank dies, the pool is torn down (its processes killed) and the
next call starts a fresh one, so a failure cannot leak into later tests. ``shutdown()`` ends every
pool; conftest calls it at the end of the session, and it is registered with ``atexit`` as well.
Only the processes started here are ever killed.
"""
from __future__ import annotations

import atexit
import datetime
import io
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from onebitlamb.comm.launch import WorkerError, _died, _passive_waits_if_oversubscribed, exit_with, spawn_local

#: Seconds a pool may take to start: every rank imports torch and connects to rank 0's store, on a
#: busy 2-core machine. Not counted in a call's ``timeout_s`` (spawn_local's fresh start is, but it
#: is the same for every call there and paid once here).
START_TIMEOUT_S = 180.0
#: Seconds the other ranks' reports are awaited after a rank reported a failure (all of them are
#: then in the error, the failure first).
FAILURE_GRACE_S = 3.0


# ----------------------------------------------------------------------------------------------
# The rank side


def _serve(rank: int, world_size: int, conn, parent: int) -> None:
    """A rank's life: start, then run one call per message until told to stop or the parent is
    gone."""
    exit_with(parent)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # spawn_local's threads_per_worker default
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
            conn.send(("port", store.port))
        else:
            port = conn.recv()
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        clean = _Snapshot()
        conn.send(("ready", os.getpid()))
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        _leave(conn, 1)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _leave(conn, 0)
        if message is None:
            _leave(conn, 0)
        call, collective_timeout_s, payload = message
        reply, sent = None, False
        try:
            fn, args = torch.load(io.BytesIO(payload), weights_only=False)
            dist.init_process_group("gloo", store=dist.PrefixStore(f"call{call}", store), rank=rank,
                                    world_size=world_size,
                                    timeout=datetime.timedelta(seconds=collective_timeout_s))
            try:
                dist.barrier()  # every pair connected before a rank may finish and close its end
                out = fn(rank, world_size, *args)
            except BaseException:  # everything, including KeyboardInterrupt, goes to the parent...
                conn.send((call, False, traceback.format_exc()))
                sent = True  # ...before the group below goes: its peers' errors then come second
                raise
            finally:
                dist.destroy_process_group()  # the default group and every group fn created
            buffer = io.BytesIO()
            torch.save(out, buffer)
            reply = (call, True, buffer.getvalue())
        except BaseException:
            reply = (call, False, traceback.format_exc())
        finally:
            out = fn = args = None
            try:
                clean.restore()
            except BaseException:
                reply = (call, False, "restoring the rank after the call:\n" + traceback.format_exc())
        if not sent:
            conn.send(reply)


def _leave(conn, code: int) -> None:
    """Leave without the interpreter's teardown, as spawn_local's workers do (a gloo worker has
    aborted there after a finished run)."""
    try:
        conn.close()
    except OSError:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Snapshot:
    """What a fresh worker process finds, taken once the rank has started, and put back after each
    call."""

    def __init__(self) -> None:
        import warnings

        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.filters = list(warnings.filters)
        self.dtype = torch.get_default_dtype()
        self.dist_functions = {k: v for k, v in vars(torch.distributed).items() if callable(v)}
        self.device = torch.get_default_device()

    def restore(self) -> None:
        import random
        import warnings

        import torch

        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        sys.path[:] = self.path
        warnings.filters[:] = self.filters
        getattr(warnings, "_filters_mutated", lambda: None)()  # forgets which warnings were shown
        torch.set_default_dtype(self.dtype)
        names = vars(torch.distributed)
        for name, function in self.dist_functions.items():  # a collective a test wrapped to count calls
            if names.get(name) is not function:
                names[name] = function
        if torch.get_default_device() != self.device:
            torch.set_default_device(None)
        torch.seed()
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_num_threads(1)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.use_deterministic_algorithms(False)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        accelerate = sys.modules.get("accelerate.state")  # its state is per process, shared by every Accelerator
        if accelerate is not None:
            accelerate.AcceleratorState._reset_state(reset_partial_state=True)
            accelerate.GradientState._reset_state()
        stats = sys.modules.get("onebitlamb.comm.stats")
        if stats is not None:
            stats.GLOBAL_STATS.reset()


# ----------------------------------------------------------------------------------------------
# The parent side


class RankPool:
    """``world_size`` persistent rank processes. Started on the first ``run``; any failure closes it
    and the next ``run`` starts it again."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        self.calls = 0
        self.starts = 0

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def start(self) -> None:
        self.close()
        ctx = mp.get_context("spawn")
        ok = False
        try:
            with _passive_waits_if_oversubscribed(self.world_size):  # as spawn_local's workers start
                for rank in range(self.world_size):
                    mine, theirs = ctx.Pipe(duplex=True)
                    p = ctx.Process(target=_serve, args=(rank, self.world_size, theirs, os.getpid()), daemon=True,
                                    name=f"rank-pool-{self.world_size}-{rank}")
                    p.start()
                    theirs.close()
                    self.procs.append(p)
                    self.conns.append(mine)
            deadline = time.monotonic() + START_TIMEOUT_S
            kind, port = self._recv(0, deadline)
            if kind != "port":
                raise RuntimeError(f"rank pool of {self.world_size}: rank 0 did not start:\n{port}")
            for conn in self.conns[1:]:
                conn.send(port)
            for rank in range(self.world_size):
                kind, value = self._recv(rank, deadline)
                if kind != "ready":
                    raise RuntimeError(f"rank pool of {self.world_size}: rank {rank} did not start:\n{value}")
            self.starts += 1
            ok = True
        finally:
            if not ok:
                self.close(ask=False)

    def _recv(self, rank: int, deadline: float):
        conn, proc = self.conns[rank], self.procs[rank]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"rank pool of {self.world_size}: rank {rank} did not start "
                                   f"within {START_TIMEOUT_S:.0f}s")
            ready = wait([conn, proc.sentinel], timeout=remaining)
            if conn in ready:
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    proc.join(timeout=5)
            if proc.sentinel in ready or not proc.is_alive():
                raise RuntimeError(f"rank pool of {self.world_size}: rank {rank} exited with status "
                                   f"{proc.exitcode} while starting")

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), *, timeout_s: float = 120.0,
            collective_timeout_s: Optional[float] = None) -> List[Any]:
        import torch

        if not self.alive:
            self.start()
        payload = io.BytesIO()
        torch.save((fn, tuple(args)), payload)
        payload = payload.getvalue()
        self.calls += 1
        call = self.calls
        ctimeout = timeout_s if collective_timeout_s is None else collective_timeout_s
        finished = False
        try:
            for conn in self.conns:
                conn.send((call, ctimeout, payload))
            out = self._collect(call, timeout_s)
            finished = True
            return out
        finally:
            if not finished:
                self.close(ask=False)  # the ranks may be inside the call still

    def _collect(self, call: int, timeout_s: float) -> List[Any]:
        import torch

        n = self.world_size
        outputs: Dict[int, Any] = {}
        failures: List[str] = []
        failed: set = set()
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        deadline = time.monotonic() + timeout_s
        grace_until = 0.0
        while True:
            if failures and (not waiting or time.monotonic() >= grace_until):
                # a rank killed by a signal breaks its peers' connections, and then the kill is the cause
                dead = _died(self.procs, set(outputs) | failed, grace_s=1.0, signalled=True)
                if dead:
                    raise WorkerError(dead, killed=True)
                raise WorkerError("\n".join(failures))
            if not waiting:
                break
            remaining = (grace_until if failures else deadline) - time.monotonic()
            if remaining <= 0:
                if failures:
                    continue  # the grace is over: raised above
                raise TimeoutError(f"{n} workers did not finish within {timeout_s:.0f}s")
            sentinels = {self.procs[rank].sentinel: conn for conn, rank in waiting.items()}
            ready = wait(list(waiting) + list(sentinels), timeout=min(remaining, 1.0))
            lost = False
            for obj in ready:
                conn = obj if obj in waiting else sentinels.get(obj)
                if conn is None or conn not in waiting:
                    continue
                if obj is not conn and conn.poll(0):
                    continue  # the rank reported, then ended: its report is read below
                if obj is not conn:
                    lost = True  # ended without a report
                    continue
                rank = waiting.pop(conn)
                try:
                    got, ok, value = conn.recv()
                except (EOFError, OSError):
                    lost = True  # the rank died: its exit status says how below
                    continue
                if got != call:
                    raise RuntimeError(f"rank {rank} answered call {got} during call {call}")
                if ok:
                    outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    failures.append(f"rank {rank}:\n{value}")
                    failed.add(rank)
            if lost:
                dead = _died(self.procs, set(outputs), grace_s=5.0)
                raise WorkerError(dead or "a worker closed its connection without a report", killed=True)
            if failures and not grace_until:
                # the other ranks' reports for a moment: a rank blocked in a collective with the failed
                # one fails too once the failed rank's group is gone, after that rank's report
                grace_until = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return [outputs[r] for r in range(n)]

    def close(self, ask: bool = True) -> None:
        """Stop the ranks: asked first (``ask``: they are idle), then killed. Only this pool's processes."""
        procs, conns = self.procs, self.conns
        self.procs, self.conns = [], []
        for conn, p in zip(conns, procs):
            try:
                if ask and p.is_alive():
                    conn.send(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + (2.0 if ask else 0.0)
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for conn in conns:
            conn.close()


_pools: Dict[int, RankPool] = {}
_lock = threading.Lock()


def pool(world_size: int) -> RankPool:
    """This session's pool of ``world_size`` ranks (not started until it runs something)."""
    with _lock:
        if world_size not in _pools:
            _pools[world_size] = RankPool(world_size)
        return _pools[world_size]


def run_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
              collective_timeout_s: Optional[float] = None) -> List[Any]:
    """``spawn_local(fn, world_size, args, timeout_s=..., collective_timeout_s=...)`` on this session's
    persistent ranks: each rank's return value, in rank order. For a function that leaves nothing
    behind that a fresh process would not have (see the module's docstring); one that needs its
    own process (killing ranks, per-worker threads or environment set at start, the training
    command's launcher) uses spawn_local; a main-job run a test only builds on goes through
    tests/pretrain_pool.py, which puts back the signal handlers ``train_rank`` installs. With
    ``ONEBITLAMB_TEST_FRESH_RANKS=1`` in the environment every call goes to spawn_local instead (to
    tell a pool problem from a test's, or to time the suite without it)."""
    if os.environ.get("ONEBITLAMB_TEST_FRESH_RANKS"):  # every call in fresh processes, as before the pool
        return spawn_local(fn, world_size, args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s)
    p = pool(world_size)
    with _lock:
        return p.run(fn, args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s)


def shutdown() -> None:
    """Stop every pool of this session."""
    with _lock:
        for p in _pools.values():
            p.close()
        _pools.clear()


atexit.register(shutdown)


def raised(fn: Callable[[], Any]) -> Optional[Tuple[str, str]]:
    """What ``fn()`` raised, as ``(type name, message)``, or None: a rank's expected errors come
    back as data, so the test sees every rank's, where a raise would end the call at the first."""
    try:
        fn()
    except Exception as exc:  # the test inspects type and message
        return type(exc).__name__, str(exc)
    return None
