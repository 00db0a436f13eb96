"""What the benchmarks on emulated hosts share (``network``, ``ddp``, ``hierarchy``, ``overlap``).

The ``Settings`` of a run (hosts, rates, optimizers, model, steps) and how a rate is read and
named; the common options of ``ddp``, ``hierarchy`` and ``overlap`` and the ``Settings`` those
make; the check that namespaces can be made here, and the run itself, which SIGTERM and SIGHUP
unwind like Ctrl-C so that every ``Network``'s ``__exit__`` removes its namespaces; the figures'
formats and the log-rate axis of the plots. The machinery (namespaces, launcher, worker) is
``benchmarks.netsim``; each script keeps its own experiment, its own topology options (hosts,
nodes, ranks) and its own section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from benchmarks.netsim.topology import NetsimUnavailable, check_available
from benchmarks.report import write_section
from onebitlamb.comm.costmodel import parse_rate, rate_label

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


def rate_x(rows: List[dict]):
    """A row's x on a log axis of link rates in Mbit/s; the unshaped network drawn to the right of
    the fastest shaped rate."""
    shaped = [r["rate_bps"] for r in rows if r["rate_bps"] is not None]
    unshaped_x = max(shaped) * 5 if shaped else 1e10
    return lambda row: (row["rate_bps"] or unshaped_x) / 1e6


def log_rate_axis(ax, rows: List[dict], xlabel: str) -> None:
    """Log-log axes with one tick per measured rate (``rate_x``), labelled with the rate."""
    from matplotlib.ticker import NullLocator

    x_of = rate_x(rows)
    rates = sorted({r["rate_bps"] for r in rows}, key=lambda r: math.inf if r is None else r)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([x_of({"rate_bps": r}) for r in rates])
    ax.set_xticklabels(["unshaped" if r is None else rate_label(r).replace(" ", "\n") for r in rates])
    # no minor ticks between the rates (they would label rates not measured); the step-time axis
    # keeps its own, which label a range narrower than a decade
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.grid(True, which="both", alpha=0.3)




REPO = Path(__file__).resolve().parents[1]


def add_run_options(parser: argparse.ArgumentParser, *, rates: str, warmup_steps: int, compression_steps: int,
                    per: str, runs: str, plot: Optional[str] = None) -> None:
    """The options every emulated-network benchmark takes; ``per`` names what one worker stands
    for in the help ("host", "rank"), ``runs`` what is timed side by side ("usage", "group");
    ``plot``: the default PNG of a benchmark that draws one (and takes a ``--note``)."""
    parser.add_argument("--rates", default=rates,
                        help="link rates, comma-separated (10M, 1G, inf = unshaped); default %(default)s")
    parser.add_argument("--optimizers", default="onebitlamb",
                        help=f"comma-separated subset of {','.join(OPTIMIZERS)} (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="BERT hidden size (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="BERT layers (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help=f"sequences per {per} per step (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=warmup_steps,
                        help=f"timed warm-up steps of each {runs} (one untimed step precedes each stage); "
                             "default %(default)s")
    parser.add_argument("--compression-steps", type=int, default=compression_steps,
                        help=f"timed compression-stage steps of each {runs} (default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default %(default)s)")
    parser.add_argument("--burst-ms", type=float, default=4.0,
                        help="token bucket size in milliseconds of the link rate (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default %(default)s)")
    parser.add_argument("--raw", default=None, help="also write the raw per-rank results and the summary (JSON) here")
    parser.add_argument("--results", default=None, help="the BENCHMARKS.md to update (default: the repository's)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    if plot is not None:
        parser.add_argument("--plot", default=plot, help="the PNG to write, relative to the repository root "
                                                         "(default %(default)s; '' for none)")
        parser.add_argument("--note", default="", help="a sentence added to the section (e.g. what else ran)")


def settings(parser: argparse.ArgumentParser, args: argparse.Namespace, hosts: int) -> Settings:
    """The ``Settings`` of ``add_run_options``' options on ``hosts`` emulated hosts (``parser.error``
    on an unknown optimizer or a stage without timed steps)."""
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown or not optimizers:
        parser.error(f"--optimizers: choose from {', '.join(OPTIMIZERS)} (got {args.optimizers!r})")
    if args.warmup_steps < 1 or args.compression_steps < 1:
        parser.error("--warmup-steps and --compression-steps must be >= 1")
    return Settings(
        hosts=hosts, rates=[parse_rate(r) for r in args.rates.split(",") if r.strip()],
        optimizers=optimizers, model={"hidden": args.hidden, "layers": args.layers, "heads": max(2, args.hidden // 64),
                                      "intermediate": 4 * args.hidden},
        batch=args.batch, warmup_steps=args.warmup_steps, compression_steps=args.compression_steps,
        threads=args.threads, burst_ms=args.burst_ms, timeout_s=args.timeout, paired_rounds=0)


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


def save_plot(plot: str, draw: Callable[[dict, Path], None], summary: dict) -> str:
    """Draw ``summary`` into ``plot`` (relative to the repository root; '' for none); the sentence
    that names it in the section (none for an absolute path, outside the repository)."""
    if not plot:
        return ""
    path = Path(plot)
    draw(summary, path if path.is_absolute() else REPO / path)
    return "" if path.is_absolute() else f" Plot: `{plot}`."


def write_report(name: str, lines: List[str], table: str, targets_title: Optional[str], targets: List[str],
                 args: argparse.Namespace) -> int:
    """The section ``name`` of the results file: ``lines``, the table and, under ``targets_title``,
    the targets; then say on stderr what was written."""
    body = [*lines, "", table]
    if targets_title:
        body += ["", targets_title, "", *[f"- {t.strip()}" for t in targets]]
    path = write_section(name, "\n".join(body), args.results)
    plot = getattr(args, "plot", "")
    print(f"\nwrote {path}" + (f", {plot}" if plot else "") + (f", {args.raw}" if args.raw else ""), file=sys.stderr)
    return 0


class Measured(NamedTuple):
    raw: dict
    load: str
    summary: dict
    table: str
    targets: List[str]
    plot_note: str


def measure(prog: str, args: argparse.Namespace, run: Callable[[], dict], summarise: Callable[[dict], dict],
            table_of: Callable[[dict], str], targets_of: Callable[[dict], List[str]],
            draw: Callable[[dict, Path], None]) -> Union[int, Measured]:
    """Run, summarise, print the table and the targets; unless ``--no-write``, save the raw results
    and the plot. An exit code where the script ends here (interrupted: 130; ``--no-write``: 0)."""
    done = run_unwinding(prog, run)
    if done is None:
        return 130
    raw, load = done
    summary = summarise(raw)
    table, targets = table_of(summary), targets_of(summary)
    print(table)
    print("\n".join(["", *targets]))
    if args.no_write:
        return 0
    save_raw(args.raw, raw, summary)
    return Measured(raw, load, summary, table, targets, save_plot(args.plot, draw, summary))
