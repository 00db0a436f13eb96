"""Network benchmark: LAMB, 1-bit LAMB (float32 or int8 warm-up), 1-bit Adam, 0/1 Adam and DiLoCo pretraining a small BERT on emulated hosts.

    sudo .venv/bin/python -m benchmarks.network      # from the repository root; default: 2 hosts, 10 Mbit/s..1 Gbit/s + unshaped
    sudo .venv/bin/python -m benchmarks.network --rates 10Mbit/s,1Gbit/s --hosts 4 --no-write   # print the tables only
    sudo .venv/bin/python -m benchmarks.network --cleanup   # remove namespaces a kill -9 left

Every host is a network namespace on a bridge, every link shaped by a token bucket (see
``benchmarks.netsim``). One unshaped launch first measures what does not depend on the rate: the
latency of a tiny collective, the hosts' own byte rate and the 1-bit codec's cost. Then one
launch per rate trains every optimizer through each kind of step it takes, each right after the
same steps with no communication (all hosts computing at once, as they share the CPUs): the
compute-only time the cost model (``onebitlamb.comm.costmodel``) starts from, measured minutes
apart from the step it predicts on a machine whose load varies. For each rate: step time in the
warm-up and in the compression stage (and 0/1 Adam's and DiLoCo's local steps and syncs), LAMB's share of a
step spent communicating, the compression-stage and end-to-end speed-up, the bytes each host's
interface counted per step, and the cost model's prediction beside every measured step. Then
the whole run: the main job's demo run (``--schedules``: each optimizer's steps by kind, as its
run of the convergence benchmark took them) timed at each rate, every step at the measured time
of its kind. Last, on plain loopback, LAMB's and the 1-bit steps interleaved in one launch.
Writes the "network" section of BENCHMARKS.md, a PNG of speed-up against link rate and the raw
results (JSON) next to it.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from benchmarks import diloco, emulated
from benchmarks.convergence import ROWS as CONVERGENCE_ROWS
from benchmarks.emulated import Settings, kb, mean, ms, parse_rates, quartiles, rate_label, slowest
from benchmarks.netsim.runner import run_workers
from benchmarks.netsim.worker import COMPRESSION, KINDS, LOCAL, SYNC, WARMUP
from benchmarks.netsim.topology import Network, cleanup_stale
from benchmarks.report import command_line, machine_line, write_section
from benchmarks.variants import DEFAULT, with_warmup
from onebitlamb.comm import costmodel

DOCS = Path(__file__).resolve().parents[1] / "docs"
# the optimizers this benchmark times, in the order of the tables
NETWORK_OPTIMIZERS = ("lamb", "onebitlamb", "onebitlamb-int8", "onebitadam", "zerooneadam", "diloco")
LABELS = {**emulated.LABELS, "onebitlamb-int8": "1-bit LAMB, int8 warm-up", "diloco": "DiLoCo"}
# the kinds of step an optimizer takes exactly as another does, timed once in that one's row
# (``worker.timed_kinds``): after its freeze 1-bit LAMB with the int8 warm-up compresses as 1-bit LAMB
SAME_STEPS = {("onebitlamb-int8", COMPRESSION): "onebitlamb"}
DILOCO_H = 16  # the DiLoCo run whose schedule the whole-run table times (``benchmarks.diloco``)
PAIRED = ("lamb", "onebitlamb", "onebitadam")  # the interleaved loopback steps: LAMB against the compression stage
SCHEDULES = os.path.join("runs", "convergence", "demo", "1234")  # the convergence benchmark's demo runs


def run_experiment(s: Settings, log=print) -> dict:
    """Measure everything; returns the raw per-rank results (JSON-serialisable)."""
    out: dict = {"settings": {**s.__dict__, "rates": list(s.rates), "optimizers": list(s.optimizers)},
                 "rates": []}
    t0 = time.monotonic()
    log(f"[netsim] calibration on {s.hosts} unshaped hosts: alpha, host byte rate, codec")
    with Network(s.hosts, None, burst_ms=s.burst_ms) as net:
        out["baseline"] = run_workers(net, dict(s.spec(), probe={"latency_calls": 30, "bandwidth_calls": 5}),
                                      timeout_s=s.timeout_s)
    for rate in s.rates:
        log(f"[netsim] {rate_label(rate)}: {', '.join(s.optimizers)}  ({time.monotonic() - t0:.0f}s so far)")
        with Network(s.hosts, rate, burst_ms=s.burst_ms) as net:
            before = [net.counters(i) for i in range(s.hosts)]
            ranks = run_workers(net, dict(s.spec(), train=True, probe={"latency_calls": 30}),
                                timeout_s=s.timeout_s)
            after = [net.counters(i) for i in range(s.hosts)]
            out["rates"].append({"rate_bps": rate, "tbf": net.tbf, "ranks": ranks,
                                 "qdisc_drops": net.qdisc_drops(),
                                 "launch_tx_bytes": [(a - b).tx_bytes for a, b in zip(after, before)]})
    if s.paired_rounds:
        log(f"[netsim] loopback, interleaved: {s.paired_rounds} rounds of one step per optimizer")
        out["paired"] = run_paired(s)
    out["elapsed_s"] = time.monotonic() - t0
    return out


def run_paired(s: Settings) -> List[dict]:
    """Per rank: LAMB's and the 1-bit optimizers' compression-stage steps, interleaved on loopback
    (``worker.paired_steps``)."""
    from onebitlamb.comm.launch import spawn_local
    from benchmarks.netsim.worker import paired_steps

    spec = dict(s.spec(), rounds=s.paired_rounds)
    spec["optimizers"] = [name for name in spec["optimizers"] if name in PAIRED]
    return spawn_local(paired_steps, s.hosts, (spec,), timeout_s=s.timeout_s,
                       threads_per_worker=s.threads)


def summarise_paired(per_rank: List[dict]) -> List[dict]:
    """Per 1-bit optimizer: the median over rounds of LAMB's step time over its own (a step costs
    what its slowest rank spends), with the quartiles of that ratio and the median times."""
    times = [r["step_times"] for r in per_rank]
    opt_times = [r["opt_step_times"] for r in per_rank]
    lamb = slowest(times, "lamb")
    out = []
    for name in per_rank[0]["step_times"]:
        if name == "lamb":
            continue
        onebit = slowest(times, name)
        ratios = sorted(a / b for a, b in zip(lamb, onebit))
        q = quartiles(ratios)
        out.append({"optimizer": name, "rounds": len(ratios), "lamb_s": statistics.median(lamb),
                    "onebit_s": statistics.median(onebit),
                    "lamb_opt_s": statistics.median(slowest(opt_times, "lamb")),
                    "onebit_opt_s": statistics.median(slowest(opt_times, name)),
                    "speedup_median": statistics.median(ratios),
                    "speedup_q1": q[0], "speedup_q3": q[2],
                    "faster_share": sum(r > 1 for r in ratios) / len(ratios),
                    "lamb_bytes": per_rank[0]["step_bytes"]["lamb"],
                    "onebit_bytes": per_rank[0]["step_bytes"][name]})
    return out


def synchronous_compute_s(per_rank_times: List[List[float]]) -> float:
    """Compute-only time of a synchronous step: the median over steps of the slowest rank.

    Every collective waits for the last rank to arrive, so when the ranks' compute times vary
    (two workers and whatever else runs on shared cores) a step costs the maximum over ranks,
    which is more than any one rank's median.
    """
    steps = min(len(t) for t in per_rank_times)
    return statistics.median(max(t[i] for t in per_rank_times) for i in range(steps))


def summarise(raw: dict) -> dict:
    """Rows of measured and predicted figures, and the rate-independent calibration."""
    s = raw["settings"]
    n = s["hosts"]
    base = raw["baseline"]
    d = base[0]["probe"]["params"]
    alpha_unl = mean(r["probe"]["alpha_s"] for r in base)
    ar_s = mean(r["probe"]["allreduce_s"] for r in base)
    car_s = mean(r["probe"]["compressed_s"] for r in base)
    lamb_bytes = costmodel.lamb_collectives(d, n)
    onebit_bytes = costmodel.onebit_collectives(d, n)
    host_Bps = sum(lamb_bytes) / max(ar_s - alpha_unl, 1e-6)
    codec_s = max(0.0, car_s - len(onebit_bytes) * alpha_unl - sum(onebit_bytes) / host_Bps)
    calib = {"params": d, "hosts": n, "alpha_unshaped_s": alpha_unl,
             "allreduce_unshaped_s": ar_s, "compressed_unshaped_s": car_s, "host_Bps": host_Bps,
             "codec_s": codec_s, "lamb_bytes": lamb_bytes, "onebit_bytes": onebit_bytes}
    rows = []
    for entry in raw["rates"]:
        rate = entry["rate_bps"]
        ranks = entry["ranks"]
        alpha = mean(r["probe"]["alpha_s"] for r in ranks)
        link = costmodel.Link(rate, alpha, host_Bps=host_Bps)
        for name in ranks[0]["train"]:
            for stage in KINDS:
                if stage not in ranks[0]["train"][name]:
                    continue
                per = [r["train"][name][stage] for r in ranks]
                measured = mean(p["median_s"] for p in per)
                comp = synchronous_compute_s([r["compute_only"][name][stage]["step_times"] for r in ranks])
                collectives, onebit = step_collectives(name, stage, d, n)
                predicted = costmodel.predict_step(comp, collectives, link, codec_s if onebit else 0.0)
                rows.append({
                    "rate_bps": rate, "optimizer": name, "stage": stage, "measured_s": measured,
                    "predicted_s": predicted, "compute_s": comp, "alpha_s": alpha,
                    "comm_fraction": costmodel.comm_fraction(measured, comp),
                    "wire_bytes": mean(p["wire_bytes_per_step"] for p in per),
                    "accounted_bytes": mean(p["accounted_bytes_per_step"] for p in per),
                    "spread_s": max(max(p["step_times"]) - min(p["step_times"]) for p in per),
                    "qdisc_drops": entry["qdisc_drops"],
                })
    return {"calibration": calib, "rows": rows, "summary": _speedups(rows, s["warmup_fraction"]),
            "paired": summarise_paired(raw["paired"]) if raw.get("paired") else []}


def step_collectives(name: str, kind: str, d: int, n: int):
    """The bytes one rank sends in each collective of optimizer ``name``'s step of ``kind`` (the
    cost model's), and whether the 1-bit codec runs in it."""
    flag = costmodel.finite_flag_collectives(n)
    if name == "diloco":  # a local step sends nothing; a sync averages the parameters' change in float32
        return ([] if kind == LOCAL else costmodel.lamb_collectives(d, n)), False
    if kind == LOCAL:  # 0/1 Adam's: only the agreed finite check
        return flag, False
    if kind in (COMPRESSION, SYNC):
        return costmodel.onebit_collectives(d, n) + flag, True
    return costmodel.warmup_collectives(d, n, "int8" if name == "onebitlamb-int8" else "float32"), False


