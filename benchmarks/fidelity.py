"""Does 1-bit LAMB's stage 2 follow LAMB? Per layer, against LAMB at the same seed.

    python -m benchmarks.fidelity --preset demo --seeds 3            # LAMB and three 1-bit LAMB rows a seed
    python -m benchmarks.fidelity --preset demo --seeds 3 --rounding # and seed 1234 again, other rounding
    python -m benchmarks.fidelity --preset demo --seeds 5 --candidate-seeds 1   # the paper's rule and the live ratio at one seed
    python -m benchmarks.fidelity --preset demo --seeds 3 --list     # each run's state; runs nothing

Run from the repository root. The runs are the convergence benchmark's (``OUT/PRESET/SEED/ROW``,
reused when finished) plus one folder per candidate below. Every run records, at each diagnosis
(every ``eval_every`` steps), per layer: the coefficient it applied (LAMB's live trust ratio; 1-bit
LAMB's frozen trust ratio x factor), its factor, the relative move of one step, and the relative
move over the last 16 steps (``window_step``). A single 1-bit step is noisy by design, since every
element of a chunk is sent with one magnitude; the error feedback returns what a step leaves out
within a few steps, so the window's move is what should stay close to LAMB's.

At the diagnoses after the freeze, each row's figures over LAMB's at the same step and seed:

- **window within 0.5x-2x**: the share of layers whose median ratio of the 16-step move lies in
  [0.5, 2] (the target: 90%); the whole model's window move (layers weighted by their
  norms), median ratio;
- **one step**: the median ratio of single steps, over layers and diagnoses;
- **coefficient**: the applied coefficient over LAMB's trust ratio, median over layers at the last
  diagnosis (and the largest); **factor at the end**: median and largest over the layers;
- **held-out loss**: the paired gap to LAMB, mean over the seeds with its 95% interval (Student's
  t; shown from two seeds);
- **bytes**: the whole run's, against LAMB's.

With ``--rounding``, LAMB and the default also rerun the first seed with ``--threads 2``: the same
run but for the order of float sums, so its change of final loss is what machine noise alone does.

Writes the section ``fidelity-PRESET`` of BENCHMARKS.md, ``docs/fidelity_PRESET.png`` (per layer,
the window ratio over the steps; every row beside the paper's) and the default's paired gaps into
``onebitlamb/train/measured.json``, from which ``onebitlamb compare`` tells where a seed falls.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks import convergence
from benchmarks.report import command_line, heading, mean_interval, table_row, write_section
from onebitlamb.train.config import PRESETS, RESUMABLE_CHANGES, saved_settings
from onebitlamb.train.metrics import WINDOW_STEPS

# the candidates measured beside the paper's stage 2, each with the automatic freeze
LAMB, DEFAULT = convergence.ROWS[0], convergence.ROWS[1]  # the default: the update space
PAPER = convergence.Row("1-bit LAMB, the paper's stage 2 (momentum space)", "onebitlamb-paper",
                        [*DEFAULT.flags, "--compression-space", "momentum"])
UPDATE_LIVE = convergence.Row("1-bit LAMB, update space, live trust ratio", "onebitlamb-update-live",
                              [*DEFAULT.flags, "--compression-space", "update", "--trust-ratio-after-freeze", "live"])
ROWS = [LAMB, PAPER, DEFAULT, UPDATE_LIVE]
# rows that --candidate-seeds may run at fewer seeds than LAMB and the default: both strayed from LAMB
# layer by layer at the first seeds (48% and 71% of the layers within the band), so the seeds go to
# the default's paired gap
CANDIDATES = [PAPER, UPDATE_LIVE]
BAND = (0.5, 2.0)

def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b and b > 0 else None


def _whole_model_move(layers: List[dict]) -> Optional[float]:
    """The model's relative window move, the layers weighted by their norms."""
    if any(l.get("window_step") is None or l.get("norm") is None for l in layers):
        return None
    moved = math.sqrt(sum((l["window_step"] * l["norm"]) ** 2 for l in layers))
    size = math.sqrt(sum(l["norm"] ** 2 for l in layers))
    return moved / size if size > 0 else None


def paired_diagnoses(run: dict, lamb: dict) -> List[Tuple[dict, dict]]:
    """The run's diagnoses in its compression stage, each with LAMB's at the same step."""
    by_step = {d["step"]: d for d in lamb["diagnostics"]}
    freeze = run.get("freeze_step")
    return [(d, by_step[d["step"]]) for d in run["diagnostics"]
            if freeze is not None and d["step"] > freeze and d["step"] in by_step]


