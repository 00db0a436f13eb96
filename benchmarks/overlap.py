"""Overlap benchmark: the serial step against overlap_with_backward=True on emulated hosts.

    sudo .venv/bin/python -m benchmarks.overlap     # from the repository root; default: 2 hosts, 10M, 50M, 200M, 1G

In the serial step the optimizer exchanges (the warm-up's gradient average, after the freeze the
compressed all-reduce of the momentum) in ``step()``, after the whole backward, and the link idles
while the backward runs. With ``overlap_with_backward=True, bucket_cap_mb=...`` each bucket's
exchange starts on a thread as soon as the backward has produced its gradients. In one launch per
rate the netsim's BERT trains side by side, steps interleaved (an order drawn afresh each round,
each step after a barrier, ``benchmarks.netsim.worker.hierarchy_steps``): 1-bit LAMB over the
world group serial and overlapped, and each rank alone (the compute-only step); with
``--ranks-per-host`` above 1 also over ``node_groups(L)``, serial and overlapped. Writes the
"overlap" section of BENCHMARKS.md (step times, their per-step ratio, the ideal step
max(compute-only, wire time), the buckets started during the backward, each host's wire bytes,
the targets it was built for) and a plot of step time against the link rate. The runs are the hierarchy
benchmark's (``hierarchy.run_hierarchy`` with the modes flat, overlap and solo, summarised by
``hierarchy.summarise_hierarchy``); this module adds the table, the targets and the plot.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from benchmarks import emulated
from benchmarks.emulated import LABELS, kb, log_rate_axis, ms, rate_label, rate_x
from benchmarks.hierarchy import run_hierarchy, summarise_hierarchy
from benchmarks.report import command_line, heading

DEFAULT_PLOT = "docs/netsim_overlap.png"


def format_overlap_table(summary: dict) -> str:
    """Markdown: per link, optimizer and stage, the serial step beside the overlapped one, the
    compute-only step and the ideal (max of compute-only and wire time); the hierarchical pair
    too where it ran."""
    rows = [r for r in summary["rows"] if "overlap_s" in r]
    unit = "host" if summary.get("local_size", 1) == 1 else "node"
    hier = any("hier_overlap_s" in r for r in rows)
    head = ["link", "optimizer", "stage", "serial step ms (fwd+bwd / step())",
            "overlapped step ms (fwd+bwd / step())", "serial / overlapped, median (quartiles)", "compute-only ms",
            "ideal ms: max(compute-only, wire time)", "overlapped / ideal", "buckets started in the backward",
            f"wire KB/step per {unit}: serial / overlapped"]
    if hier:
        head += ["hier. serial ms", "hier. overlapped ms", "hier. serial / overlapped, median (quartiles)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]

    def ms_of(row, key):
        return ms(row[key]) if row.get(key) is not None else "-"

    def ratio(row, stem):
        return f"{row[stem + '_median']:.2f}x ({row[stem + '_q1']:.2f}-{row[stem + '_q3']:.2f})" \
            if f"{stem}_median" in row else "-"

    for r in rows:
        ideal = r.get("overlap_ideal_s")
        started = (f"{r['overlap_started']:.1f} of {r['overlap_buckets']}" if "overlap_started" in r else "-")
        cells = [rate_label(r["rate_bps"]), LABELS[r["optimizer"]], r["stage"],
                 f"{ms_of(r, 'flat_s')} ({ms_of(r, 'flat_backward_s')} / {ms_of(r, 'flat_opt_s')})",
                 f"{ms_of(r, 'overlap_s')} ({ms_of(r, 'overlap_backward_s')} / {ms_of(r, 'overlap_opt_s')})",
                 ratio(r, "overlap_ratio"), ms_of(r, "solo_s"),
                 f"{ms_of(r, 'overlap_ideal_s')}" + (f" ({ms_of(r, 'overlap_wire_s')} on the wire)"
                                                   if r.get("overlap_wire_s") else ""),
                 f"{r['overlap_s'] / ideal:.2f}x" if ideal else "-", started,
                 f"{kb(r.get('flat_wire_bytes'))} / {kb(r.get('overlap_wire_bytes'))}"]
        if hier:
            cells += [ms_of(r, "hier_s"), ms_of(r, "hier_overlap_s"), ratio(r, "hier_overlap_ratio")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def check_overlap_targets(summary: dict, close_rate: float = 1e9, close_target: float = 0.10,
                          wire_rate: float = 50e6, wire_target: float = 1.2) -> List[str]:
    """The targets for 1-bit LAMB's compression stage over the flat group, overlapped: at
    ``close_rate`` its step within ``close_target`` of the compute-only step; at ``wire_rate``
    within ``wire_target`` times max(compute-only step, wire time), the wire time being the host's
    measured wire bytes per step x 8 / the link rate (what the link needs whatever overlaps it)."""
    comp = {r["rate_bps"]: r for r in summary["rows"]
            if r["stage"] == "compression" and r["optimizer"] == "onebitlamb" and "overlap_s" in r}
    out = []
    r = comp.get(close_rate)
    if r is None or "solo_s" not in r:
        out.append(f"n/a    no compression-stage row with the overlapped and the compute-only step at "
                   f"{rate_label(close_rate)}")
    else:
        over = r["overlap_s"] / r["solo_s"] - 1.0
        out.append(f"{'met   ' if over <= close_target else 'MISSED'} overlapped compression step within "
                   f"{100 * close_target:.0f}% of compute-only at {rate_label(close_rate)}: {100 * over:+.0f}% "
                   f"({ms(r['overlap_s'])} vs {ms(r['solo_s'])} ms, median of {r['steps']} steps; serial "
                   f"{ms(r['flat_s'])} ms)")
    r = comp.get(wire_rate)
    if r is None or r.get("overlap_ideal_s") is None:
        out.append(f"n/a    no compression-stage row with the overlapped step, the compute-only step and wire "
                   f"bytes at {rate_label(wire_rate)}")
    else:
        x = r["overlap_s"] / r["overlap_ideal_s"]
        out.append(f"{'met   ' if x <= wire_target else 'MISSED'} overlapped compression step within "
                   f"{wire_target:g}x of max(compute-only, wire time) at {rate_label(wire_rate)}: {x:.2f}x "
                   f"({ms(r['overlap_s'])} ms vs max({ms(r['solo_s'])}, {ms(r['overlap_wire_s'])}) ms, the wire "
                   f"time from {kb(r['overlap_wire_bytes'])} KB per step; serial {ms(r['flat_s'])} ms)")
    return out


def plot_overlap(summary: dict, path) -> None:
    """Step time against the link rate: the serial step, the overlapped one and the compute-only
    one, warm-up and compression stage (the hierarchical pair too where it ran), and the ideal
    max(compute-only, wire time) of the overlapped compression step, dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r["optimizer"] == "onebitlamb"]
    x_of = rate_x(rows)
    L = summary.get("local_size", 1)
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    label = {"flat": "serial, flat group", "overlap": "overlapped, flat group",
             "hier": f"serial, node_groups({L})", "hier_overlap": f"overlapped, node_groups({L})"}
    color = {"flat": "C3", "overlap": "C2", "hier": "C0", "hier_overlap": "C4"}
    for stage, style in (("warmup", "s--"), ("compression", "o-")):
        pts = sorted(((x_of(r), r) for r in rows if r["stage"] == stage), key=lambda p: p[0])
        xs = [x for x, _ in pts]
        for k in label:
            if pts and all(f"{k}_s" in r for _, r in pts):
                ax.plot(xs, [1000 * r[f"{k}_s"] for _, r in pts], style, color=color[k], label=f"{label[k]}, {stage}")
        if stage == "compression" and pts and all("solo_s" in r for _, r in pts):
            ax.plot(xs, [1000 * r["solo_s"] for _, r in pts], "x-", color="grey", lw=0.8,
                    label="compute-only, compression")
        if stage == "compression" and pts and all(r.get("overlap_ideal_s") for _, r in pts):
            ax.plot(xs, [1000 * r["overlap_ideal_s"] for _, r in pts], ":", color="black", alpha=0.6,
                    label="max(compute-only, wire time), compression")
    log_rate_axis(ax, rows, "link rate per host" if L == 1 else "link rate between nodes")
    ax.set_ylabel("step ms (median of the slowest rank)")
    nodes = rows[0]["nodes"] if rows else 0
    cap = summary.get("bucket_cap_mb")
    ax.set_title(f"{nodes} emulated {'hosts' if L == 1 else f'nodes x {L} ranks'}, 1-bit LAMB, small BERT "
                 f"({summary['params'] / 1e6:.2f}M parameters): serial vs overlap_with_backward"
                 + (f"({cap:g})" if cap else "()"), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        "benchmarks.overlap", args, lambda: run_hierarchy(
            s, L, log=emulated.log, modes=modes, bucket_cap_mb=args.bucket_cap_mb),
        summarise_hierarchy, format_overlap_table, check_overlap_targets,
        plot_overlap)
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
    title = "Against the targets it was built for (1-bit LAMB's compression stage, flat group):"
    return emulated.write_report("overlap", lines, table, title, targets, args)


if __name__ == "__main__":
    sys.exit(main())