def by_kind(rows: List[dict]) -> Dict[tuple, dict]:
    """The measured rows by (rate, optimizer, kind), with each kind of ``SAME_STEPS`` filled from
    the row that timed it."""
    by = {(r["rate_bps"], r["optimizer"], r["stage"]): r for r in rows}
    for (name, kind), source in SAME_STEPS.items():
        for rate in {r["rate_bps"] for r in rows if r["optimizer"] == name}:
            if (rate, source, kind) in by:
                by.setdefault((rate, name, kind), by[rate, source, kind])
    return by


def _speedups(rows: List[dict], w: float) -> List[dict]:
    by = by_kind(rows)
    rates = []
    for r in rows:
        if r["rate_bps"] not in rates:
            rates.append(r["rate_bps"])
    out = []
    for rate in rates:
        lamb = by.get((rate, "lamb", "warmup"))
        if lamb is None:
            continue
        for name in ("onebitlamb", "onebitlamb-int8", "onebitadam"):
            warm, comp = by.get((rate, name, "warmup")), by.get((rate, name, "compression"))
            if warm is None or comp is None:
                continue
            out.append({
                "rate_bps": rate, "optimizer": name, "lamb_s": lamb["measured_s"],
                "lamb_comm_fraction": lamb["comm_fraction"], "warmup_s": warm["measured_s"],
                "compression_s": comp["measured_s"], "compute_s": comp["compute_s"],
                "step_speedup": lamb["measured_s"] / comp["measured_s"],
                "end_to_end_speedup": costmodel.end_to_end_speedup(
                    lamb["measured_s"], warm["measured_s"], comp["measured_s"], w),
                "predicted_step_speedup": lamb["predicted_s"] / comp["predicted_s"],
                "predicted_end_to_end_speedup": costmodel.end_to_end_speedup(
                    lamb["predicted_s"], warm["predicted_s"], comp["predicted_s"], w),
                "wire_reduction": lamb["wire_bytes"] / comp["wire_bytes"] if comp["wire_bytes"] else math.inf,
                "over_compute_only": comp["measured_s"] / comp["compute_s"] - 1.0,
            })
    return out