def fidelity(run: dict, lamb: dict) -> dict:
    """One run's figures against LAMB's at the same seed (see the module's docstring)."""
    pairs = paired_diagnoses(run, lamb)
    names = [l["name"] for l in run["diagnostics"][0]["layers"]]
    window: Dict[str, List[float]] = {n: [] for n in names}
    steps_ratio, whole, curves = [], [], {n: [] for n in names}
    for d, ref in pairs:
        for l, r in zip(d["layers"], ref["layers"]):
            w = _ratio(l.get("window_step"), r.get("window_step"))
            if w is not None:
                window[l["name"]].append(w)
                curves[l["name"]].append((d["step"], w))
            s = _ratio(l.get("rel_step"), r.get("rel_step"))
            if s is not None:
                steps_ratio.append(s)
        w = _ratio(_whole_model_move(d["layers"]), _whole_model_move(ref["layers"]))
        if w is not None:
            whole.append(w)
    per_layer = {n: statistics.median(v) for n, v in window.items() if v}
    inside = [BAND[0] <= v <= BAND[1] for v in per_layer.values()]
    last, last_ref = pairs[-1] if pairs else (None, None)
    coeff = [c for c in (_ratio(l.get("trust_ratio"), r.get("trust_ratio"))
                         for l, r in zip(last["layers"], last_ref["layers"])) if c is not None] if last else []
    factors = [l["factor"] for l in last["layers"] if l.get("factor") is not None] if last else []
    return {"layers_inside": sum(inside) / len(inside) if inside else None,
            "whole_window": statistics.median(whole) if whole else None,
            "one_step": statistics.median(steps_ratio) if steps_ratio else None,
            "coeff_median": statistics.median(coeff) if coeff else None, "coeff_max": max(coeff, default=None),
            "factor_median": statistics.median(factors) if factors else None,
            "factor_max": max(factors, default=None),
            "gap": 100 * (run["final_eval_loss"] / lamb["final_eval_loss"] - 1),
            "bytes": run["bytes_sent_per_rank"] / lamb["bytes_sent_per_rank"], "curves": curves}


def _fmt(values: Sequence[Optional[float]], form: str) -> str:
    values = [v for v in values if v is not None]
    return format(statistics.mean(values), form) if values else "-"


def row_seeds(row: convergence.Row, seeds: Sequence[int], candidate_seeds: int) -> List[int]:
    return list(seeds[:candidate_seeds]) if row in CANDIDATES else list(seeds)


def render(preset: str, seeds: Sequence[int], figures: Dict[Tuple[str, int], dict], command: str) -> str:
    lines = [*heading(f"Stage 2 against LAMB, layer by layer: {preset}", command),
             f"Seeds {', '.join(map(str, seeds))} of `onebitlamb pretrain --preset {preset}`; every row against LAMB "
             f"at the same seed, at the diagnoses after the row's freeze (`python -m benchmarks.fidelity --help` "
             f"defines each column). Window: the relative move over {WINDOW_STEPS} steps (fewer where `eval_every` "
             f"is smaller); a ratio of 1 is LAMB's. Figures other than the gap are means over the seeds.", "",
             table_row(["row", "seeds", "gap to LAMB, mean ± 95%", "layers whose window is 0.5x-2x LAMB's",
                        "whole model's window / LAMB's", "one step / LAMB's", "coefficient / LAMB's trust ratio "
                        "at the end (largest)", "factor at the end (largest)", "bytes / LAMB's"]),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in ROWS[1:]:
        runs = [figures[row.name, s] for s in seeds if (row.name, s) in figures]
        if not runs:  # a candidate left out (--candidate-seeds 0)
            continue
        mean, half = mean_interval([f["gap"] for f in runs])
        gap = f"{mean:+.2f}%" + (f" ± {half:.2f}" if half is not None else "")
        lines.append(table_row([
            row.name, len(runs), gap, _fmt([100 * f["layers_inside"] for f in runs if f["layers_inside"] is not None], ".0f") + "%",
            _fmt([f["whole_window"] for f in runs], ".2f") + "x", _fmt([f["one_step"] for f in runs], ".1f") + "x",
            f"{_fmt([f['coeff_median'] for f in runs], '.2f')} ({_fmt([f['coeff_max'] for f in runs], '.2f')})",
            f"{_fmt([f['factor_median'] for f in runs], '.2f')} ({_fmt([f['factor_max'] for f in runs], '.2f')})",
            _fmt([f["bytes"] for f in runs], ".3f") + "x"]))
    return "\n".join(lines) + "\n"


ROUNDING_FLAGS = ["--threads", "2"]
ROUNDING_ROWS = [LAMB, DEFAULT]  # the baseline and what a user gets


def rounding_row(row: convergence.Row) -> convergence.Row:
    """The row rerun with a change that moves only the rounding."""
    return convergence.Row(row.name, row.folder + "-threads2", [*row.flags, *ROUNDING_FLAGS])


def render_rounding(seed: int, runs: Dict[str, Tuple[dict, dict]]) -> str:
    lines = ["", f"Rounding alone: seed {seed} again with `{' '.join(ROUNDING_FLAGS)}` (the order of float sums "
                 f"changes, nothing else).", "",
             table_row(["row", "held-out loss", f"with {' '.join(ROUNDING_FLAGS)}", "change"]), "|---|---:|---:|---:|"]
    for name, (run, rerun) in runs.items():
        a, b = run["final_eval_loss"], rerun["final_eval_loss"]
        lines.append(table_row([name, f"{a:.4f}", f"{b:.4f}", f"{100 * (b / a - 1):+.2f}%"]))
    return "\n".join(lines) + "\n"


MEASURED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "onebitlamb", "train",
                        "measured.json")


