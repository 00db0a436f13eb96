"""Signals for an earlier freeze: what the warm-up shows when a freeze works and when it fails.

    python -m onebitlamb.benchmarks.freeze_signals      # seven runs (~55 min on 2 cores), then the tables

On ``b1024`` 1-bit LAMB frozen in the middle of the plateau exit (steps 72-80) did better than the
automatic freeze's later step; on ``demo`` seed 1236 a freeze in the middle of the exit (the rule
before, step 93) failed. Can anything known at the time of the freeze tell them apart? This reads
the convergence study's runs (``--study``; run ``python -m onebitlamb.benchmarks.convergence`` with
the seeds and freeze steps of docs/convergence.md first) for each freeze's outcome, its spread and
its stage-2 step sizes, and runs the warm-ups of those seeds once more with the freeze held off
(``--out``) for every layer's variance level at each of those steps and after the exit. It also runs
the automatic freezes that came on the plateau (``PLATEAU_FREEZES``) with the freeze held off, to
tell what the freeze cost there from what the rate did. Writes the
"freeze signals" section of BENCHMARKS.md; docs/convergence.md ("Other signals for an earlier
freeze") reads it.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from onebitlamb.benchmarks.convergence import PRESETS, format_rate, pretrain_config, run_one
from onebitlamb.benchmarks.report import command_line, heading, table_row, write_section
from onebitlamb.optim import functional as F

# (preset, seed) -> the cap of a warm-up whose freeze is held off: past the plateau exit of every
# freeze read from it (b1024's exit ends near step 100, demo seed 1236's near 145)
TRACES: Dict[Tuple[str, int], float] = {("b1024", 1234): 0.33, ("b1024", 1235): 0.33, ("demo", 1236): 0.4}
# the criterion can fire neither way before the cap: no layer settles to 1e-9, no transient rule
# (and these traces ran before 1-bit LAMB's freeze waited for its trust ratios' peak by default)
HOLD_OFF = ["--auto-freeze", "--freeze-tolerance", "1e-9", "--freeze-transient", "0", "--no-freeze-after-trust-peak"]
# The two key biases get no gradient but rounding (softmax ignores a constant added to every key
# score), so their variance level says nothing about learning
IGNORED_SUFFIX = "attention.self.key.bias"
# a freeze "works" when it ends within the convergence target of LAMB at the same seed
TARGET = 0.01
# (preset, seed, optimizer, rate) of the study's automatic freezes that came on the plateau, once a
# spike had left the window (docs/convergence.md, "A spike on the plateau, seen once"): each runs
# again with the freeze held off to the study's cap (its --freeze-frac), to tell what the freeze
# cost from what the rate did
PLATEAU_FREEZES: List[Tuple[str, int, str, float]] = [
    ("b512", 1234, "onebitadam", 4e-3), ("demo", 1235, "onebitadam", 4e-3),
    ("b1024", 1235, "onebitadam", 4e-3), ("b4096", 1235, "onebitadam", 4e-3)]
STUDY_CAP = 0.75
# the ends of the transient replayed on the recorded spreads: the default (2.5), later ones, and
# the rule before (None: half the peak)
REPLAYED_ENDS: Tuple[Optional[float], ...] = (2.5, 3.0, 3.5, 4.0, None)


def trace_flags(preset: str, seed: int) -> List[str]:
    return PRESETS[preset] + HOLD_OFF + ["--freeze-frac", str(TRACES[(preset, seed)]), "--seed", str(seed)]


def element_levels(metrics: dict, numels: Dict[str, int]) -> Tuple[List[str], List[List[float]]]:
    """Per warm-up step, each layer's ``log ||v_hat||`` per element (``- log(numel) / 2``: the log of
    the root mean square of v_hat, comparable between layers of different size), layers with no
    gradient yet as -inf, the key biases left out. Row ``s - 1`` is the end of step ``s``."""
    record = metrics["freeze_levels"]
    keep = [i for i, name in enumerate(record["layers"]) if not name.endswith(IGNORED_SUFFIX)]
    rows = []
    for row in record["per_step"]:
        if row is None:
            break
        rows.append([(-math.inf if row[i] is None else row[i] - math.log(numels[record["layers"][i]]) / 2)
                     for i in keep])
    return [record["layers"][i] for i in keep], rows


def rise_to_come(rows: List[List[float]], step: int) -> float:
    """In hindsight: how far the layer with the most still to go rose between the end of ``step``
    and the end of the trace (log scale; a layer with no gradient yet at ``step`` is left out)."""
    now, end = rows[step - 1], rows[-1]
    return max(e - n for n, e in zip(now, end) if math.isfinite(n))


def lowest_below_median(rows: List[List[float]], step: int) -> float:
    """Known at the time: how far the lowest layer's level sits below the median layer's."""
    levels = [x for x in rows[step - 1] if math.isfinite(x)]
    return statistics.median(levels) - min(levels)


def largest_jump(spread: Sequence[Optional[float]], step: int) -> Optional[float]:
    """The largest one-step rise of the spread up to the end of ``step`` (a spike's signature)."""
    jumps = [b - a for a, b in zip(spread[:step - 1], spread[1:step]) if a is not None and b is not None]
    return max(jumps) if jumps else None


def stage2_steps(metrics: dict) -> Optional[Tuple[float, float, float, float]]:
    """The relative step per unit learning rate after the freeze, at each diagnosed step where the
    rate is above 0: (lowest, highest) of the largest layer's, then of the median layer's. The key
    biases are left out. ``lr[k]`` is the rate set after step ``k + 1``, the one step ``k + 2`` used.
    The stage is the one each step ran in (``stage``): records from before the main job fixed it label
    a diagnostic at the freeze's own step, a warm-up step, with the stage after it."""
    largest, median = [], []
    for diag in metrics["diagnostics"]:
        step = diag["step"]
        if metrics["stage"][step - 1] != "compression" or step < 2 or metrics["lr"][step - 2] <= 0:
            continue
        rate = metrics["lr"][step - 2]
        ratios = [layer["rel_step"] / rate for layer in diag["layers"]
                  if layer["rel_step"] is not None and not layer["name"].endswith(IGNORED_SUFFIX)]
        largest.append(max(ratios))
        median.append(statistics.median(ratios))
    if not largest:
        return None
    return min(largest), max(largest), min(median), max(median)


def frozen_coefficient(metrics: dict) -> Optional[float]:
    """The median layer's frozen trust ratio (the running average of the last warm-up steps' trust
    ratios that stage 2 keeps; key biases left out), from the first diagnosed step after the freeze;
    None where none was diagnosed."""
    for diag in metrics.get("diagnostics") or []:
        frozen = [layer["frozen_coeff"] for layer in diag["layers"]
                  if layer.get("frozen_coeff") is not None and not layer["name"].endswith(IGNORED_SUFFIX)]
        if frozen:
            return statistics.median(frozen)
    return None


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def study_runs(study: str, rates: Dict[str, float]) -> List[Tuple[str, str, dict]]:
    """(preset, folder, metrics) of the study's runs at their optimizer's main-job rate (``rates``):
    LAMB's, and the 1-bit runs with the paper's compression and no guard. A run saved before a
    setting existed reads as having run with its earlier value (``pretrain.ADDED_SETTINGS``)."""
    from onebitlamb.train.pretrain import ADDED_SETTINGS

    runs = []
    for path in sorted(glob.glob(os.path.join(study, "*", "*", "metrics.json"))):
        m = _load(path)
        cfg = m["config"] = {**ADDED_SETTINGS, **m["config"]}
        if cfg["lr"] == rates[cfg["optimizer"]] and (
                cfg["optimizer"] == "lamb" or (cfg["compression_space"] == "momentum" and not cfg["update_guard"])):
            folder = os.path.dirname(path)
            runs.append((os.path.basename(os.path.dirname(folder)), os.path.basename(folder), m))
    return runs


def _lamb_losses(runs: List[Tuple[str, str, dict]]) -> Dict[Tuple[str, int], float]:
    return {(preset, m["config"]["seed"]): m["final_eval_loss"] for preset, _, m in runs
            if m["config"]["optimizer"] == "lamb"}


def _range(lo: float, hi: float) -> str:
    return f"{lo:.0f}-{hi:.0f}" if round(lo) != round(hi) else f"{lo:.0f}"


def render(rows: List[dict], command: str) -> str:
    lines = [
        *heading("Signals for an earlier freeze", command),
        "Every 1-bit LAMB run of the convergence study at the main job's rate (momentum space, no guard) at the seeds "
        "with a trace, by freeze step. *Works*: within 1% of LAMB at the same seed. Levels are each "
        "layer's `log ||v_hat||` per element (natural log), read from the warm-up of the same seed "
        "with the freeze held off (bit-identical to the run's own up to its freeze); the key biases "
        "(no gradient but rounding) are left out. Known at the freeze: the spread, its largest "
        "one-step rise so far, how far the lowest layer sits below the median one. Known only in "
        "hindsight: the largest rise a layer still made by the end of the trace. After the freeze: "
        "the relative step per unit rate of the largest and of the median layer (LAMB's is about 1).",
        "",
        "| preset, seed | run | freeze | vs LAMB | works | spread | largest jump | lowest below median "
        "| rise to come | stage 2: largest layer | median layer |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        steps = r["stage2"]
        lines.append(
            f"| {r['preset']}, {r['seed']} | {r['run']} | {r['freeze']} | {100 * r['gap']:+.1f}% "
            f"| {'yes' if r['gap'] <= TARGET else '**no**'} | {r['spread']:.1f} | {r['jump']:.1f} "
            f"| {r['below_median']:.1f} | {r['rise']:.1f} "
            f"| {_range(steps[0], steps[1]) if steps else '-'} | {_range(steps[2], steps[3]) if steps else '-'} |")
    failed = [r for r in rows if r["gap"] > TARGET]
    worked = [r for r in rows if r["gap"] <= TARGET]
    lines.append("")
    for key, name in (("spread", "spread at the freeze"), ("jump", "largest jump"),
                      ("below_median", "lowest below median"), ("rise", "rise to come")):
        if failed and worked:
            lines.append(f"- {name}: failed {', '.join(f'{r[key]:.1f}' for r in failed)}; worked "
                         f"{min(r[key] for r in worked):.1f} to {max(r[key] for r in worked):.1f}, "
                         f"{sum(r[key] >= min(f[key] for f in failed) for r in worked)} of {len(worked)} "
                         f"at or above the lowest failed value")
    return "\n".join(lines) + "\n"


def automatic_freezes(runs: List[Tuple[str, str, dict]]) -> List[dict]:
    """One entry per optimizer, preset and seed with an automatic freeze among ``runs`` (see
    ``study_runs``): the largest one-step rise of the spread up to the later of the two rules'
    freezes (their warm-ups are the same up to the earlier one), and each rule's freeze step and
    gap to LAMB at the same seed (None: no LAMB run)."""
    lamb = _lamb_losses(runs)
    found: Dict[Tuple[str, str, int], dict] = {}
    for preset, _, m in runs:
        cfg = m["config"]
        if cfg["optimizer"] == "lamb" or not cfg["auto_freeze"] or m["freeze_step"] is None:
            continue
        entry = found.setdefault((cfg["optimizer"], preset, cfg["seed"]),
                                 {"optimizer": cfg["optimizer"], "preset": preset, "seed": cfg["seed"], "jump": 0.0})
        rule = "default" if cfg["freeze_transient_end"] else "half peak"
        ref = lamb.get((preset, cfg["seed"]))
        entry[rule] = (m["freeze_step"], None if ref is None else m["final_eval_loss"] / ref - 1)
        entry["jump"] = max(entry["jump"], largest_jump(m["freeze_spread"], m["freeze_step"]) or 0.0)
    return sorted(found.values(), key=lambda e: (e["optimizer"], -e["jump"]))


def render_jumps(entries: List[dict], rates: Dict[str, float]) -> str:
    def outcome(entry: dict, rule: str) -> str:
        if rule not in entry:
            return "-"
        step, gap = entry[rule]
        return f"{step}, " + ("-" if gap is None else f"{100 * gap:+.1f}%")

    lines = [
        "",
        "The largest one-step rise of the spread before the freeze, in every automatic freeze of the "
        f"convergence study at the main job's rates (1-bit LAMB {format_rate(rates['onebitlamb'])}, 1-bit Adam "
        f"{format_rate(rates['onebitadam'])}), with the step "
        "and the gap to LAMB at the same seed of both rules: the default (end 2.5) and the rule before "
        "(half the peak; run at fewer seeds).",
        "",
        "| optimizer | preset, seed | largest jump | default: step, vs LAMB | rule before: step, vs LAMB |",
        "|---|---|---:|---|---|",
    ]
    for e in entries:
        lines.append(f"| {e['optimizer']} | {e['preset']}, {e['seed']} | {e['jump']:.1f} | {outcome(e, 'default')} "
                     f"| {outcome(e, 'half peak')} |")
    return "\n".join(lines) + "\n"


def collect(runs: List[Tuple[str, str, dict]], out: str, cache: str) -> List[dict]:
    """The first table's rows: every 1-bit LAMB run among ``runs`` at a traced preset and seed."""
    from onebitlamb.train.model import build_model

    lamb_losses = _lamb_losses(runs)
    rows = []
    for preset, seed in TRACES:
        lamb = lamb_losses.get((preset, seed))
        onebit = [(folder, m) for p, folder, m in runs
                  if p == preset and m["config"]["seed"] == seed and m["config"]["optimizer"] == "onebitlamb"]
        if lamb is None or not onebit:
            raise SystemExit(f"no LAMB or 1-bit LAMB run of {preset} at seed {seed} in the study: run the "
                             f"convergence study first (docs/convergence.md names the command)")
        flags = trace_flags(preset, seed)
        print(f"trace: {preset}, seed {seed}", file=sys.stderr, flush=True)
        trace = run_one(os.path.join(out, f"{preset}_seed_{seed}"), "onebitlamb", flags, cache)
        cfg = pretrain_config("onebitlamb", flags)
        numels = {name: p.numel() for name, p in build_model(cfg.model, cfg.seed).named_parameters()}
        _, levels = element_levels(trace, numels)
        for name, m in sorted(onebit, key=lambda item: item[1]["freeze_step"]):
            step = m["freeze_step"]
            if step > len(levels):
                continue  # frozen after the trace's cap
            rows.append({"preset": preset, "seed": seed, "run": name, "freeze": step,
                         "gap": m["final_eval_loss"] / lamb - 1,
                         "spread": trace["freeze_spread"][step - 1],
                         "jump": largest_jump(trace["freeze_spread"], step),
                         "below_median": lowest_below_median(levels, step), "rise": rise_to_come(levels, step),
                         "stage2": stage2_steps(m)})
    return rows


def loss_before(metrics: dict, step: int) -> Tuple[int, float]:
    """The last held-out evaluation at or before the end of ``step``: (its step, its loss)."""
    per_step = metrics["samples"] // metrics["steps"]
    samples, loss = [point for point in metrics["eval_curve"] if point[0] <= step * per_step][-1]
    return samples // per_step, loss


def plateau_rows(study: str, held_off: Dict[Tuple[str, int, str, float], dict]) -> List[dict]:
    """Per run of ``held_off`` (a warm-up with the freeze held off, by preset, seed, optimizer and
    rate): every automatic freeze of the study at those settings, beside it."""
    rows = []
    for (preset, seed, optimizer, rate), control in held_off.items():
        for path in sorted(glob.glob(os.path.join(study, preset, "*", "metrics.json"))):
            m = _load(path)
            cfg = m["config"]
            if ((cfg["optimizer"], cfg["seed"], cfg["lr"]) != (optimizer, seed, rate) or not cfg["auto_freeze"]
                    or m["freeze_step"] is None):
                continue
            rows.append({"optimizer": optimizer, "rate": rate, "preset": preset, "seed": seed,
                         "rule": "default" if cfg.get("freeze_transient_end") else "half peak",
                         "freeze": m["freeze_step"], "jump": largest_jump(m["freeze_spread"], m["freeze_step"]),
                         "before": loss_before(m, m["freeze_step"]), "final": m["final_eval_loss"],
                         "held_off": (control["freeze_step"], control["final_eval_loss"])})
    return sorted(rows, key=lambda r: (r["preset"], r["seed"], r["rule"] != "default"))


def render_plateau(rows: List[dict]) -> str:
    lines = [
        "",
        "Automatic freezes that came on the plateau (a model that knows only token frequencies scores about "
        "6.07), and the same run with the freeze held off to the study's cap "
        f"({STUDY_CAP:.0%}): what the early freeze cost, against what the rate alone does.",
        "",
        "| optimizer, rate | preset, seed | rule | freeze | largest jump | held-out loss before the freeze "
        "| final loss | freeze held off: step, final loss |",
        "|---|---|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        step, loss = r["before"]
        lines.append(f"| {r['optimizer']}, {format_rate(r['rate'])} | {r['preset']}, {r['seed']} | {r['rule']} "
                     f"| {r['freeze']} | {r['jump']:.1f} | {loss:.3f} (step {step}) | {r['final']:.3f} "
                     f"| {r['held_off'][0]}, {r['held_off'][1]:.3f} |")
    return "\n".join(lines) + "\n"


def run_held_off(out: str, cache: str) -> Dict[Tuple[str, int, str, float], dict]:
    """The warm-ups of PLATEAU_FREEZES with the freeze held off to the study's cap."""
    runs = {}
    for preset, seed, optimizer, rate in PLATEAU_FREEZES:
        print(f"held off: {preset}, seed {seed}, {optimizer} at {format_rate(rate)}", file=sys.stderr, flush=True)
        flags = PRESETS[preset] + HOLD_OFF + ["--freeze-frac", str(STUDY_CAP), "--seed", str(seed),
                                              "--lr", format_rate(rate)]
        folder = os.path.join(out, f"{preset}_{optimizer}_lr_{format_rate(rate)}_seed_{seed}")
        runs[(preset, seed, optimizer, rate)] = run_one(folder, optimizer, flags, cache)
    return runs


def replay_freeze(spread: Sequence[Optional[float]], end: Optional[float], floor: int, tolerance: float,
                  transient: float) -> Optional[int]:
    """The step the automatic freeze would have chosen with this ``end`` of the transient, replayed
    with the optimizers' own decision on a recorded spread (entry ``k`` is the spread at the end of
    step ``k + 1``; the cap left out: every record ends before it); None when the record ends first."""
    peak = 0.0
    for step, value in enumerate(spread, start=1):
        if value is not None:
            peak = max(peak, value)
        if F.freeze_due(step, value, peak, floor, math.inf, tolerance, transient, end):
            return step
    return None


def replayed_ends(runs: List[Tuple[str, str, dict]], traces: Dict[Tuple[str, int], dict]) -> List[dict]:
    """Per 1-bit LAMB run of the study with the default rule (at the main job's rate), the step each
    of REPLAYED_ENDS would have frozen at, on the longest spread recorded at its seed: a trace with
    the freeze held off where there is one, else the run's own, which ends at its freeze (in runs
    recorded before the freeze's own step was, the step before), so that only ends that fire no
    later can be replayed on it. Beside it, the freeze steps the runs themselves took with
    the default and with the rule before (where it ran), the check of the replay."""
    from onebitlamb.train.pretrain import DEFAULTS

    own = {}
    for preset, _, m in runs:
        cfg = m["config"]
        if cfg["optimizer"] == "onebitlamb" and cfg["auto_freeze"]:
            own[(preset, cfg["seed"], cfg["freeze_transient_end"] or None)] = m
    rows = []
    for (preset, seed, rule_end), m in own.items():
        if rule_end != DEFAULTS["freeze_transient_end"]:
            continue
        cfg = m["config"]
        spread = traces.get((preset, seed), m)["freeze_spread"]
        floor = max(1, round(cfg["min_freeze_frac"] * cfg["steps"]))
        before = own.get((preset, seed, None))
        rows.append({"preset": preset, "seed": seed, "freeze": m["freeze_step"],
                     "before": before["freeze_step"] if before else None,
                     "steps": [replay_freeze(spread, end, floor, cfg["freeze_tolerance"], cfg["freeze_transient"])
                               for end in REPLAYED_ENDS]})
    return sorted(rows, key=lambda r: (list(PRESETS).index(r["preset"]), r["seed"]))


def render_ends(rows: List[dict]) -> str:
    names = ["half the peak" if end is None else f"end {end}" for end in REPLAYED_ENDS]
    lines = [
        "",
        "Where another end of the transient would have frozen 1-bit LAMB at the main job's rate, replayed with "
        "the optimizers' own tests on the spread recorded at each seed (the trace with the freeze held off at "
        "the traced seeds, else the default's run, whose record ends at its freeze, or the step before in runs "
        "recorded before the freeze's own step was: `-`, the record ends first). The steps the runs took, with the default and with the rule before, check the "
        "replay.",
        "",
        table_row(["preset, seed", "default's run", "rule before's run", *names]),
        "|---|---:|---:|" + "---:|" * len(names),
    ]
    for r in rows:
        cells = ["-" if step is None else str(step) for step in r["steps"]]
        lines.append(table_row([f"{r['preset']}, {r['seed']}", r["freeze"], r["before"] or "-", *cells]))
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onebitlamb.benchmarks.freeze_signals",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--study", default="runs/convergence", help="the convergence study's run folders")
    parser.add_argument("--out", default="runs/freeze_signals", help="the traces' run folders (reused)")
    parser.add_argument("--results", default=None, help="results file (default: BENCHMARKS.md)")
    args = parser.parse_args(argv)
    rates = {optimizer: pretrain_config(optimizer, []).lr for optimizer in ("lamb", "onebitlamb", "onebitadam")}
    runs = study_runs(args.study, rates)
    cache = os.path.join(args.study, "cache")
    body = (render(collect(runs, args.out, cache), command_line(argv))
            + render_jumps(automatic_freezes(runs), rates)
            + render_plateau(plateau_rows(args.study, run_held_off(args.out, cache)))
            + render_ends(replayed_ends(runs, {key: _load(os.path.join(args.out, f"{key[0]}_seed_{key[1]}",
                                                                        "metrics.json")) for key in TRACES})))
    print(body)
    write_section("freeze signals", body, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