def schedule_folders() -> Dict[str, str]:
    """Each optimizer's run under ``--schedules``: the convergence benchmark's rows, 1-bit LAMB's
    with each warm-up (``benchmarks.warmup_quantised``) and DiLoCo's at H = ``DILOCO_H``
    (``benchmarks.diloco``), whose log's stages are its local steps and syncs."""
    folders = {row.flags[row.flags.index("--optimizer") + 1]: row.folder for row in CONVERGENCE_ROWS}
    # this benchmark's 1-bit LAMB warms up in float32 (the optimizers' default) and 1-bit LAMB-int8 in
    # int8 (the main job's default): each its own run
    folders["onebitlamb"], folders["onebitlamb-int8"] = (with_warmup(DEFAULT, dtype).row.folder
                                                         for dtype in ("float32", "int8"))
    folders["diloco"] = diloco.Settings(DILOCO_H).name
    return folders


def step_kinds(stages: Sequence[str], name: str, frozen_at: Optional[int]) -> List[str]:
    """The kind (``KINDS``) of each step of optimizer ``name``'s run from its steps' stages: 0/1
    Adam's compression steps after its ``freeze_step`` (``frozen_at``) are syncs."""
    return [SYNC if name == "zerooneadam" and stage == COMPRESSION and step > frozen_at else stage
            for step, stage in enumerate(stages, start=1)]


