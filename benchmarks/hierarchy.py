"""Hierarchy benchmark: the flat group against node_groups() on emulated nodes of several ranks.

    sudo .venv/bin/python -m benchmarks.hierarchy     # from the repository root; default: 2 nodes x 2 ranks, 10M, 50M, 100M, 1G

Each node is a network namespace holding ``--ranks-per-node`` workers, which reach each other over
the node's loopback (fast, unshaped, uncounted); the nodes are joined by links shaped with tbf.
In one launch per rate the netsim's BERT trains three times side by side, steps interleaved (an
order drawn afresh each round, each step after a barrier, ``onebitlamb.netsim.worker.hierarchy_steps``):
1-bit LAMB over the flat world group, over ``onebitlamb.comm.node_groups(L)`` (the hierarchical
all-reduce), and each rank alone (the compute-only step), through the warm-up and the compression
stage. Writes the "hierarchy" section of BENCHMARKS.md (step times, their per-step ratio, each
node's wire bytes from its interface's kernel counter, the bytes ``comm_stats`` accounted, the
cost model's prediction) and a plot of bytes and step time against the inter-node rate.
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

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PLOT = "docs/netsim_hierarchy.png"


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hierarchy", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default %(default)s)")
    parser.add_argument("--ranks-per-node", type=int, default=2,
                        help="workers per node, L of node_groups(L) (default %(default)s)")
    parser.add_argument("--rates", default="10M,50M,100M,1G",
                        help="link rates between nodes, comma-separated (10M, 1G, inf = unshaped); default %(default)s")
    parser.add_argument("--optimizers", default="onebitlamb",
                        help="comma-separated subset of onebitlamb,onebitadam,lamb (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="BERT hidden size (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="BERT layers (default %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=12,
                        help="timed warm-up steps of each group (one untimed step precedes each stage); "
                             "default %(default)s")
    parser.add_argument("--compression-steps", type=int, default=16,
                        help="timed compression-stage steps of each group (default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default %(default)s)")
    parser.add_argument("--burst-ms", type=float, default=4.0,
                        help="token bucket size in milliseconds of the link rate (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default %(default)s)")
    parser.add_argument("--plot", default=DEFAULT_PLOT,
                        help="the PNG to write, relative to the repository root (default %(default)s; '' for none)")
    parser.add_argument("--raw", default=None, help="also write the raw per-rank results and the summary (JSON) here")
    parser.add_argument("--results", default=None, help="the BENCHMARKS.md to update (default: the repository's)")
    parser.add_argument("--note", default="", help="a sentence added to the section (e.g. what else ran)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)

    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in optimizers if o not in experiment.OPTIMIZERS]
    if unknown or not optimizers:
        parser.error(f"--optimizers: choose from {', '.join(experiment.OPTIMIZERS)} (got {args.optimizers!r})")
    if args.nodes < 2 or args.ranks_per_node < 2:
        parser.error("--nodes and --ranks-per-node must be >= 2 (else there is nothing to compare)")
    if args.warmup_steps < 1 or args.compression_steps < 1:
        parser.error("--warmup-steps and --compression-steps must be >= 1")
    try:
        check_available()
    except NetsimUnavailable as e:
        print(f"benchmarks.hierarchy: cannot emulate nodes here: {e}", file=sys.stderr)
        return 3
    L = args.ranks_per_node
    heads = max(2, args.hidden // 64)
    s = experiment.Settings(
        hosts=args.nodes, rates=[experiment.parse_rate(r) for r in args.rates.split(",") if r.strip()],
        optimizers=optimizers, model={"hidden": args.hidden, "layers": args.layers, "heads": heads,
                                      "intermediate": 4 * args.hidden},
        batch=args.batch, warmup_steps=args.warmup_steps, compression_steps=args.compression_steps,
        threads=args.threads, burst_ms=args.burst_ms, timeout_s=args.timeout, paired_rounds=0)
    # SIGTERM/SIGHUP unwind like Ctrl-C, so every Network's __exit__ removes its namespaces
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    load_before = os.getloadavg()[0]
    try:
        raw = experiment.run_hierarchy(s, L, log=lambda m: print(m, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("benchmarks.hierarchy: interrupted; namespaces removed", file=sys.stderr)
        return 130
    load_after = os.getloadavg()[0]
    summary = experiment.summarise_hierarchy(raw)
    table = experiment.format_hierarchy_table(summary)
    targets = experiment.check_hierarchy_targets(summary)
    print(table)
    print("\n".join(["", *targets]))
    if args.no_write:
        return 0
    if args.raw:
        Path(args.raw).write_text(json.dumps({"raw": raw, "summary": summary}, indent=1))
    plot_note = ""
    if args.plot:
        plot_path = Path(args.plot) if Path(args.plot).is_absolute() else REPO / args.plot
        experiment.plot_hierarchy(summary, plot_path)
        plot_note = f" Plot: `{args.plot}`." if not Path(args.plot).is_absolute() else ""
    rows = summary["rows"]
    r0 = rows[0] if rows else {}
    m = s.model
    calib = ""
    if "alpha_s" in r0:
        calib = (f" Measured in each launch and used by the model: alpha {1000 * r0['alpha_s']:.2f} ms across nodes, "
                 f"{1000 * r0['alpha_intra_s']:.2f} ms inside a node, a node's loopback moving "
                 f"{r0['host_Bps'] / 1e6:.0f} MB/s per rank (first rate's launch).")
    body = "\n".join([
        *heading("Hierarchical compressed all-reduce: flat group vs node_groups() on emulated nodes",
                 command_line(argv if argv is not None else None),
                 f". Run as root. {s.hosts} nodes x {L} ranks: each node a network namespace holding {L} workers "
                 f"(gloo on the node's address, so their traffic to each other stays on the node's loopback), "
                 f"the nodes on a bridge with tbf on both ends of every link (bucket {s.burst_ms:g} ms of the rate); "
                 f"{s.threads} torch thread(s) per worker, {s.hosts * L} workers sharing this machine's "
                 f"{os.cpu_count()} cores (load average {load_before:.1f} at the start, {load_after:.1f} at the end)."
                 + (f" {args.note}" if args.note else "")),
        f"BERT hidden {m['hidden']}, {m['layers']} layer(s), {summary['params']:,} parameters, {s.batch} x 64 tokens "
        f"per rank per step. In one launch per rate, three copies side by side: 1-bit LAMB over the flat world "
        f"group, over `node_groups({L})`, and each rank alone in a one-rank group (compute-only: no collective); "
        f"steps interleaved (order drawn afresh each round, every step after a barrier); {s.warmup_steps} timed "
        f"warm-up and {s.compression_steps} timed compression steps of each (one untimed step before each stage). "
        f"Run took {raw['elapsed_s'] / 60:.1f} min.{plot_note}",
        "",
        "Step time: median over steps of the slowest rank; in brackets the cost model "
        "(`costmodel.predict_node_step`: compute-only step + per collective alpha + bytes across the node's card "
        "at the link rate + a rank's bytes at the loopback rate; codec not modelled). Ratio: per step, flat over "
        "hierarchical (above 1: hierarchical faster). Wire bytes: each node's `eth0` `tx_bytes` per step (what "
        "left the node through the shaped link: TCP/IP headers, ACKs and gloo's own messages included, one bare "
        "barrier's bytes subtracted), mean over nodes. Accounted per node beyond the node stages: the node's "
        "ranks' `comm_stats.bytes_sent` less `intra_reduce_scatter`/`intra_all_gather`; for the flat group this "
        "includes the messages between the two ranks of a node, which stay on its loopback. Per rank: all of "
        "`bytes_sent`, in brackets the node stages'. `optimizer.step()`: its median time (slowest rank), the "
        "communication plus the optimizer's maths plus the wait for the slowest rank's backward; alone: the "
        "maths only. Qdisc drops per rate (tail drops in the 256 KB queue when a node's ranks fill it at once; "
        "TCP retransmits them): "
        + ", ".join(f"{k} {v}" for k, v in summary["qdisc_drops"].items()) + "." + calib,
        "",
        table,
        "",
        "Against issue 40's targets (compression stage):",
        "",
        *[f"- {t.strip()}" for t in targets],
    ])
    path = write_section("hierarchy", body, args.results)
    print(f"\nwrote {path}" + (f", {args.plot}" if args.plot else "") + (f", {args.raw}" if args.raw else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
