"""The network experiment: LAMB against the 1-bit optimizers on emulated hosts at several rates.

One unshaped launch first measures what does not depend on the rate: the latency of a tiny
collective, the hosts' own byte rate and the 1-bit codec's cost. Then one launch per rate trains
every optimizer through its stages, each right after the same steps with no communication (all
hosts computing at once, as they share the CPUs): the compute-only time the cost model starts
from, measured minutes apart from the step it predicts on a machine whose load varies.
``summarise`` turns the per-rank results into rows with the cost model's prediction beside each
measured step.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from onebitlamb.netsim import costmodel
from onebitlamb.netsim.runner import run_workers
from onebitlamb.netsim.topology import Network

OPTIMIZERS = ("lamb", "onebitlamb", "onebitadam")
LABELS = {"lamb": "LAMB", "onebitlamb": "1-bit LAMB", "onebitadam": "1-bit Adam"}
_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> Optional[float]:
    """``10M``, ``200mbit``, ``1G``, ``1.5e8`` -> bits per second; ``inf`` / ``unlimited`` -> None."""
    t = text.strip().lower()
    if t in ("inf", "unlimited", "none", "0"):
        return None
    m = re.fullmatch(r"([0-9.e+]+)\s*([kmg]?)(?:bit|bps|b)?(?:/s)?", t)
    if not m:
        raise ValueError(f"cannot read a rate from {text!r} (examples: 10M, 200mbit, 1G, inf)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def rate_label(rate_bps: Optional[float]) -> str:
    if rate_bps is None:
        return "unshaped"
    if rate_bps >= 1e9:
        return f"{rate_bps / 1e9:g} Gbit/s"
    return f"{rate_bps / 1e6:g} Mbit/s"


@dataclass
class Settings:
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
    from onebitlamb.netsim.worker import paired_steps

    spec = dict(s.spec(), rounds=s.paired_rounds)
    return spawn_local(paired_steps, s.hosts, (spec,), timeout_s=s.timeout_s,
                       threads_per_worker=s.threads)


def summarise_paired(per_rank: List[dict]) -> List[dict]:
    """Per 1-bit optimizer: the median over rounds of LAMB's step time over its own (a step costs
    what its slowest rank spends), with the quartiles of that ratio and the median times."""
    def slowest(name):
        return [max(ts) for ts in zip(*(r["step_times"][name] for r in per_rank))]

    def median_opt(name):
        return statistics.median(max(ts) for ts in zip(*(r["opt_step_times"][name] for r in per_rank)))

    lamb = slowest("lamb")
    out = []
    for name in per_rank[0]["step_times"]:
        if name == "lamb":
            continue
        onebit = slowest(name)
        ratios = sorted(a / b for a, b in zip(lamb, onebit))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out.append({"optimizer": name, "rounds": len(ratios), "lamb_s": statistics.median(lamb),
                    "onebit_s": statistics.median(onebit), "lamb_opt_s": median_opt("lamb"),
                    "onebit_opt_s": median_opt(name), "speedup_median": statistics.median(ratios),
                    "speedup_q1": q[0], "speedup_q3": q[2],
                    "faster_share": sum(r > 1 for r in ratios) / len(ratios),
                    "lamb_bytes": per_rank[0]["step_bytes"]["lamb"],
                    "onebit_bytes": per_rank[0]["step_bytes"][name]})
    return out


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


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
    alpha_unl = _mean(r["probe"]["alpha_s"] for r in base)
    ar_s = _mean(r["probe"]["allreduce_s"] for r in base)
    car_s = _mean(r["probe"]["compressed_s"] for r in base)
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
        alpha = _mean(r["probe"]["alpha_s"] for r in ranks)
        link = costmodel.Link(rate, alpha, host_Bps=host_Bps)
        for name in ranks[0]["train"]:
            for stage in ("warmup", "compression"):
                if stage not in ranks[0]["train"][name]:
                    continue
                per = [r["train"][name][stage] for r in ranks]
                measured = _mean(p["median_s"] for p in per)
                comp = synchronous_compute_s([r["compute_only"][name][stage]["step_times"] for r in ranks])
                if stage == "compression":
                    predicted = costmodel.predict_step(comp, onebit_bytes + costmodel.finite_flag_collectives(n),
                                                       link, codec_s)
                else:
                    predicted = costmodel.predict_step(comp, lamb_bytes, link)
                rows.append({
                    "rate_bps": rate, "optimizer": name, "stage": stage, "measured_s": measured,
                    "predicted_s": predicted, "compute_s": comp, "alpha_s": alpha,
                    "comm_fraction": costmodel.comm_fraction(measured, comp),
                    "wire_bytes": _mean(p["wire_bytes_per_step"] for p in per),
                    "accounted_bytes": _mean(p["accounted_bytes_per_step"] for p in per),
                    "spread_s": max(max(p["step_times"]) - min(p["step_times"]) for p in per),
                    "qdisc_drops": entry["qdisc_drops"],
                })
    return {"calibration": calib, "rows": rows, "summary": _speedups(rows, s["warmup_fraction"]),
            "paired": summarise_paired(raw["paired"]) if raw.get("paired") else []}


def _speedups(rows: List[dict], w: float) -> List[dict]:
    by = {(r["rate_bps"], r["optimizer"], r["stage"]): r for r in rows}
    rates = []
    for r in rows:
        if r["rate_bps"] not in rates:
            rates.append(r["rate_bps"])
    out = []
    for rate in rates:
        lamb = by.get((rate, "lamb", "warmup"))
        if lamb is None:
            continue
        for name in ("onebitlamb", "onebitadam"):
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


def _ms(x: float) -> str:
    return f"{1000 * x:.0f}" if x >= 0.1 else f"{1000 * x:.1f}"


def _kb(x: float) -> str:
    return f"{x / 1024:.0f}" if x >= 10240 else f"{x / 1024:.1f}"


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
            f"| {rate_label(r['rate_bps'])} | {LABELS[r['optimizer']]} | {_ms(r['lamb_s'])} "
            f"| {100 * r['lamb_comm_fraction']:.0f}% | {_ms(r['warmup_s'])} | {_ms(r['compression_s'])} "
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
            f"| {rate_label(r['rate_bps'])} | {LABELS[r['optimizer']]} | {r['stage']} | {_ms(r['measured_s'])} "
            f"| {_ms(r['predicted_s'])} | {100 * diff:+.0f}%{flag} | {_ms(r['compute_s'])} | {1000 * r['alpha_s']:.2f} "
            f"| {_kb(r['wire_bytes'])} | {_kb(r['accounted_bytes'])} | {ratio:.3f} |")
    lines += ["", f"Calibration (unshaped network, {c['hosts']} hosts, d = {c['params']:,} parameters): "
              f"alpha {1000 * c['alpha_unshaped_s']:.2f} ms; "
              f"host byte rate {c['host_Bps'] / 1e6:.0f} MB/s (fp32 all-reduce {_ms(c['allreduce_unshaped_s'])} ms); "
              f"1-bit codec {_ms(c['codec_s'])} ms (compressed all-reduce {_ms(c['compressed_unshaped_s'])} ms). "
              f"Diffs beyond 20% are marked **."]
    if summary.get("paired"):
        lines += ["", "Loopback, interleaved (one launch; each round one step of every optimizer in an order "
                  "drawn afresh, each after a barrier; a round's step is its slowest rank's): LAMB's step time over "
                  "the 1-bit optimizer's compression-stage step, per round:", "",
                  "| optimizer | rounds | LAMB step ms (optimizer.step) | compression step ms (optimizer.step) "
                  "| speed-up median (quartiles) | rounds faster than LAMB | bytes per step vs LAMB |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for p in summary["paired"]:
            lines.append(f"| {LABELS[p['optimizer']]} | {p['rounds']} | {_ms(p['lamb_s'])} ({_ms(p['lamb_opt_s'])}) "
                         f"| {_ms(p['onebit_s'])} ({_ms(p['onebit_opt_s'])}) "
                         f"| {p['speedup_median']:.3f}x ({p['speedup_q1']:.3f}-{p['speedup_q3']:.3f}) "
                         f"| {100 * p['faster_share']:.0f}% | {p['lamb_bytes'] / max(p['onebit_bytes'], 1):.1f}x fewer |")
    return "\n".join(lines)


def check_targets(summary: dict) -> List[str]:
    """The issue's targets, each as a line saying met or missed with the figure."""
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


