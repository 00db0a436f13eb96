"""Run one worker per emulated host and gather their results.

``run_workers(net, spec)`` writes the spec, starts ``python -m benchmarks.netsim.worker`` in every
host's namespace (``net.ranks_per_host`` of them in each, consecutive ranks on one host, with
torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` set; gloo bound to the host's interface, rendezvous at host 0), waits with a
deadline, and returns the per-rank results; if a worker fails or the deadline passes, the others
are stopped and the error carries the failed worker's output. The network itself (and with it any
process left inside) is torn down by the ``Network`` context manager of the caller.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

from benchmarks.netsim.topology import Network

#: Any port is free in a namespace created a moment ago, so no search is needed.
RENDEZVOUS_PORT = 29500


class WorkerFailed(RuntimeError):
    """A worker exited non-zero or did not finish in time; the message carries its output."""


def run_workers(net: Network, spec: dict, timeout_s: float = 600.0) -> List[dict]:
    repo_root = str(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory(prefix="oblnetsim") as tmp:
        spec = dict(spec, out=os.path.join(tmp, "result"), interface=net.interface,
                    init_method=f"tcp://{net.address(0)}:{RENDEZVOUS_PORT}")
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        procs, logs = [], []
        world, local = net.world_size, net.ranks_per_host
        for rank in range(world):
            env = dict(os.environ, OBL_RANK=str(rank), OBL_WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local),
                       GLOO_SOCKET_IFNAME=net.interface, OMP_NUM_THREADS=str(spec.get("threads", 1)),
                       PYTHONPATH=os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p))
            log = open(os.path.join(tmp, f"log.{rank}"), "w+")
            logs.append(log)
            procs.append(net.popen(net.host_of(rank), [sys.executable, "-m", "benchmarks.netsim.worker", spec_path],
                                   env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"workers did not finish within {timeout_s:.0f}s\n" + _tails(logs))
                time.sleep(0.1)
            if failed:
                raise WorkerFailed(f"worker(s) {failed} failed (exit codes {codes})\n" + _tails(logs))
            results = []
            for rank in range(world):
                with open(f"{spec['out']}.{rank}.json") as f:
                    results.append(json.load(f))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
            for log in logs:
                log.close()


def _tails(logs, lines: int = 25) -> str:
    out = []
    for rank, log in enumerate(logs):
        log.flush()
        log.seek(0)
        text = log.read().splitlines()[-lines:]
        out.append(f"--- rank {rank} ---\n" + "\n".join(text))
    return "\n".join(out)