def write_measured(preset: str, seeds: Sequence[int], runs: Dict[Tuple[str, int], dict], command: str,
                   path: str = MEASURED) -> None:
    """The default 1-bit LAMB's paired gaps to LAMB on ``preset``, for ``onebitlamb compare`` to say
    where a user's seed falls (``onebitlamb/train/measured.json``, shipped with the package), with
    the settings they hold for, the seed and what does not change the numbers left out."""
    try:
        with open(path) as f:
            measured = json.load(f)
    except FileNotFoundError:
        measured = {}
    gaps = [100 * (runs[DEFAULT.name, s]["final_eval_loss"] / runs[LAMB.name, s]["final_eval_loss"] - 1)
            for s in seeds]
    mean, half = mean_interval(gaps)
    ignored = RESUMABLE_CHANGES | {"seed", "optimizer", "ckpt_every"}
    measured[preset] = {"onebitlamb": {
        "command": command, "seeds": list(seeds), "gaps_pct": gaps, "mean_pct": mean, "half_width_pct": half,
        "settings": {k: v for k, v in saved_settings(runs[DEFAULT.name, seeds[0]]["config"]).items()
                     if k not in ignored}}}
    with open(path, "w") as f:
        json.dump(measured, f, indent=1, sort_keys=True)
        f.write("\n")


def plot(preset: str, seed: int, figures: Dict[Tuple[str, int], dict], path: str) -> None:
    """Per row (a panel each), every layer's window ratio over the steps at one seed, and their median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in ROWS[1:] if (row.name, seed) in figures]
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.2), sharey=True, squeeze=False)
    for ax, row in zip(axes[0], rows):
        curves = figures[row.name, seed]["curves"]
        by_step: Dict[int, List[float]] = {}
        for points in curves.values():
            if points:
                ax.plot(*zip(*points), color="0.6", lw=0.6, alpha=0.6, marker=".", ms=2)
            for step, r in points:
                by_step.setdefault(step, []).append(r)
        steps = sorted(by_step)
        ax.plot(steps, [statistics.median(by_step[s]) for s in steps], color="C3", lw=2, marker="o",
                label="median layer")
        ax.axhspan(*BAND, color="C2", alpha=0.12, label="0.5x-2x")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(row.name, fontsize=10)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("16-step move / LAMB's (per layer)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{preset}, seed {seed}: how far each layer moves over 16 steps, against LAMB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="demo", help="default: %(default)s")
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {convergence.FIRST_SEED} up")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"), help="the runs' folder")
    parser.add_argument("--list", action="store_true", help="print each run's state and run nothing")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    parser.add_argument("--candidate-seeds", type=int, default=None, metavar="N",
                        help="run the candidates that lost at the first seeds (the paper's rule, the live trust "
                             "ratio) at the first N seeds only, 0 for none (default: all)")
    parser.add_argument("--rounding", action="store_true",
                        help=f"also rerun the first seed of LAMB and the default with {' '.join(ROUNDING_FLAGS)}")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    seeds = list(range(convergence.FIRST_SEED, convergence.FIRST_SEED + args.seeds))
    if args.candidate_seeds is not None and args.candidate_seeds < 0:
        parser.error(f"--candidate-seeds must be 0 or more, got {args.candidate_seeds}")
    candidate_seeds = args.seeds if args.candidate_seeds is None else args.candidate_seeds
    folders = {(row.name, s): convergence.run_folder(args.out, args.preset, s, row)
               for row in ROWS for s in row_seeds(row, seeds, candidate_seeds)}
    if args.list:
        for (name, seed), folder in folders.items():
            print(f"{folder:<50} {convergence.run_state(folder)}")
        return 0
    runs = {key: convergence.run_one(folder, convergence.pretrain_args(args.preset, key[1], row),
                                     os.path.join(args.out, "cache"))
            for row in ROWS for key, folder in folders.items() if key[0] == row.name}
    figures = {(row.name, s): fidelity(runs[row.name, s], runs[LAMB.name, s])
               for row in ROWS[1:] for s in row_seeds(row, seeds, candidate_seeds)}
    body = render(args.preset, seeds, figures, command_line(argv))
    if args.rounding:
        cache, seed = os.path.join(args.out, "cache"), seeds[0]
        body += render_rounding(seed, {row.name: (runs[row.name, seed], convergence.run_one(
            convergence.run_folder(args.out, args.preset, seed, rounding_row(row)),
            convergence.pretrain_args(args.preset, seed, rounding_row(row)), cache)) for row in ROUNDING_ROWS})
    print("\n" + body)
    if not args.no_write:
        write_section(f"fidelity-{args.preset}", body)
        write_measured(args.preset, seeds, runs, command_line(argv))
        path = os.path.join("docs", f"fidelity_{args.preset}.png")
        plot(args.preset, seeds[0], figures, path)
        print(f"wrote BENCHMARKS.md and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