# --- plain usage against DistributedDataParallel + register_ddp (``benchmarks/ddp.py``) ---

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


def _slowest(per_rank: List[dict], key: str) -> List[float]:
    """Per step, the slowest rank's value: a synchronous step costs what its last rank spends."""
    return [max(v) for v in zip(*(r[key] for r in per_rank))]


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
            p_t, d_t = _slowest(plain, "step_times"), _slowest(ddp, "step_times")
            ratios = sorted(a / b for a, b in zip(p_t, d_t))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3

            def wire(recs):
                vals = [w for rec in recs for w in rec["wire_bytes"] if w is not None]
                return _mean(vals) if vals else None

            rows.append({
                "rate_bps": rate_bps, "optimizer": name, "stage": stage, "steps": len(ratios),
                "plain_s": statistics.median(p_t), "ddp_s": statistics.median(d_t),
                "plain_backward_s": statistics.median(_slowest(plain, "backward_times")),
                "ddp_backward_s": statistics.median(_slowest(ddp, "backward_times")),
                "plain_opt_s": statistics.median(_slowest(plain, "opt_step_times")),
                "ddp_opt_s": statistics.median(_slowest(ddp, "opt_step_times")),
                "ratio_median": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
                "ddp_faster_share": sum(x > 1 for x in ratios) / len(ratios),
                "ddp_buckets": statistics.median(ddp[0]["buckets"]),
                "plain_backward_bytes": _mean(plain[0]["backward_bytes"]),
                "plain_step_bytes": _mean(plain[0]["opt_step_bytes"]),
                "ddp_backward_bytes": _mean(ddp[0]["backward_bytes"]),
                "ddp_step_bytes": _mean(ddp[0]["opt_step_bytes"]),
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

    def kb(x):
        return "-" if x is None else _kb(x)

    for r in summary["rows"]:
        lines.append(
            f"| {rate_label(r['rate_bps'])} | {LABELS[r['optimizer']]} | {r['stage']} "
            f"| {_ms(r['plain_s'])} ({_ms(r['plain_backward_s'])} / {_ms(r['plain_opt_s'])}) "
            f"| {_ms(r['ddp_s'])} ({_ms(r['ddp_backward_s'])} / {_ms(r['ddp_opt_s'])}) "
            f"| {r['ratio_median']:.3f}x ({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}) "
            f"| {100 * r['ddp_faster_share']:.0f}% of {r['steps']} | {r['ddp_buckets']:g} "
            f"| {kb(r['plain_backward_bytes'] + r['plain_step_bytes'])} ({kb(r['plain_backward_bytes'])} / "
            f"{kb(r['plain_step_bytes'])}) "
            f"| {kb(r['ddp_backward_bytes'] + r['ddp_step_bytes'])} ({kb(r['ddp_backward_bytes'])} / "
            f"{kb(r['ddp_step_bytes'])}) "
            f"| {kb(r['plain_wire_bytes'])} | {kb(r['ddp_wire_bytes'])} |")
    return "\n".join(lines)


# --- the flat group against node_groups() on nodes of several ranks (``benchmarks/hierarchy.py``) ---

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


def _quartiles(values: List[float]):
    values = sorted(values)
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


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
                t = _slowest(recs, "step_times")
                row[f"{k}_times"] = t
                row[f"{k}_s"] = statistics.median(t)
                row[f"{k}_opt_s"] = statistics.median(_slowest(recs, "opt_step_times"))
                row[f"{k}_backward_s"] = statistics.median(_slowest(recs, "backward_times"))
                if "started_in_backward" in recs[0]:  # not in results from before overlap_with_backward
                    row[f"{k}_started"] = _mean(x for rec in recs for x in rec["started_in_backward"])
                    row[f"{k}_buckets"] = max(x for rec in recs for x in rec["buckets"])
                rank_bytes = [_mean(rec["bytes"]) for rec in recs]
                rank_intra = [_mean(rec["intra_bytes"]) for rec in recs]
                row[f"{k}_rank_bytes"] = _mean(rank_bytes)
                row[f"{k}_rank_intra_bytes"] = _mean(rank_intra)
                # what a node's ranks together accounted outside the node stages
                row[f"{k}_node_bytes"] = _mean(
                    sum(rank_bytes[j * L + i] - rank_intra[j * L + i] for i in range(L)) for j in range(nodes))
                wires = [w for j in range(nodes) for w in recs[j * L]["wire_bytes"] if w is not None]
                row[f"{k}_wire_bytes"] = _mean(wires) if wires else None
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
                q = _quartiles(ratios)
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
    alpha = _mean(p["alpha_inter_s"] for p in probes)
    alpha_intra = _mean(p["alpha_intra_s"] for p in probes)
    # the timed all-to-all less its latency (but at least half its time: at small sizes the two
    # are of one order and their difference is noise)
    a2a = [p["intra_all_to_all_bytes"] / max(p["intra_all_to_all_s"] - p["alpha_intra_s"], p["intra_all_to_all_s"] / 2)
           for p in probes if "intra_all_to_all_s" in p]
    host_Bps = _mean(a2a) if a2a else math.inf
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
    L = summary["local_size"]
    lines = ["| link | optimizer | stage | flat step ms (pred.) | hierarchical step ms (pred.) "
             "| flat / hier., median (quartiles) | compute-only ms | wire KB/step per node: flat / hier. (ratio) "
             "| accounted KB/step per node beyond it: flat / hier. | accounted KB/step per rank: flat / hier. (node stages) "
             "| optimizer.step() ms: flat / hier. / alone |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def kb(x):
        return "-" if x is None else _kb(x)

    def pred(row, mode):
        return f" ({_ms(row[mode + '_pred_s'])})" if f"{mode}_pred_s" in row else ""

    for r in summary["rows"]:
        fw, hw = r.get("flat_wire_bytes"), r.get("hier_wire_bytes")
        wire = f"{kb(fw)} / {kb(hw)}" + (f" ({fw / hw:.2f}x)" if fw and hw else "")
        lines.append(
            f"| {rate_label(r['rate_bps'])} | {LABELS[r['optimizer']]} | {r['stage']} "
            f"| {_ms(r['flat_s'])}{pred(r, 'flat')} | {_ms(r['hier_s'])}{pred(r, 'hier')} "
            f"| {r['ratio_median']:.2f}x ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}) "
            f"| {_ms(r['solo_s']) if 'solo_s' in r else '-'} | {wire} "
            f"| {kb(r['flat_node_bytes'])} / {kb(r['hier_node_bytes'])} "
            f"| {kb(r['flat_rank_bytes'])} / {kb(r['hier_rank_bytes'])} ({kb(r['hier_rank_intra_bytes'])}) "
            f"| {_ms(r['flat_opt_s'])} / {_ms(r['hier_opt_s'])} / {_ms(r['solo_opt_s']) if 'solo_opt_s' in r else '-'} |")
    return "\n".join(lines)


def check_hierarchy_targets(summary: dict, speed_rate: float = 100e6, speed_target: float = 1.8) -> List[str]:
    """Issue 40's targets: in the compression stage a node's wire bytes across nodes at least
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
                   f"{rate_label(r['rate_bps'])}: {fw / hw:.2f}x ({_kb(fw)} KB vs {_kb(hw)} KB per step{expected})")
    for r in comp:
        if r["rate_bps"] == speed_rate:
            ok = r["ratio_median"] >= speed_target
            out.append(f"{'met   ' if ok else 'MISSED'} compression step >= {speed_target}x faster than flat at "
                       f"{rate_label(speed_rate)}: {r['ratio_median']:.2f}x (median of {r['steps']} steps; "
                       f"{_ms(r['flat_s'])} vs {_ms(r['hier_s'])} ms, compute-only {_ms(r.get('solo_s', math.nan))} ms)")
    if not any(r["rate_bps"] == speed_rate for r in comp):
        out.append(f"n/a    no compression-stage row at {rate_label(speed_rate)}")
    return out


def _rate_x(rows: List[dict]):
    """A row's x on a log axis of link rates in Mbit/s; the unshaped network drawn to the right of
    the fastest shaped rate."""
    shaped = [r["rate_bps"] for r in rows if r["rate_bps"] is not None]
    unshaped_x = max(shaped) * 5 if shaped else 1e10
    return lambda row: (row["rate_bps"] or unshaped_x) / 1e6


def _log_rate_axis(ax, rows: List[dict], xlabel: str) -> None:
    """Log-log axes with one tick per measured rate (``_rate_x``), labelled with the rate."""
    from matplotlib.ticker import NullLocator

    x_of = _rate_x(rows)
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


def plot_hierarchy(summary: dict, path) -> None:
    """Two panels against the inter-node rate: a node's wire bytes per step and the step time,
    flat vs hierarchical, warm-up and compression stage (the cost model's steps dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r["optimizer"] == "onebitlamb"]
    x_of = _rate_x(rows)
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
        _log_rate_axis(ax, rows, "link rate between nodes")
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


# --- the serial step against the one that exchanges behind the backward (``benchmarks/overlap.py``) ---
# ``run_hierarchy`` with the modes flat, overlap and solo (and hier, hier-overlap on nodes of
# several ranks), summarised by ``summarise_hierarchy``.

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

    def ms(row, key):
        return _ms(row[key]) if row.get(key) is not None else "-"

    def kb(x):
        return "-" if x is None else _kb(x)

    def ratio(row, stem):
        return f"{row[stem + '_median']:.2f}x ({row[stem + '_q1']:.2f}-{row[stem + '_q3']:.2f})" \
            if f"{stem}_median" in row else "-"

    for r in rows:
        ideal = r.get("overlap_ideal_s")
        started = (f"{r['overlap_started']:.1f} of {r['overlap_buckets']}" if "overlap_started" in r else "-")
        cells = [rate_label(r["rate_bps"]), LABELS[r["optimizer"]], r["stage"],
                 f"{ms(r, 'flat_s')} ({ms(r, 'flat_backward_s')} / {ms(r, 'flat_opt_s')})",
                 f"{ms(r, 'overlap_s')} ({ms(r, 'overlap_backward_s')} / {ms(r, 'overlap_opt_s')})",
                 ratio(r, "overlap_ratio"), ms(r, "solo_s"),
                 f"{ms(r, 'overlap_ideal_s')}" + (f" ({ms(r, 'overlap_wire_s')} on the wire)"
                                                   if r.get("overlap_wire_s") else ""),
                 f"{r['overlap_s'] / ideal:.2f}x" if ideal else "-", started,
                 f"{kb(r.get('flat_wire_bytes'))} / {kb(r.get('overlap_wire_bytes'))}"]
        if hier:
            cells += [ms(r, "hier_s"), ms(r, "hier_overlap_s"), ratio(r, "hier_overlap_ratio")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def check_overlap_targets(summary: dict, close_rate: float = 1e9, close_target: float = 0.10,
                          wire_rate: float = 50e6, wire_target: float = 1.2) -> List[str]:
    """Issue 40's targets for 1-bit LAMB's compression stage over the flat group, overlapped: at
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
                   f"({_ms(r['overlap_s'])} vs {_ms(r['solo_s'])} ms, median of {r['steps']} steps; serial "
                   f"{_ms(r['flat_s'])} ms)")
    r = comp.get(wire_rate)
    if r is None or r.get("overlap_ideal_s") is None:
        out.append(f"n/a    no compression-stage row with the overlapped step, the compute-only step and wire "
                   f"bytes at {rate_label(wire_rate)}")
    else:
        x = r["overlap_s"] / r["overlap_ideal_s"]
        out.append(f"{'met   ' if x <= wire_target else 'MISSED'} overlapped compression step within "
                   f"{wire_target:g}x of max(compute-only, wire time) at {rate_label(wire_rate)}: {x:.2f}x "
                   f"({_ms(r['overlap_s'])} ms vs max({_ms(r['solo_s'])}, {_ms(r['overlap_wire_s'])}) ms, the wire "
                   f"time from {_kb(r['overlap_wire_bytes'])} KB per step; serial {_ms(r['flat_s'])} ms)")
    return out


def plot_overlap(summary: dict, path) -> None:
    """Step time against the link rate: the serial step, the overlapped one and the compute-only
    one, warm-up and compression stage (the hierarchical pair too where it ran), and the ideal
    max(compute-only, wire time) of the overlapped compression step, dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r["optimizer"] == "onebitlamb"]
    x_of = _rate_x(rows)
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
    _log_rate_axis(ax, rows, "link rate per host" if L == 1 else "link rate between nodes")
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
