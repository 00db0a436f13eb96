"""DDP benchmark: plain usage against DistributedDataParallel + register_ddp on emulated hosts.

    sudo .venv/bin/python -m benchmarks.ddp      # from the repository root; default: 4 hosts, 50M, 200M, 1G

Plain usage: an unwrapped model, the optimizer all-reduces the flat gradient inside ``step()``,
after the backward. DDP + ``onebitlamb.register_ddp``: DDP's bucketed all-reduce averages the
warm-up's gradients behind the backward, and sends nothing once the optimizer compresses. Both
train the netsim's BERT in one launch per link rate, their steps interleaved (an order drawn
afresh each round, each step after a barrier, ``onebitlamb.netsim.worker.ddp_steps``), through
the warm-up and the compression stage. Writes the "ddp" section of BENCHMARKS.md: step times of
both, the per-step ratio, the bytes the optimizer's ``comm_stats`` accounted (in the backward,
DDP's, and in ``step()``) and the bytes each host's interface counted.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.report import command_line, heading, write_section
from onebitlamb.netsim import experiment
from onebitlamb.netsim.topology import NetsimUnavailable, check_available


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4, help="emulated hosts, one worker each (default %(default)s)")
    parser.add_argument("--rates", default="50M,200M,1G",
                        help="link rates, comma-separated (10M, 1G, inf = unshaped); default %(default)s")
    parser.add_argument("--optimizers", default="onebitlamb",
                        help="comma-separated subset of lamb,onebitlamb,onebitadam (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="BERT hidden size (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="BERT layers (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per host per step (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=8,
                        help="timed warm-up steps of each usage (one untimed step precedes each stage); "
                             "default %(default)s")
    parser.add_argument("--compression-steps", type=int, default=8,
                        help="timed compression-stage steps of each usage (default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default %(default)s)")
    parser.add_argument("--burst-ms", type=float, default=4.0,
                        help="token bucket size in milliseconds of the link rate (default %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: DDP's own, 25 MB after a 1 MB first bucket)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default %(default)s)")
    parser.add_argument("--raw", default=None, help="also write the raw per-rank results and the summary (JSON) here")
    parser.add_argument("--results", default=None, help="the BENCHMARKS.md to update (default: the repository's)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)

    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in optimizers if o not in experiment.OPTIMIZERS]
    if unknown or not optimizers:
        parser.error(f"--optimizers: choose from {', '.join(experiment.OPTIMIZERS)} (got {args.optimizers!r})")
    if args.hosts < 2:
        parser.error("--hosts must be >= 2")
    if args.warmup_steps < 1 or args.compression_steps < 1:
        parser.error("--warmup-steps and --compression-steps must be >= 1")
    try:
        check_available()
    except NetsimUnavailable as e:
        print(f"benchmarks.ddp: cannot emulate hosts here: {e}", file=sys.stderr)
        return 3
    heads = max(2, args.hidden // 64)
    s = experiment.Settings(
        hosts=args.hosts, rates=[experiment.parse_rate(r) for r in args.rates.split(",") if r.strip()],
        optimizers=optimizers, model={"hidden": args.hidden, "layers": args.layers, "heads": heads,
                                      "intermediate": 4 * args.hidden},
        batch=args.batch, warmup_steps=args.warmup_steps, compression_steps=args.compression_steps,
        threads=args.threads, burst_ms=args.burst_ms, timeout_s=args.timeout, paired_rounds=0)
    # SIGTERM/SIGHUP unwind like Ctrl-C, so every Network's __exit__ removes its namespaces
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    load_before = os.getloadavg()[0]
    try:
        raw = experiment.run_ddp(s, args.bucket_cap_mb, log=lambda m: print(m, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("benchmarks.ddp: interrupted; namespaces removed", file=sys.stderr)
        return 130
    summary = experiment.summarise_ddp(raw)
    table = experiment.format_ddp_table(summary)
    print(table)
    if args.raw and not args.no_write:
        Path(args.raw).write_text(json.dumps({"raw": raw, "summary": summary}, indent=1))
    if args.no_write:
        return 0
    m = s.model
    cap = "DDP's default buckets" if args.bucket_cap_mb is None else f"bucket_cap_mb={args.bucket_cap_mb:g}"
    body = "\n".join([
        *heading("DDP: plain usage vs DistributedDataParallel + register_ddp on emulated hosts",
                 command_line(argv if argv is not None else None),
                 f". Run as root. {s.hosts} hosts (network namespaces on a bridge, tbf on both ends of every link, bucket "
                 f"{s.burst_ms:g} ms of the rate), one worker each with {s.threads} torch thread(s), gloo, all "
                 f"sharing this machine's {os.cpu_count()} cores with other work (load average {load_before:.1f} at "
                 f"the start, {os.getloadavg()[0]:.1f} at the end)."),
        f"BERT hidden {m['hidden']}, {m['layers']} layers, {summary['params']:,} parameters, {s.batch} x 64 "
        f"tokens per host per step. Plain: the unwrapped model, the optimizer all-reduces the flat gradient "
        f"in `step()`. DDP: `DistributedDataParallel(model)` ({cap}, broadcast_buffers on) with "
        f"`register_ddp`. Both in one launch per rate, steps interleaved (order drawn afresh each round, "
        f"every step after a barrier); {s.warmup_steps} timed warm-up and {s.compression_steps} timed "
        f"compression steps of each (one untimed step before each stage). Run took "
        f"{raw['elapsed_s'] / 60:.1f} min.",
        "",
        "Step time: median over steps of the slowest rank; in brackets the medians of forward + backward "
        "(with DDP this includes waiting for its last bucket) and of `optimizer.step()`. Ratio: per step, "
        "plain over DDP (above 1: DDP faster). Accounted bytes: what this rank's `optimizer.comm_stats` "
        "recorded per step, during the backward (DDP's hook) and in `step()`. Wire bytes: the host's "
        "`tx_bytes` per step (TCP/IP headers, ACKs, DDP's buffer broadcast and gloo's own messages "
        "included; one bare barrier's bytes subtracted), mean over ranks. Qdisc drops per rate: "
        + ", ".join(f"{k} {v}" for k, v in summary["qdisc_drops"].items()) + ".",
        "",
        table,
    ])
    path = write_section("ddp", body, args.results)
    print(f"\nwrote {path}" + (f", {args.raw}" if args.raw else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
