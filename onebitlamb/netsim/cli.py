"""``onebitlamb netsim``: LAMB, 1-bit LAMB and 1-bit Adam on emulated hosts behind slow links.

Needs root and iproute2 (``ip``, ``tc``): each host is a network namespace on a bridge, every link
shaped by a token bucket. Prints the speed-up table with the cost model's prediction beside each
measured step; ``--json`` keeps the raw per-rank results. The namespaces are always removed, also
on an error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from onebitlamb.netsim import experiment
from onebitlamb.netsim.topology import NetsimUnavailable, check_available, cleanup_stale


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = experiment.Settings()
    parser.add_argument("--hosts", type=int, default=d.hosts, help="emulated hosts, one worker each (default %(default)s)")
    parser.add_argument("--rates", default="10M,50M,200M,1G,inf",
                        help="link rates, comma-separated (10M, 1G, inf = unshaped); default %(default)s")
    parser.add_argument("--optimizers", default=",".join(d.optimizers),
                        help="comma-separated subset of lamb,onebitlamb,onebitadam (default: all)")
    parser.add_argument("--hidden", type=int, default=128, help="BERT hidden size (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="BERT layers (default %(default)s)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/64, at least 2)")
    parser.add_argument("--intermediate", type=int, default=None, help="feed-forward width (default 4*hidden)")
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per host per step (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                        help="timed warm-up steps (one untimed step precedes each stage); default %(default)s")
    parser.add_argument("--compression-steps", type=int, default=d.compression_steps,
                        help="timed compression-stage steps (default %(default)s)")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker (default %(default)s)")
    parser.add_argument("--burst-ms", type=float, default=d.burst_ms,
                        help="token bucket size in milliseconds of the link rate (default %(default)s)")
    parser.add_argument("--warmup-fraction", type=float, default=d.warmup_fraction,
                        help="share of warm-up steps for the end-to-end figure (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per launch (default %(default)s)")
    parser.add_argument("--paired-rounds", type=int, default=d.paired_rounds,
                        help="rounds of the interleaved loopback comparison, one step of every optimizer "
                             "each (0: skip it); default %(default)s")
    parser.add_argument("--json", default=None, help="write the raw results and the summary here")
    parser.add_argument("--cleanup", action="store_true",
                        help="only remove namespaces left by killed runs (whose process is gone), then exit")


def settings_from_args(args) -> experiment.Settings:
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in optimizers if o not in experiment.OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {', '.join(experiment.OPTIMIZERS)}")
    if "lamb" not in optimizers:
        raise ValueError("the comparison needs lamb among --optimizers (it is the baseline)")
    if args.hosts < 2:
        raise ValueError(f"--hosts must be >= 2 (there is nothing to communicate with one), got {args.hosts}")
    if args.warmup_steps < 1 or args.compression_steps < 1:
        raise ValueError("--warmup-steps and --compression-steps must be >= 1")
    if args.paired_rounds < 0:
        raise ValueError(f"--paired-rounds must be >= 0, got {args.paired_rounds}")
    heads = args.heads or max(2, args.hidden // 64)
    if args.hidden % heads:
        raise ValueError(f"--hidden {args.hidden} is not divisible by {heads} heads")
    model = {"hidden": args.hidden, "layers": args.layers, "heads": heads,
             "intermediate": args.intermediate or 4 * args.hidden}
    return experiment.Settings(
        hosts=args.hosts, rates=[experiment.parse_rate(r) for r in args.rates.split(",") if r.strip()],
        optimizers=optimizers, model=model, batch=args.batch, warmup_steps=args.warmup_steps,
        compression_steps=args.compression_steps, threads=args.threads, burst_ms=args.burst_ms,
        warmup_fraction=args.warmup_fraction, timeout_s=args.timeout, paired_rounds=args.paired_rounds)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def execute(args):
    """Check the machine, run, summarise. Returns (settings, raw, summary) or an exit code."""
    try:
        check_available()
    except NetsimUnavailable as e:
        print(f"onebitlamb netsim: cannot emulate hosts here: {e}", file=sys.stderr)
        return 3
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s): {' '.join(removed) or '-'}")
        return 0
    try:
        s = settings_from_args(args)
    except ValueError as e:
        print(f"onebitlamb netsim: {e}", file=sys.stderr)
        return 2
    # SIGTERM/SIGHUP unwind like Ctrl-C, so every Network's __exit__ removes its namespaces
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    try:
        raw = experiment.run_experiment(s, log=lambda m: print(m, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("onebitlamb netsim: interrupted; namespaces removed", file=sys.stderr)
        return 130
    summary = experiment.summarise(raw)
    return s, raw, summary


def run(args) -> int:
    res = execute(args)
    if isinstance(res, int):
        return res
    s, raw, summary = res
    print(experiment.format_tables(summary, s.warmup_fraction))
    print()
    print("\n".join(experiment.check_targets(summary)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw": raw, "summary": summary}, f, indent=1)
    return 0
