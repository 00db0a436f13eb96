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
import os
import sys
from typing import Optional, Sequence

from benchmarks import emulated
from benchmarks.report import command_line, heading
from onebitlamb.netsim import experiment

DEFAULT_PLOT = "docs/netsim_hierarchy.png"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hierarchy", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default %(default)s)")
    parser.add_argument("--ranks-per-node", type=int, default=2,
                        help="workers per node, L of node_groups(L) (default %(default)s)")
    emulated.add_run_options(parser, rates="10M,50M,100M,1G", warmup_steps=12, compression_steps=16, per="rank",
                             runs="group", plot=DEFAULT_PLOT)
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.ranks_per_node < 2:
        parser.error("--nodes and --ranks-per-node must be >= 2 (else there is nothing to compare)")
    s = emulated.settings(parser, args, args.nodes)
    if emulated.unavailable("benchmarks.hierarchy", "nodes"):
        return 3
    L = args.ranks_per_node
    measured = emulated.measure(
        "benchmarks.hierarchy", args, lambda: experiment.run_hierarchy(s, L, log=emulated.log),
        experiment.summarise_hierarchy, experiment.format_hierarchy_table, experiment.check_hierarchy_targets,
        experiment.plot_hierarchy)
    if isinstance(measured, int):
        return measured
    raw, load, summary, table, targets, plot_note = measured
    rows = summary["rows"]
    r0 = rows[0] if rows else {}
    m = s.model
    calib = ""
    if "alpha_s" in r0:
        calib = (f" Measured in each launch and used by the model: alpha {1000 * r0['alpha_s']:.2f} ms across nodes, "
                 f"{1000 * r0['alpha_intra_s']:.2f} ms inside a node, a node's loopback moving "
                 f"{r0['host_Bps'] / 1e6:.0f} MB/s per rank (first rate's launch).")
    lines = [
        *heading("Hierarchical compressed all-reduce: flat group vs node_groups() on emulated nodes",
                 command_line(argv if argv is not None else None),
                 f". Run as root. {s.hosts} nodes x {L} ranks: each node a network namespace holding {L} workers "
                 f"(gloo on the node's address, so their traffic to each other stays on the node's loopback), "
                 f"the nodes on a bridge with tbf on both ends of every link (bucket {s.burst_ms:g} ms of the rate); "
                 f"{s.threads} torch thread(s) per worker, {s.hosts * L} workers sharing this machine's "
                 f"{os.cpu_count()} cores ({load})."
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
    ]
    return emulated.write_report("hierarchy", lines, table, "Against issue 40's targets (compression stage):",
                                 targets, args)


if __name__ == "__main__":
    sys.exit(main())
