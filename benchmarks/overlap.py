"""Overlap benchmark: the serial step against overlap_with_backward() on emulated hosts.

    sudo .venv/bin/python -m benchmarks.overlap     # from the repository root; default: 2 hosts, 10M, 50M, 200M, 1G

In the serial step the optimizer exchanges (the warm-up's gradient average, after the freeze the
compressed all-reduce of the momentum) in ``step()``, after the whole backward, and the link idles
while the backward runs. With ``optimizer.overlap_with_backward(bucket_cap_mb)`` each bucket's
exchange starts on a thread as soon as the backward has produced its gradients. In one launch per
rate the netsim's BERT trains side by side, steps interleaved (an order drawn afresh each round,
each step after a barrier, ``onebitlamb.netsim.worker.hierarchy_steps``): 1-bit LAMB over the
world group serial and overlapped, and each rank alone (the compute-only step); with
``--ranks-per-host`` above 1 also over ``node_groups(L)``, serial and overlapped. Writes the
"overlap" section of BENCHMARKS.md (step times, their per-step ratio, the ideal step
max(compute-only, wire time), the buckets started during the backward, each host's wire bytes,
issue 40's targets) and a plot of step time against the link rate.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from benchmarks import emulated
from benchmarks.report import command_line, heading
from onebitlamb.netsim import experiment

DEFAULT_PLOT = "docs/netsim_overlap.png"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (nodes) (default %(default)s)")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="workers per host; above 1 node_groups(L) runs too, serial and overlapped "
                             "(default %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0,
                        help="overlap_with_backward's bucket_cap_mb (default %(default)s)")
    emulated.add_run_options(parser, rates="10M,50M,200M,1G", warmup_steps=12, compression_steps=16, per="rank",
                             runs="mode", plot=DEFAULT_PLOT)
    args = parser.parse_args(argv)
    if args.hosts < 2 or args.ranks_per_host < 1:
        parser.error("--hosts must be >= 2 and --ranks-per-host >= 1")
    if not args.bucket_cap_mb > 0:
        parser.error("--bucket-cap-mb must be > 0")
    s = emulated.settings(parser, args, args.hosts)
    if emulated.unavailable("benchmarks.overlap", "hosts"):
        return 3
    L = args.ranks_per_host
    modes = ["flat", "overlap", "solo"] + (["hier", "hier-overlap"] if L > 1 else [])
    measured = emulated.measure(
        "benchmarks.overlap", args, lambda: experiment.run_hierarchy(
            s, L, log=emulated.log, modes=modes, bucket_cap_mb=args.bucket_cap_mb),
        experiment.summarise_hierarchy, experiment.format_overlap_table, experiment.check_overlap_targets,
        experiment.plot_overlap)
    if isinstance(measured, int):
        return measured
    raw, load, summary, table, targets, plot_note = measured
    m, cap = s.model, args.bucket_cap_mb
    unit = "host" if L == 1 else "node"
    topology = (f"{s.hosts} hosts, one worker each" if L == 1 else
                f"{s.hosts} nodes x {L} ranks (each node a namespace holding {L} workers, whose traffic to each "
                f"other stays on its loopback)")
    hier = (f", the same two over `node_groups({L})`" if L > 1 else "")
    lines = [
        *heading("Overlap: the serial step vs overlap_with_backward() on emulated hosts",
                 command_line(argv if argv is not None else None),
                 f". Run as root. {topology}, on a bridge with tbf on both ends of every link (bucket "
                 f"{s.burst_ms:g} ms of the rate); gloo, {s.threads} torch thread(s) per worker, {s.hosts * L} "
                 f"workers sharing this machine's {os.cpu_count()} cores ({load})."
                 + (f" {args.note}" if args.note else "")),
        f"BERT hidden {m['hidden']}, {m['layers']} layer(s), {summary['params']:,} parameters, {s.batch} x 64 tokens "
        f"per rank per step. In one launch per rate, side by side: 1-bit LAMB over the world group exchanging in "
        f"`step()` (serial), the same with `overlap_with_backward({cap:g})` (each bucket of at most {cap:g} MiB "
        f"starts its exchange, the warm-up's average or after the freeze the compressed all-reduce, on a thread as "
        f"the backward completes it; `step()` waits for the rest){hier}, and each rank alone in a one-rank group "
        f"(compute-only: no collective); steps interleaved (order drawn afresh each round, every step after a "
        f"barrier); {s.warmup_steps} timed warm-up and {s.compression_steps} timed compression steps of each (one "
        f"untimed step before each stage). Run took {raw['elapsed_s'] / 60:.1f} min.{plot_note}",
        "",
        "Step time: median over steps of the slowest rank; in brackets the medians of forward + backward (with "
        "overlap this includes preparing each bucket as it completes) and of `optimizer.step()` (the wait for the "
        "exchanges still running, then the maths). Ratio: per step, serial over overlapped (above 1: overlap "
        f"faster). Ideal: max(compute-only step, wire time), the wire time being the overlapped run's bytes "
        f"leaving the {unit} per step x 8 / the link rate: the step if the exchange hid entirely behind the "
        f"compute or the compute behind the link (in brackets the wire time). Buckets started in the backward: "
        f"mean over ranks and steps of those `overlap_with_backward` had started when the backward returned "
        f"(the rest start in `step()`), of the buckets there are. Wire bytes: the {unit}'s `eth0` `tx_bytes` per "
        f"step (TCP/IP headers, ACKs and gloo's own messages included, one bare barrier's bytes subtracted), mean "
        f"over {unit}s. Qdisc drops per rate: "
        + ", ".join(f"{k} {v}" for k, v in summary["qdisc_drops"].items()) + ".",
    ]
    title = "Against issue 40's targets (1-bit LAMB's compression stage, flat group):"
    return emulated.write_report("overlap", lines, table, title, targets, args)


if __name__ == "__main__":
    sys.exit(main())
