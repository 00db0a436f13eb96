"""What ``benchmarks.network`` takes from the emulated hosts' set-up, apart from its own experiment.

The ``Settings`` of a run (hosts, rates, optimizers, model, steps), the figures' formats, the check
that namespaces can be made here, and the run itself, which SIGTERM and SIGHUP unwind like Ctrl-C so
that every ``Network``'s ``__exit__`` removes its namespaces. The machinery (namespaces, launcher,
worker) is ``benchmarks.netsim``.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks.netsim.topology import NetsimUnavailable, check_available
from onebitlamb.comm.costmodel import parse_rates, rate_label  # noqa: F401 (network's, from here)

OPTIMIZERS = ("lamb", "onebitlamb", "onebitadam")
LABELS = {"lamb": "LAMB", "onebitlamb": "1-bit LAMB", "onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam"}


@dataclass
class Settings:
    """One run on emulated hosts; ``spec()`` is the part its workers read."""

    hosts: int = 2
    rates: Sequence[Optional[float]] = (10e6, 50e6, 200e6, 1e9, None)
    optimizers: Sequence[str] = OPTIMIZERS
    model: Dict[str, int] = field(default_factory=dict)
    batch: int = 16
    warmup_steps: int = 3
    compression_steps: int = 8
    skip_steps: int = 1
    threads: int = 1
    burst_ms: float = 4.0
    warmup_fraction: float = 0.2
    timeout_s: float = 900.0
    paired_rounds: int = 100

    def spec(self) -> dict:
        return {"model": dict(self.model), "batch": self.batch, "optimizers": list(self.optimizers),
                "warmup_steps": self.warmup_steps, "compression_steps": self.compression_steps,
                "skip_steps": self.skip_steps, "threads": self.threads}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def slowest(per_rank: List[dict], key: str) -> List[float]:
    """Per step, the slowest rank's value: a synchronous step costs what its last rank spends."""
    return [max(v) for v in zip(*(r[key] for r in per_rank))]


def quartiles(values: List[float]):
    values = sorted(values)
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


def ms(x: float) -> str:
    """Milliseconds for a table: three significant figures or so."""
    return f"{1000 * x:.0f}" if x >= 0.1 else f"{1000 * x:.1f}"


def kb(x: Optional[float]) -> str:
    """Kilobytes for a table; "-" where there is no figure (no interface counter on loopback)."""
    if x is None:
        return "-"
    return f"{x / 1024:.0f}" if x >= 10240 else f"{x / 1024:.1f}"


def unavailable(prog: str, what: str) -> bool:
    """Whether namespaces cannot be made here (root, ``ip``, ``tc``), said on stderr."""
    try:
        check_available()
    except NetsimUnavailable as e:
        print(f"{prog}: cannot emulate {what} here: {e}", file=sys.stderr)
        return True
    return False


def log(message: str) -> None:
    """Progress on stderr: stdout carries the table only."""
    print(message, file=sys.stderr, flush=True)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_unwinding(prog: str, run: Callable[[], dict]) -> Optional[Tuple[dict, str]]:
    """``run()``'s raw results and a note on the machine's load around it ("load average 1.2 at
    the start, 1.9 at the end": the workers share its cores with whatever else runs), or None when
    it was interrupted (Ctrl-C, SIGTERM, SIGHUP), its namespaces removed."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    load_before = os.getloadavg()[0]
    try:
        raw = run()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; namespaces removed", file=sys.stderr)
        return None
    return raw, f"load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"


def save_raw(path: Optional[str], raw: dict, summary: dict) -> None:
    """The raw per-rank results and their summary as JSON, when ``--raw`` names a file."""
    if path:
        Path(path).write_text(json.dumps({"raw": raw, "summary": summary}, indent=1))