def run_step_kinds(run: str, name: str) -> Optional[List[str]]:
    """``step_kinds`` of optimizer ``name``'s finished run in folder ``run`` (the stages its
    ``log.csv`` records); None when the run is missing or unfinished (no metrics.json)."""
    if not os.path.exists(os.path.join(run, "metrics.json")):
        return None
    with open(os.path.join(run, "metrics.json")) as f:
        frozen_at = json.load(f).get("freeze_step")
    with open(os.path.join(run, "log.csv")) as f:
        stages = [line["stage"] for line in csv.DictReader(f) if line["stage"]]  # not the evaluation before step 1
    return step_kinds(stages, name, frozen_at)


def load_schedules(folder: str, optimizers: Sequence[str]) -> Dict[str, Dict[str, int]]:
    """Per optimizer, how many steps of each kind (``KINDS``) its run (``schedule_folders``) under
    ``folder`` took (``run_step_kinds``). Optimizers whose run is missing or unfinished are left out."""
    folders = schedule_folders()
    out = {}
    for name in optimizers:
        kinds = run_step_kinds(os.path.join(folder, folders[name]), name)
        if kinds is not None:
            out[name] = {kind: kinds.count(kind) for kind in KINDS if kind in kinds}
    return out


def whole_run_rows(rows: List[dict], schedules: Dict[str, Dict[str, int]]) -> List[dict]:
    """Per rate and optimizer with a schedule: the whole run's time, each step at the measured
    time of its kind at that rate (``by_kind``: 1-bit LAMB's compression steps for the int8
    warm-up's), and LAMB's whole run over it."""
    by = {key: r["measured_s"] for key, r in by_kind(rows).items()}
    rates = list(dict.fromkeys(r["rate_bps"] for r in rows))
    out = []
    for rate in rates:
        totals = {}
        for name, counts in schedules.items():
            if all((rate, name, kind) in by for kind in counts):
                totals[name] = sum(n * by[rate, name, kind] for kind, n in counts.items())
        for name, total in totals.items():
            out.append({"rate_bps": rate, "optimizer": name, "steps": sum(schedules[name].values()),
                        "counts": schedules[name], "whole_run_s": total,
                        "speedup": totals["lamb"] / total if "lamb" in totals else math.nan})
    return out


