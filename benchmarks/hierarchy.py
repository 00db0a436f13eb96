"""Hierarchy benchmark: the flat group against node_groups() on emulated nodes of several ranks.

    sudo .venv/bin/python -m benchmarks.hierarchy     # from the repository root; default: 2 nodes x 2 ranks, 10M, 50M, 100M, 1G

Each node is a network namespace holding ``--ranks-per-node`` workers, which reach each other over
the node's loopback (fast, unshaped, uncounted); the nodes are joined by links shaped with tbf.
In one launch per rate the netsim's BERT trains three times side by side, steps interleaved (an
order drawn afresh each round, each step after a barrier, ``benchmarks.netsim.worker.hierarchy_steps``):
1-bit LAMB over the flat world group, over ``onebitlamb.comm.node_groups(L)`` (the hierarchical
all-reduce), and each rank alone (the compute-only step), through the warm-up and the compression
stage. Writes the "hierarchy" section of BENCHMARKS.md (step times, their per-step ratio, each
node's wire bytes from its interface's kernel counter, the bytes ``comm_stats`` accounted, the
cost model's prediction) and a plot of bytes and step time against the inter-node rate.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import List, Optional, Sequence

from benchmarks import emulated
from benchmarks.emulated import LABELS, Settings, kb, log_rate_axis, mean, ms, quartiles, rate_label, rate_x, slowest
from benchmarks.netsim.runner import run_workers
from benchmarks.netsim.topology import Network
from benchmarks.report import command_line, heading
from onebitlamb.comm import costmodel

DEFAULT_PLOT = "docs/netsim_hierarchy.png"


def run_hierarchy(s: Settings, local_size: int, log=print, modes: Optional[Sequence[str]] = None,
                  bucket_cap_mb: Optional[float] = None) -> dict:
    """Per rate, one launch on ``s.hosts`` emulated nodes of ``local_size`` workers each (the
    workers of a node share its namespace and talk over its loopback; only the links between
    nodes are shaped) running ``worker.hierarchy_steps``: the steps of each of ``modes`` (default
    the worker's: the flat group's, the hierarchical group's and the compute-only ones; the
    overlapped ones with buckets of ``bucket_cap_mb``, default the worker's), interleaved, through
    both stages. The launcher also reads each node's interface counters before and after the
    launch."""
    out: dict = {"settings": {**s.__dict__, "rates": list(s.rates), "optimizers": list(s.optimizers),
                              "local_size": local_size, "modes": None if modes is None else list(modes),
                              "bucket_cap_mb": bucket_cap_mb}, "rates": []}
    t0 = time.monotonic()
    spec = dict(s.spec(), hierarchy=True, local_size=local_size)
    if modes is not None:
        spec["modes"] = list(modes)
    if bucket_cap_mb is not None:
        spec["bucket_cap_mb"] = bucket_cap_mb
    what = ", ".join(modes) if modes is not None else f"flat vs node_groups({local_size})"
    for rate in s.rates:
        log(f"[netsim hierarchy] {rate_label(rate)}: {s.hosts} nodes x {local_size} ranks, {what}, "
            f"{', '.join(s.optimizers)} ({time.monotonic() - t0:.0f}s so far)")
        with Network(s.hosts, rate, burst_ms=s.burst_ms, ranks_per_host=local_size) as net:
            before = [net.counters(i) for i in range(s.hosts)]
            ranks = run_workers(net, spec, timeout_s=s.timeout_s)
            after = [net.counters(i) for i in range(s.hosts)]
            out["rates"].append({"rate_bps": rate, "tbf": net.tbf, "qdisc_drops": net.qdisc_drops(),
                                 "launch_tx_bytes": [(a - b).tx_bytes for a, b in zip(after, before)],
                                 "ranks": [r["hierarchy"] for r in ranks]})
    out["elapsed_s"] = time.monotonic() - t0
    return out


#: The per-step ratios ``summarise_hierarchy_rate`` forms when both modes ran: the row keys'
#: stem, numerator mode over denominator mode (above 1: the second faster), and the key of the
#: share of steps where the second was faster.
HIERARCHY_RATIOS = (("ratio", "flat", "hier", "hier_faster_share"),
                    ("overlap_ratio", "flat", "overlap", "overlap_faster_share"),
                    ("hier_overlap_ratio", "hier", "hier-overlap", "hier_overlap_faster_share"))


def mode_key(mode: str) -> str:
    """The stem of a mode's row keys: ``hier-overlap`` -> ``hier_overlap`` (``hier_overlap_s``)."""
    return mode.replace("-", "_")


def summarise_hierarchy_rate(per_rank: List[dict], rate_bps: Optional[float] = None) -> List[dict]:
    """One row per optimizer and stage from ``worker.hierarchy_steps``' per-rank results, with
    the figures of every mode that ran (keys ``<mode>_...``, ``mode_key``).

    Step times: per step the slowest rank (a synchronous step costs its last rank's time), median
    over steps; the ratios of ``HIERARCHY_RATIOS`` (``ratio``: flat over hierarchical,
    ``overlap_ratio``: flat over overlapped, ``hier_overlap_ratio``: hierarchical over
    hierarchical overlapped), per step, median and quartiles, where both modes ran. Buckets
    started during the backward: mean over ranks and steps, beside the buckets there are. Bytes
    per step: accounted (``comm_stats``) per rank, split into the node stages (``INTRA_OPS``) and
    the rest, and summed over a node's ranks for the bytes a node sends beyond the node stages;
    wire: the node's interface counter (read by each of its ranks, so taken from its local rank
    0), mean over nodes and steps, and the time it takes at the link rate (``<mode>_wire_s``).
    ``<mode>_ideal_s``: max(compute-only step, that wire time), the step of perfect overlap. With no
    interface (loopback) the wire bytes are None.
    """
    first = per_rank[0]["steps"]
    L = per_rank[0]["local_size"]
    nodes = len(per_rank) // L
    rows = []
    for name in first:
        for stage in ("warmup", "compression"):
            modes = [mode for mode, by_stage in first[name].items() if stage in by_stage]
            if not modes:
                continue
            row = {"rate_bps": rate_bps, "optimizer": name, "stage": stage, "local_size": L, "nodes": nodes}
            for mode in modes:
                k = mode_key(mode)
                recs = [r["steps"][name][mode][stage] for r in per_rank]
                t = slowest(recs, "step_times")
                row[f"{k}_times"] = t
                row[f"{k}_s"] = statistics.median(t)
                row[f"{k}_opt_s"] = statistics.median(slowest(recs, "opt_step_times"))
                row[f"{k}_backward_s"] = statistics.median(slowest(recs, "backward_times"))
                if "started_in_backward" in recs[0]:  # not in results from before overlap_with_backward
                    row[f"{k}_started"] = mean(x for rec in recs for x in rec["started_in_backward"])
                    row[f"{k}_buckets"] = max(x for rec in recs for x in rec["buckets"])
                rank_bytes = [mean(rec["bytes"]) for rec in recs]
                rank_intra = [mean(rec["intra_bytes"]) for rec in recs]
                row[f"{k}_rank_bytes"] = mean(rank_bytes)
                row[f"{k}_rank_intra_bytes"] = mean(rank_intra)
                # what a node's ranks together accounted outside the node stages
                row[f"{k}_node_bytes"] = mean(
                    sum(rank_bytes[j * L + i] - rank_intra[j * L + i] for i in range(L)) for j in range(nodes))
                wires = [w for j in range(nodes) for w in recs[j * L]["wire_bytes"] if w is not None]
                row[f"{k}_wire_bytes"] = mean(wires) if wires else None
            for k in [mode_key(m) for m in modes if m != "solo"]:
                wire = row[f"{k}_wire_bytes"]
                # unshaped: no wire time to wait for; on loopback (no counter) it is unknown
                row[f"{k}_wire_s"] = 0.0 if rate_bps is None else (None if wire is None else 8 * wire / rate_bps)
                if "solo_s" in row and row[f"{k}_wire_s"] is not None:
                    row[f"{k}_ideal_s"] = max(row["solo_s"], row[f"{k}_wire_s"])
            for stem, num, den, faster in HIERARCHY_RATIOS:
                if num not in modes or den not in modes:
                    continue
                ratios = [a / b for a, b in zip(row[f"{mode_key(num)}_times"], row[f"{mode_key(den)}_times"])]
                q = quartiles(ratios)
                row.update({f"{stem}_median": statistics.median(ratios), f"{stem}_q1": q[0], f"{stem}_q3": q[2],
                            faster: sum(x > 1 for x in ratios) / len(ratios)})
            row["steps"] = len(row[f"{mode_key(modes[0])}_times"])
            rows.append(row)
    return rows


def predict_hierarchy_rows(rows: List[dict], probes: List[dict], params: int) -> None:
    """Set the cost model's ``flat_pred_s`` / ``hier_pred_s`` in each row (``costmodel.predict_node_step``):
    the compute-only step measured in the same rounds, alpha across nodes and inside the node
    (the ranks' medians, averaged), the node's byte rate from the timed node all-to-all, and the
    link's rate. The 1-bit codec's local work is not modelled (about 2 ms at this size)."""
    if not rows or "solo_s" not in rows[0]:
        return
    alpha = mean(p["alpha_inter_s"] for p in probes)
    alpha_intra = mean(p["alpha_intra_s"] for p in probes)
    # the timed all-to-all less its latency (but at least half its time: at small sizes the two
    # are of one order and their difference is noise)
    a2a = [p["intra_all_to_all_bytes"] / max(p["intra_all_to_all_s"] - p["alpha_intra_s"], p["intra_all_to_all_s"] / 2)
           for p in probes if "intra_all_to_all_s" in p]
    host_Bps = mean(a2a) if a2a else math.inf
    for row in rows:
        link = costmodel.Link(row["rate_bps"], alpha, host_Bps=host_Bps)
        colls = costmodel.node_onebit_collectives if row["stage"] == "compression" else costmodel.node_warmup_collectives
        for mode, hier in (("flat", False), ("hier", True)):
            c = colls(params, row["nodes"], row["local_size"], hier)
            row[f"{mode}_pred_s"] = costmodel.predict_node_step(row["solo_s"], c, link, alpha_intra)
            row[f"{mode}_pred_node_bytes"] = sum(x.node_bytes for x in c)
        row.update(alpha_s=alpha, alpha_intra_s=alpha_intra, host_Bps=host_Bps)


def summarise_hierarchy(raw: dict) -> dict:
    rows = []
    for entry in raw["rates"]:
        ranks = entry["ranks"]
        rate_rows = summarise_hierarchy_rate(ranks, entry["rate_bps"])
        predict_hierarchy_rows(rate_rows, [r["probe"] for r in ranks], ranks[0]["params"])
        for row in rate_rows:
            row["launch_tx_bytes"] = entry.get("launch_tx_bytes")
            row["qdisc_drops"] = entry.get("qdisc_drops")
        rows += rate_rows
    first = raw["rates"][0]["ranks"][0] if raw["rates"] else {}
    return {"params": first.get("params", 0), "local_size": first.get("local_size", 1), "rows": rows,
            "bucket_cap_mb": raw.get("settings", {}).get("bucket_cap_mb"),
            "qdisc_drops": {rate_label(e["rate_bps"]): e["qdisc_drops"] for e in raw["rates"]}}


def format_hierarchy_table(summary: dict) -> str:
    """Markdown: per link, optimizer and stage, the flat group beside node_groups()."""
    lines = ["| link | optimizer | stage | flat step ms (pred.) | hierarchical step ms (pred.) "
             "| flat / hier., median (quartiles) | compute-only ms | wire KB/step per node: flat / hier. (ratio) "
             "| accounted KB/step per node beyond it: flat / hier. | accounted KB/step per rank: flat / hier. (node stages) "
             "| optimizer.step() ms: flat / hier. / alone |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def pred(row, mode):
        return f" ({ms(row[mode + '_pred_s'])})" if f"{mode}_pred_s" in row else ""

    for r in summary["rows"]:
        fw, hw = r.get("flat_wire_bytes"), r.get("hier_wire_bytes")
        wire = f"{kb(fw)} / {kb(hw)}" + (f" ({fw / hw:.2f}x)" if fw and hw else "")
        lines.append(
            f"| {rate_label(r['rate_bps'])} | {LABELS[r['optimizer']]} | {r['stage']} "
            f"| {ms(r['flat_s'])}{pred(r, 'flat')} | {ms(r['hier_s'])}{pred(r, 'hier')} "
            f"| {r['ratio_median']:.2f}x ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}) "
            f"| {ms(r['solo_s']) if 'solo_s' in r else '-'} | {wire} "
            f"| {kb(r['flat_node_bytes'])} / {kb(r['hier_node_bytes'])} "
            f"| {kb(r['flat_rank_bytes'])} / {kb(r['hier_rank_bytes'])} ({kb(r['hier_rank_intra_bytes'])}) "
            f"| {ms(r['flat_opt_s'])} / {ms(r['hier_opt_s'])} / {ms(r['solo_opt_s']) if 'solo_opt_s' in r else '-'} |")
    return "\n".join(lines)


def check_hierarchy_targets(summary: dict, speed_rate: float = 100e6, speed_target: float = 1.8) -> List[str]:
    """The targets it was built for: in the compression stage a node's wire bytes across nodes at least
    ``L`` times fewer than the flat group's, at every rate; at ``speed_rate`` the compression step
    at least ``speed_target`` times faster."""
    L = summary["local_size"]
    out = []
    comp = [r for r in summary["rows"] if r["stage"] == "compression" and r["optimizer"] == "onebitlamb"]
    for r in comp:
        fw, hw = r.get("flat_wire_bytes"), r.get("hier_wire_bytes")
        if fw is None or not hw:
            continue
        ok = fw / hw >= L
        expected = (f"; the byte formulas of gloo's collectives give {r['flat_pred_node_bytes'] / r['hier_pred_node_bytes']:.2f}x"
                    if r.get("hier_pred_node_bytes") else "")
        out.append(f"{'met   ' if ok else 'MISSED'} inter-node wire bytes per node >= {L}x fewer at "
                   f"{rate_label(r['rate_bps'])}: {fw / hw:.2f}x ({kb(fw)} KB vs {kb(hw)} KB per step{expected})")
    for r in comp:
        if r["rate_bps"] == speed_rate:
            ok = r["ratio_median"] >= speed_target
            out.append(f"{'met   ' if ok else 'MISSED'} compression step >= {speed_target}x faster than flat at "
                       f"{rate_label(speed_rate)}: {r['ratio_median']:.2f}x (median of {r['steps']} steps; "
                       f"{ms(r['flat_s'])} vs {ms(r['hier_s'])} ms, compute-only {ms(r.get('solo_s', math.nan))} ms)")
    if not any(r["rate_bps"] == speed_rate for r in comp):
        out.append(f"n/a    no compression-stage row at {rate_label(speed_rate)}")
    return out


def plot_hierarchy(summary: dict, path) -> None:
    """Two panels against the inter-node rate: a node's wire bytes per step and the step time,
    flat vs hierarchical, warm-up and compression stage (the cost model's steps dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r["optimizer"] == "onebitlamb"]
    x_of = rate_x(rows)
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4.6))
    styles = {("flat", "warmup"): ("C3", "s--"), ("hier", "warmup"): ("C0", "s--"),
              ("flat", "compression"): ("C3", "o-"), ("hier", "compression"): ("C0", "o-")}
    label = {"flat": "flat group", "hier": f"node_groups({summary['local_size']})"}
    for (mode, stage), (color, style) in styles.items():
        pts = sorted(((x_of(r), r) for r in rows if r["stage"] == stage), key=lambda p: p[0])
        if not pts:
            continue
        xs = [x for x, _ in pts]
        wires = [r.get(f"{mode}_wire_bytes") for _, r in pts]
        if all(w is not None for w in wires):
            ax_b.plot(xs, [w / 1024 for w in wires], style, color=color, label=f"{label[mode]}, {stage}")
        if all(f"{mode}_pred_node_bytes" in r for _, r in pts):
            ax_b.plot(xs, [costmodel.WIRE_OVERHEAD * r[f"{mode}_pred_node_bytes"] / 1024 for _, r in pts], ":",
                      color=color, alpha=0.6)
        ax_t.plot(xs, [1000 * r[f"{mode}_s"] for _, r in pts], style, color=color, label=f"{label[mode]}, {stage}")
        if all(f"{mode}_pred_s" in r for _, r in pts):
            ax_t.plot(xs, [1000 * r[f"{mode}_pred_s"] for _, r in pts], ":", color=color, alpha=0.6)
    comp = sorted(((x_of(r), r) for r in rows if r["stage"] == "compression"), key=lambda p: p[0])
    if comp and "solo_s" in comp[0][1]:
        ax_t.plot([x for x, _ in comp], [1000 * r["solo_s"] for _, r in comp], "x-", color="grey", lw=0.8,
                  label="compute-only, compression")
    for ax in (ax_b, ax_t):
        log_rate_axis(ax, rows, "link rate between nodes")
    ax_b.set_ylabel("KB per step leaving one node (its tx_bytes)")
    ax_b.set_title("wire bytes across nodes (dotted: byte formulas x frame overhead)", fontsize=9)
    ax_t.set_ylabel("step ms (median of the slowest rank)")
    ax_t.set_title("step time (dotted: cost model)", fontsize=9)
    nodes = rows[0]["nodes"] if rows else 0
    fig.suptitle(f"{nodes} emulated nodes x {summary['local_size']} ranks, 1-bit LAMB, small BERT "
                 f"({summary['params'] / 1e6:.2f}M parameters): flat group vs node_groups({summary['local_size']})",
                 fontsize=10)
    ax_b.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)




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
        "benchmarks.hierarchy", args, lambda: run_hierarchy(s, L, log=emulated.log),
        summarise_hierarchy, format_hierarchy_table, check_hierarchy_targets,
        plot_hierarchy)
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
    return emulated.write_report("hierarchy", lines, table, "Against the targets it was built for (compression stage):",
                                 targets, args)


if __name__ == "__main__":
    sys.exit(main())
