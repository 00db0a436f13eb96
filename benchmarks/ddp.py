"""DDP benchmark: plain usage against DistributedDataParallel + register_ddp on emulated hosts.

    sudo .venv/bin/python -m benchmarks.ddp      # from the repository root; default: 4 hosts, 50M, 200M, 1G

Plain usage: an unwrapped model, the optimizer all-reduces the flat gradient inside ``step()``,
after the backward. DDP + ``onebitlamb.register_ddp``: DDP's bucketed all-reduce averages the
warm-up's gradients behind the backward, and sends nothing once the optimizer compresses. Both
train the netsim's BERT in one launch per link rate, their steps interleaved (an order drawn
afresh each round, each step after a barrier, ``benchmarks.netsim.worker.ddp_steps``), through
the warm-up and the compression stage. Writes the "ddp" section of BENCHMARKS.md: step times of
both, the per-step ratio, the bytes the optimizer's ``comm_stats`` accounted (in the backward,
DDP's, and in ``step()``) and the bytes each host's interface counted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import List, Optional, Sequence

from benchmarks import emulated
from benchmarks.emulated import LABELS, Settings, kb, mean, ms, rate_label, slowest
from benchmarks.netsim.runner import run_workers
from benchmarks.netsim.topology import Network
from benchmarks.report import command_line, heading


def run_ddp(s: Settings, bucket_cap_mb: Optional[float] = None, log=print) -> dict:
    """Per rate, one launch on ``s.hosts`` emulated hosts running ``worker.ddp_steps``: the plain
    usage's steps and DDP + ``register_ddp``'s, interleaved, through both stages."""
    out: dict = {"settings": {**s.__dict__, "rates": list(s.rates), "optimizers": list(s.optimizers),
                              "bucket_cap_mb": bucket_cap_mb}, "rates": []}
    t0 = time.monotonic()
    spec = dict(s.spec(), ddp=True)
    if bucket_cap_mb is not None:
        spec["bucket_cap_mb"] = bucket_cap_mb
    for rate in s.rates:
        log(f"[netsim ddp] {rate_label(rate)}: plain vs DDP + register_ddp, {', '.join(s.optimizers)} "
            f"({time.monotonic() - t0:.0f}s so far)")
        with Network(s.hosts, rate, burst_ms=s.burst_ms) as net:
            ranks = run_workers(net, spec, timeout_s=s.timeout_s)
            out["rates"].append({"rate_bps": rate, "tbf": net.tbf, "qdisc_drops": net.qdisc_drops(),
                                 "ranks": [r["ddp"] for r in ranks]})
    out["elapsed_s"] = time.monotonic() - t0
    return out


def summarise_ddp_rate(per_rank: List[dict], rate_bps: Optional[float] = None) -> List[dict]:
    """One row per optimizer and stage from ``worker.ddp_steps``' per-rank results: median step
    times of both usages (each step's slowest rank), the median over steps of plain / DDP with its
    quartiles, and the bytes per step (accounted: rank 0's, in the backward and in ``step()``;
    wire: the mean over ranks)."""
    rows = []
    first = per_rank[0]["steps"]
    for name in first:
        for stage in ("warmup", "compression"):
            if stage not in first[name].get("plain", {}):
                continue
            plain = [r["steps"][name]["plain"][stage] for r in per_rank]
            ddp = [r["steps"][name]["ddp"][stage] for r in per_rank]
            p_t, d_t = slowest(plain, "step_times"), slowest(ddp, "step_times")
            ratios = sorted(a / b for a, b in zip(p_t, d_t))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3

            def wire(recs):
                vals = [w for rec in recs for w in rec["wire_bytes"] if w is not None]
                return mean(vals) if vals else None

            rows.append({
                "rate_bps": rate_bps, "optimizer": name, "stage": stage, "steps": len(ratios),
                "plain_s": statistics.median(p_t), "ddp_s": statistics.median(d_t),
                "plain_backward_s": statistics.median(slowest(plain, "backward_times")),
                "ddp_backward_s": statistics.median(slowest(ddp, "backward_times")),
                "plain_opt_s": statistics.median(slowest(plain, "opt_step_times")),
                "ddp_opt_s": statistics.median(slowest(ddp, "opt_step_times")),
                "ratio_median": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
                "ddp_faster_share": sum(x > 1 for x in ratios) / len(ratios),
                "ddp_buckets": statistics.median(ddp[0]["buckets"]),
                "plain_backward_bytes": mean(plain[0]["backward_bytes"]),
                "plain_step_bytes": mean(plain[0]["opt_step_bytes"]),
                "ddp_backward_bytes": mean(ddp[0]["backward_bytes"]),
                "ddp_step_bytes": mean(ddp[0]["opt_step_bytes"]),
                "plain_wire_bytes": wire(plain), "ddp_wire_bytes": wire(ddp),
            })
    return rows


def summarise_ddp(raw: dict) -> dict:
    rows = []
    for entry in raw["rates"]:
        rows += summarise_ddp_rate(entry["ranks"], entry["rate_bps"])
    return {"params": raw["rates"][0]["ranks"][0]["params"] if raw["rates"] else 0, "rows": rows,
            "qdisc_drops": {rate_label(e["rate_bps"]): e["qdisc_drops"] for e in raw["rates"]}}


def format_ddp_table(summary: dict) -> str:
    """Markdown: per link, optimizer and stage, plain beside DDP + register_ddp."""
    lines = ["| link | optimizer | stage | plain step ms (fwd+bwd / step()) | DDP step ms (fwd+bwd / step()) "
             "| plain / DDP, median (quartiles) | steps DDP faster | DDP buckets "
             "| accounted KB/step plain (bwd / step()) | accounted KB/step DDP (bwd / step()) "
             "| wire KB/step plain | wire KB/step DDP |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    for r in summary["rows"]:
        lines.append(
            f"| {rate_label(r['rate_bps'])} | {LABELS[r['optimizer']]} | {r['stage']} "
            f"| {ms(r['plain_s'])} ({ms(r['plain_backward_s'])} / {ms(r['plain_opt_s'])}) "
            f"| {ms(r['ddp_s'])} ({ms(r['ddp_backward_s'])} / {ms(r['ddp_opt_s'])}) "
            f"| {r['ratio_median']:.3f}x ({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}) "
            f"| {100 * r['ddp_faster_share']:.0f}% of {r['steps']} | {r['ddp_buckets']:g} "
            f"| {kb(r['plain_backward_bytes'] + r['plain_step_bytes'])} ({kb(r['plain_backward_bytes'])} / "
            f"{kb(r['plain_step_bytes'])}) "
            f"| {kb(r['ddp_backward_bytes'] + r['ddp_step_bytes'])} ({kb(r['ddp_backward_bytes'])} / "
            f"{kb(r['ddp_step_bytes'])}) "
            f"| {kb(r['plain_wire_bytes'])} | {kb(r['ddp_wire_bytes'])} |")
    return "\n".join(lines)





def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4, help="emulated hosts, one worker each (default %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: DDP's own, 25 MB after a 1 MB first bucket)")
    emulated.add_run_options(parser, rates="50M,200M,1G", warmup_steps=8, compression_steps=8, per="host",
                             runs="usage")
    args = parser.parse_args(argv)
    if args.hosts < 2:
        parser.error("--hosts must be >= 2")
    s = emulated.settings(parser, args, args.hosts)
    if emulated.unavailable("benchmarks.ddp", "hosts"):
        return 3
    done = emulated.run_unwinding("benchmarks.ddp", lambda: run_ddp(s, args.bucket_cap_mb,
                                                                                 log=emulated.log))
    if done is None:
        return 130
    raw, load = done
    summary = summarise_ddp(raw)
    table = format_ddp_table(summary)
    print(table)
    if args.no_write:
        return 0
    emulated.save_raw(args.raw, raw, summary)
    m = s.model
    cap = "DDP's default buckets" if args.bucket_cap_mb is None else f"bucket_cap_mb={args.bucket_cap_mb:g}"
    lines = [
        *heading("DDP: plain usage vs DistributedDataParallel + register_ddp on emulated hosts",
                 command_line(argv if argv is not None else None),
                 f". Run as root. {s.hosts} hosts (network namespaces on a bridge, tbf on both ends of every link, bucket "
                 f"{s.burst_ms:g} ms of the rate), one worker each with {s.threads} torch thread(s), gloo, all "
                 f"sharing this machine's {os.cpu_count()} cores with other work ({load})."),
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
    ]
    return emulated.write_report("ddp", lines, table, None, [], args)


if __name__ == "__main__":
    sys.exit(main())