def format_whole_run(whole: List[dict], folder: str) -> str:
    """Markdown: the whole demo run per rate, the optimizers side by side."""
    names = list(dict.fromkeys(r["optimizer"] for r in whole))
    lines = [f"The whole demo run (`onebitlamb pretrain --preset demo`, seed 1234: each optimizer's steps by kind as "
             f"its run in `{folder}` took them), every step at the median time measured above for its kind at that "
             f"rate; minutes, and LAMB's time over the optimizer's:", "",
             "| steps by kind | " + " | ".join(LABELS[n] for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    counts = {r["optimizer"]: r["counts"] for r in whole}
    lines.append("| " + " | ".join(["(warm-up / compression / local / sync)"]
                                   + [" / ".join(str(counts[n].get(k, 0)) for k in KINDS) for n in names]) + " |")
    for rate in dict.fromkeys(r["rate_bps"] for r in whole):
        cells = {r["optimizer"]: r for r in whole if r["rate_bps"] == rate}
        lines.append("| " + " | ".join([rate_label(rate)] + [
            f"{cells[n]['whole_run_s'] / 60:.1f} min ({cells[n]['speedup']:.2f}x)" if n in cells else "-"
            for n in names]) + " |")
    shared = [f"{LABELS[name]}'s {kind} steps at {LABELS[source]}'s time (the same steps on the wire)"
              for (name, kind), source in SAME_STEPS.items() if name in names and counts[name].get(kind)]
    if shared:
        lines += ["", "; ".join(shared) + "."]
    return "\n".join(lines)


def format_tables(summary: dict, w: float) -> str:
    """Markdown: the speed-up table, the per-stage table (measured beside predicted), calibration."""
    c = summary["calibration"]
    lines = [f"Speed-up ({int(round(100 * w))}% warm-up for end-to-end; LAMB's communication share = "
             f"1 - compute-only / step):", "",
             "| link | optimizer | LAMB step ms | LAMB comm share | warm-up step ms | compression step ms "
             "| step speed-up (pred.) | end-to-end speed-up (pred.) | wire bytes vs LAMB | over compute-only |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["summary"]:
        lines.append(
            f"| {rate_label(r['rate_bps'])} | {LABELS[r['optimizer']]} | {ms(r['lamb_s'])} "
            f"| {100 * r['lamb_comm_fraction']:.0f}% | {ms(r['warmup_s'])} | {ms(r['compression_s'])} "
            f"| {r['step_speedup']:.1f}x ({r['predicted_step_speedup']:.1f}x) "
            f"| {r['end_to_end_speedup']:.2f}x ({r['predicted_end_to_end_speedup']:.2f}x) "
            f"| {r['wire_reduction']:.1f}x fewer | {100 * r['over_compute_only']:+.0f}% |")
    lines += ["", "Every measured step beside the cost model's prediction (median over the timed steps, "
              "mean over ranks; bytes are what one rank sent per step):", "",
              "| link | optimizer | stage | measured ms | predicted ms | diff | compute-only ms | alpha ms "
              "| wire KB/step | accounted KB/step | wire/accounted |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        diff = r["predicted_s"] / r["measured_s"] - 1.0
        flag = " **" if abs(diff) > 0.2 else ""
        ratio = r["wire_bytes"] / r["accounted_bytes"] if r["accounted_bytes"] else float("nan")
        lines.append(
            f"| {rate_label(r['rate_bps'])} | {LABELS[r['optimizer']]} | {r['stage']} | {ms(r['measured_s'])} "
            f"| {ms(r['predicted_s'])} | {100 * diff:+.0f}%{flag} | {ms(r['compute_s'])} | {1000 * r['alpha_s']:.2f} "
            f"| {kb(r['wire_bytes'])} | {kb(r['accounted_bytes'])} | {ratio:.3f} |")
    lines += ["", f"Calibration (unshaped network, {c['hosts']} hosts, d = {c['params']:,} parameters): "
              f"alpha {1000 * c['alpha_unshaped_s']:.2f} ms; "
              f"host byte rate {c['host_Bps'] / 1e6:.0f} MB/s (fp32 all-reduce {ms(c['allreduce_unshaped_s'])} ms); "
              f"1-bit codec {ms(c['codec_s'])} ms (compressed all-reduce {ms(c['compressed_unshaped_s'])} ms). "
              f"Diffs beyond 20% are marked **."]
    if summary.get("paired"):
        lines += ["", "Loopback, interleaved (one launch; each round one step of every optimizer in an order "
                  "drawn afresh, each after a barrier; a round's step is its slowest rank's): LAMB's step time over "
                  "the 1-bit optimizer's compression-stage step, per round:", "",
                  "| optimizer | rounds | LAMB step ms (optimizer.step) | compression step ms (optimizer.step) "
                  "| speed-up median (quartiles) | rounds faster than LAMB | bytes per step vs LAMB |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for p in summary["paired"]:
            lines.append(f"| {LABELS[p['optimizer']]} | {p['rounds']} | {ms(p['lamb_s'])} ({ms(p['lamb_opt_s'])}) "
                         f"| {ms(p['onebit_s'])} ({ms(p['onebit_opt_s'])}) "
                         f"| {p['speedup_median']:.3f}x ({p['speedup_q1']:.3f}-{p['speedup_q3']:.3f}) "
                         f"| {100 * p['faster_share']:.0f}% | {p['lamb_bytes'] / max(p['onebit_bytes'], 1):.1f}x fewer |")
    return "\n".join(lines)


def check_targets(summary: dict) -> List[str]:
    """The benchmark's targets, each as a line saying met or missed with the figure."""
    out = []
    rows = summary["summary"]
    lamb_ob = [r for r in rows if r["optimizer"] == "onebitlamb"]
    slow = [r for r in lamb_ob if r["lamb_comm_fraction"] >= 0.9]
    if slow:
        r = max(slow, key=lambda r: r["rate_bps"] or math.inf)
        lbl = rate_label(r["rate_bps"])
        out.append(f"{'met ' if r['step_speedup'] >= 10 else 'MISSED'} compression step >= 10x LAMB at {lbl} "
                   f"(LAMB comm share {100 * r['lamb_comm_fraction']:.0f}%): {r['step_speedup']:.1f}x")
        out.append(f"{'met ' if r['end_to_end_speedup'] >= 3.5 else 'MISSED'} end-to-end >= 3.5x at {lbl}: "
                   f"{r['end_to_end_speedup']:.2f}x")
    else:
        out.append("n/a    no rate where LAMB spends >= 90% of its step communicating")
    for r in lamb_ob:
        if r["rate_bps"] is not None and r["wire_reduction"] < 25:
            out.append(f"MISSED wire bytes >= 25x fewer at {rate_label(r['rate_bps'])}: {r['wire_reduction']:.1f}x")
    if lamb_ob:
        worst = min(r["wire_reduction"] for r in lamb_ob)
        out.append(f"{'met ' if worst >= 25 else 'MISSED'} wire bytes in compression >= 25x fewer than LAMB: "
                   f"at least {worst:.1f}x")
    for r in lamb_ob:
        if r["rate_bps"] == 1e9:
            out.append(f"{'met ' if r['over_compute_only'] <= 0.25 else 'MISSED'} compression step within 25% of "
                       f"compute-only at 1 Gbit/s: {100 * r['over_compute_only']:+.0f}%")
    for p in summary.get("paired", []):
        out.append(f"{'met ' if p['speedup_median'] >= 1.0 else 'MISSED'} {LABELS[p['optimizer']]} compression "
                   f"step not slower than LAMB on loopback (interleaved, median of {p['rounds']} rounds): "
                   f"{p['speedup_median']:.3f}x")
    rows = [r for r in rows if (r["optimizer"], COMPRESSION) not in SAME_STEPS]  # each step measured once
    for r in rows:
        if r["step_speedup"] < 1.0:
            out.append(f"MISSED {LABELS[r['optimizer']]} compression step slower than LAMB at "
                       f"{rate_label(r['rate_bps'])}: {r['step_speedup']:.2f}x")
    if all(r["step_speedup"] >= 1.0 for r in rows):
        out.append("met  compression step never slower than LAMB, at every rate measured")
    return out


def plot(summary: dict, path) -> None:
    """Step and end-to-end speed-up against link rate (the unshaped network drawn at the right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["summary"]
    shaped = sorted({r["rate_bps"] for r in rows if r["rate_bps"] is not None})
    unshaped_x = (max(shaped) * 5) if shaped else 1e10
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, color in (("onebitlamb", "C0"), ("onebitadam", "C1")):
        pts = sorted(((r["rate_bps"] or unshaped_x) / 1e6, r) for r in rows if r["optimizer"] == name)
        if not pts:
            continue
        xs = [x for x, _ in pts]
        ax.plot(xs, [r["step_speedup"] for _, r in pts], "o-", color=color,
                label=f"{LABELS[name]}: compression-stage step")
        ax.plot(xs, [r["end_to_end_speedup"] for _, r in pts], "s--", color=color,
                label=f"{LABELS[name]}: end-to-end, 20% warm-up")
        ax.plot(xs, [r["predicted_step_speedup"] for _, r in pts], ":", color=color, alpha=0.6,
                label=f"{LABELS[name]}: step, cost model")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = [x / 1e6 for x in shaped] + [unshaped_x / 1e6]
    ax.set_xticks(ticks)
    ax.set_xticklabels([rate_label(x * 1e6).replace(" ", "\n") for x in ticks[:-1]] + ["unshaped"])
    ax.set_xlabel("link rate per host")
    ax.set_ylabel("speed-up over LAMB")
    ax.set_title(f"{summary['calibration']['hosts']} emulated hosts, small BERT "
                 f"({summary['calibration']['params'] / 1e6:.2f}M parameters)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument("--hosts", type=int, default=d.hosts, help="emulated hosts, one worker each (default %(default)s)")
    parser.add_argument("--rates", default="10Mbit/s,50Mbit/s,200Mbit/s,1Gbit/s,inf",
                        help="link rates, comma-separated, each with its unit (10Mbit/s, 1Gbit/s, 10MB/s; "
                             "inf = unshaped); default %(default)s")
    parser.add_argument("--optimizers", default=",".join(NETWORK_OPTIMIZERS),
                        help=f"comma-separated subset of {','.join(NETWORK_OPTIMIZERS)} (default: all)")
    parser.add_argument("--schedules", default=SCHEDULES,
                        help="the convergence benchmark's runs whose steps by kind the whole-run table times "
                             "(default %(default)s: `python -m benchmarks.convergence` writes them)")
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
    parser.add_argument("--cleanup", action="store_true",
                        help="only remove namespaces left by killed runs (whose process is gone), then exit")
    parser.add_argument("--plot", default=str(DOCS / "netsim_speedup.png"), help="PNG to write (default %(default)s)")
    parser.add_argument("--raw", default=str(DOCS / "netsim_results.json"), help="raw results (default %(default)s)")
    parser.add_argument("--results", default=None, help="the BENCHMARKS.md to update (default: the repository's)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")


def settings_from_args(args) -> Settings:
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in optimizers if o not in NETWORK_OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {', '.join(NETWORK_OPTIMIZERS)}")
    if "lamb" not in optimizers:
        raise ValueError("the comparison needs lamb among --optimizers (it is the baseline)")
    for (name, kind), source in SAME_STEPS.items():
        if name in optimizers and source not in optimizers:
            raise ValueError(f"{name} takes its {kind} steps' time from {source} (the same steps): "
                             f"add {source} to --optimizers")
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
    return Settings(
        hosts=args.hosts, rates=parse_rates(args.rates),
        optimizers=optimizers, model=model, batch=args.batch, warmup_steps=args.warmup_steps,
        compression_steps=args.compression_steps, threads=args.threads, burst_ms=args.burst_ms,
        warmup_fraction=args.warmup_fraction, timeout_s=args.timeout, paired_rounds=args.paired_rounds)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.network",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if emulated.unavailable("benchmarks.network", "hosts"):
        return 3
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s): {' '.join(removed) or '-'}")
        return 0
    try:
        s = settings_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    done = emulated.run_unwinding("benchmarks.network", lambda: run_experiment(s, log=emulated.log))
    if done is None:
        return 130
    raw, _ = done
    summary = summarise(raw)
    schedules = load_schedules(args.schedules, s.optimizers)
    summary["whole_run"] = whole_run_rows(summary["rows"], schedules)
    tables = format_tables(summary, s.warmup_fraction)
    if summary["whole_run"]:
        tables += "\n\n" + format_whole_run(summary["whole_run"], args.schedules)
    missing = [name for name in s.optimizers if name not in schedules]
    if missing:
        folders = schedule_folders()
        runs = [f"{LABELS[name]} ({folders[name]}"
                + (", unfinished" if os.path.exists(os.path.join(args.schedules, folders[name], "log.csv")) else "")
                + ")" for name in missing]
        tables += (f"\n\nNo whole run for {', '.join(runs)}: no finished run in {args.schedules} "
                   f"(`python -m benchmarks.convergence` and `benchmarks.warmup_quantised` train them, "
                   f"`python -m benchmarks.diloco --H {DILOCO_H}` DiLoCo's, torchft's).")
    targets = check_targets(summary)
    print(tables)
    print()
    print("\n".join(targets))
    if args.no_write:
        return 0
    emulated.save_raw(args.raw, raw, summary)
    plot(summary, args.plot)
    m = s.model
    body = "\n".join([
        "## Network: LAMB vs 1-bit LAMB / 1-bit Adam / 0/1 Adam on emulated hosts",  # README links this heading
        "",
        f"Command: `{command_line(argv if argv is not None else None)}` (as root)",
        "",
        f"Machine: {machine_line()}. {s.hosts} hosts (network namespaces on a bridge, tbf on both ends of "
        f"every link, bucket {s.burst_ms:g} ms of the rate), one worker each with {s.threads} torch thread(s), "
        f"all sharing this machine's CPUs. BERT hidden {m['hidden']}, {m['layers']} layers, "
        f"{summary['calibration']['params']:,} parameters, {s.batch} x 64 tokens per host per step; "
        f"{s.warmup_steps} timed warm-up and {s.compression_steps} timed compression steps per optimizer "
        f"(0/1 Adam: variance and 1-bit steps, and as many local steps and syncs; DiLoCo: as many local steps "
        f"as compression steps, as many syncs as warm-up steps; 1-bit LAMB with the int8 warm-up: warm-up steps "
        f"only; one untimed step of each kind first; every step after a barrier). "
        f"Run took {raw['elapsed_s'] / 60:.1f} min. "
        f"Method and discussion: docs/netsim.md. Plot: docs/{Path(args.plot).name}.",
        "",
        tables,
        "",
        "Targets:",
        "",
        *[f"- {t}" for t in targets],
    ])
    path = write_section("network", body, args.results)
    print(f"\nwrote {path}, {args.plot}, {args.raw}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
