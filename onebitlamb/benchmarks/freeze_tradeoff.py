"""Loss against bytes: 1-bit LAMB's automatic freeze beside freezes picked by hand before and after it.

    python -m onebitlamb.benchmarks.freeze_tradeoff        # demo at seeds 1238-1242, 20 runs (~95 min on 2 cores)
    python -m onebitlamb.benchmarks.freeze_tradeoff --runs demo:1238 --fractions 0.3,0.35
    python -m onebitlamb.benchmarks.freeze_tradeoff --list # every run: finished, to run or from step N

On ``demo`` the automatic freeze (every default: it waits for the trust ratios' peak) trails the
hand-picked 35% by about half a percent of held-out loss over nine seeds, and at most of them it
froze earlier, sending fewer bytes (docs/convergence.md). A later freeze costs bytes (each warm-up
step is a full fp32 all-reduce), so a comparison at one fraction mixes two things: how well the
automatic freeze picks its step at each seed, and how many bytes it spends. This runs, at each seed,
the automatic freeze and 1-bit LAMB frozen by hand at each of ``--fractions`` (by default 30%, about
the automatic freeze's mean step on ``demo``; 35%; 40%), and sets each run's loss beside its bytes:
against a fraction that sends about as much, the gap is the choice of step alone; against the later
ones, it is what the extra bytes buy. The runs share the convergence study's folders (``--out``), so
the automatic freeze and the 35% reuse what ``trust_peak`` ran at the same seeds. Writes the
"freeze trade-off" section of BENCHMARKS.md and a plot of loss against bytes (``--plot``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from onebitlamb.benchmarks.convergence import (_AUTO_TRUST_PEAK, PRESETS, VARIANTS, _loss, add_run_arguments,
                                               mean_and_margin, pretrain_config, print_plan, row_at_seed,
                                               run_rows)
from onebitlamb.benchmarks.report import command_line, heading, write_section
from onebitlamb.benchmarks.targets import _mean_text
from onebitlamb.benchmarks.trust_peak import parse_runs

DEFAULT_RUNS = ["demo:1238,1239,1240,1241,1242"]
DEFAULT_FRACTIONS = (0.3, 0.35, 0.4)
REPO = Path(__file__).resolve().parents[2]
DEFAULT_PLOT = str(REPO / "docs" / "freeze_tradeoff.png")
Results = Dict[Tuple[str, str, int], dict]  # (preset, variant, seed) -> the run's metrics


def parse_fractions(text: str) -> List[float]:
    """``"0.3,0.35"`` -> ``[0.3, 0.35]``: sorted, each strictly between 0 and 1."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0.0 < v < 1.0 for v in values):
        raise ValueError(f"invalid fractions {text!r}: comma-separated numbers strictly between 0 and 1")
    return sorted(set(values))


def fraction_variant(fraction: float) -> Tuple[str, str, List[str]]:
    """1-bit LAMB frozen by hand at ``fraction`` of the steps: the study's variant where it has one
    (so that "1bit-lamb freeze 35%" shares its run folder with the study, the targets and trust_peak)."""
    name = f"1bit-lamb freeze {100 * fraction:g}%"
    optimizer, flags = VARIANTS.get(name, ("onebitlamb", ["--freeze-frac", repr(fraction)]))
    return name, optimizer, flags


def _relative(a: float, b: float) -> float:
    return 100 * (a / b - 1)


def _megabytes(run: dict) -> float:
    return run["bytes_sent_per_rank"] / 1e6


def _seeds(n: int) -> str:
    return f"{n} seed" + ("" if n == 1 else "s")


def _finite(run: Optional[dict]) -> bool:
    return run is not None and run["final_eval_loss"] == run["final_eval_loss"]


def render(results: Results, seeds: Sequence[Tuple[str, int]], fractions: Sequence[float], command: str) -> str:
    """One row per (preset, seed): the automatic freeze's step, loss and megabytes sent per worker, each
    fraction's; then, per fraction over the seeds, the automatic freeze against it and their bytes."""
    names = [fraction_variant(f)[0] for f in fractions]
    labels = [f"{100 * f:g}%" for f in fractions]
    lines = heading("Loss against bytes: the automatic freeze and freezes picked by hand", command)
    lines += [
        "1-bit LAMB with every default (`--auto-freeze`, the study's 75% cap; it waits for the trust ratios' "
        "peak) and frozen by hand at fractions of the steps, at the same seeds. Each cell: the freeze step, "
        "held-out loss at the end, megabytes sent per worker over the run; a fraction's cell ends with the "
        "automatic freeze's loss against it. The last column: the fraction with the lowest loss at that seed.",
        "",
        "| preset | seed | automatic | " + " | ".join(labels) + " | best fraction |",
        "|---|---:|---|" + "---|" * len(labels) + "---|",
    ]
    for preset, seed in seeds:
        auto = results.get((preset, _AUTO_TRUST_PEAK, seed))
        cells, best = [], None
        for label, name in zip(labels, names):
            run = results.get((preset, name, seed))
            cells.append(_cell(run) + (f"; {_relative(auto['final_eval_loss'], run['final_eval_loss']):+.1f}%"
                                       if _finite(auto) and _finite(run) else ""))
            if _finite(run) and (best is None or run["final_eval_loss"] < best[1]):
                best = (label, run["final_eval_loss"])
        lines.append(f"| {preset} | {seed} | {_cell(auto)} | " + " | ".join(cells)
                     + f" | {best[0] if best else '-'} |")
    lines.append("")
    for preset in dict.fromkeys(p for p, _ in seeds):
        lines += _summary(results, preset, [s for p, s in seeds if p == preset], labels, names)
    return "\n".join(lines) + "\n"


def _cell(run: Optional[dict]) -> str:
    if run is None:
        return "not run"
    if not _finite(run):
        return "diverged"
    return f"{run['freeze_step'] or '-'}, {_loss(run['final_eval_loss'])}, {_megabytes(run):.1f} MB"


def _summary(results: Results, preset: str, seeds: Sequence[int], labels: Sequence[str],
             names: Sequence[str]) -> List[str]:
    """Per fraction, over the seeds where it and the automatic freeze both ran without diverging: the
    automatic freeze's loss against it (mean, standard error, 95% interval) and its bytes against the
    fraction's; then against the best fraction at each seed, which only hindsight picks."""
    lines: List[str] = []
    autos = {s: results.get((preset, _AUTO_TRUST_PEAK, s)) for s in seeds}
    steps = [a["freeze_step"] for a in autos.values() if _finite(a) and a["freeze_step"]]
    if steps:
        total = pretrain_config("onebitlamb", PRESETS[preset]).steps
        lines.append(f"- `{preset}`: the automatic freeze came at steps {min(steps)}-{max(steps)} of {total} "
                     f"(mean {statistics.fmean(steps):.0f}, {100 * statistics.fmean(steps) / total:.0f}% of the steps)")
    for label, name in zip(labels, names):
        both = [s for s in seeds if _finite(autos[s]) and _finite(results.get((preset, name, s)))]
        if not both:
            continue
        gaps = [_relative(autos[s]["final_eval_loss"], results[(preset, name, s)]["final_eval_loss"]) for s in both]
        volume = statistics.fmean(autos[s]["bytes_sent_per_rank"] / results[(preset, name, s)]["bytes_sent_per_rank"]
                                  for s in both)
        no_worse = sum(1 for g in gaps if g <= 0)
        interval = ""
        if len(gaps) > 1:
            mean, _, margin = mean_and_margin(gaps)
            interval = f", at 95% between {mean - margin:+.1f}% and {mean + margin:+.1f}%"
        lines.append(f"- `{preset}`, the automatic freeze against the {label} over {_seeds(len(both))}: "
                     f"{_mean_text(gaps)}, no worse at {no_worse}{interval}; it sent {volume:.2f}x the "
                     f"{label}'s bytes")
    best_gaps = []
    for s in seeds:
        fixed = [results[(preset, n, s)]["final_eval_loss"] for n in names if _finite(results.get((preset, n, s)))]
        if _finite(autos[s]) and len(fixed) == len(names):
            best_gaps.append(_relative(autos[s]["final_eval_loss"], min(fixed)))
    if best_gaps and len(names) > 1:
        lines.append(f"- `{preset}`, the automatic freeze against the best of the fractions at each seed (picked "
                     f"in hindsight) over {_seeds(len(best_gaps))}: {_mean_text(best_gaps)}")
    return lines


def plot(results: Results, seeds: Sequence[Tuple[str, int]], fractions: Sequence[float], path: str) -> bool:
    """Loss (against the median fraction's at the same seed) over megabytes sent: a line through each
    seed's hand-picked freezes, the automatic freeze as a star of the same colour. False (and nothing
    written) when no seed has the automatic freeze and every fraction."""
    from onebitlamb.train.plots import _plt

    names = [fraction_variant(f)[0] for f in fractions]
    reference = names[len(names) // 2]
    complete = [(p, s) for p, s in seeds
                if all(_finite(results.get((p, n, s))) for n in names + [_AUTO_TRUST_PEAK])]
    if not complete:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (preset, seed) in enumerate(complete):
        colour = f"C{k % 10}"
        base = results[(preset, reference, seed)]["final_eval_loss"]
        fixed = [results[(preset, n, seed)] for n in names]
        ax.plot([_megabytes(r) for r in fixed], [_relative(r["final_eval_loss"], base) for r in fixed], "o-",
                color=colour, label=f"{preset} seed {seed}")
        auto = results[(preset, _AUTO_TRUST_PEAK, seed)]
        ax.plot([_megabytes(auto)], [_relative(auto["final_eval_loss"], base)], "*", color=colour, markersize=14)
    for fraction, run in zip(fractions, fixed):
        ax.annotate(f"{100 * fraction:g}%", (_megabytes(run), _relative(run["final_eval_loss"], base)),
                    textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("megabytes sent per worker over the run")
    ax.set_ylabel(f"held-out loss against the {100 * fractions[len(names) // 2]:g}% freeze (%)")
    ax.set_title("1-bit LAMB: hand-picked freezes (dots) and the automatic freeze (star)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _shown(path: str) -> str:
    """``path`` as the results file names it: from the repository's root when it lies inside it."""
    inside = os.path.abspath(path).startswith(str(REPO) + os.sep)
    return os.path.relpath(os.path.abspath(path), REPO) if inside else path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onebitlamb.benchmarks.freeze_tradeoff",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, metavar="PRESET:SEED,...",
                        help=f"presets and seeds (default: {' '.join(DEFAULT_RUNS)})")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                        help="the hand-picked freezes, as fractions of the steps (default: %(default)s)")
    parser.add_argument("--plot", default=DEFAULT_PLOT,
                        help="where to draw loss against bytes (default: docs/freeze_tradeoff.png in the repository)")
    add_run_arguments(parser, "run folders (shared with the study; reused)", "freeze trade-off")
    args = parser.parse_args(argv)
    try:
        seeds = parse_runs(args.runs)
        fractions = parse_fractions(args.fractions)
    except ValueError as exc:
        parser.error(str(exc))
    # seed by seed, so that a stopped benchmark leaves whole seeds behind
    rows = [row_at_seed(preset, variant, optimizer, flags, seed) for preset, seed in seeds
            for variant, optimizer, flags in [(_AUTO_TRUST_PEAK, *VARIANTS[_AUTO_TRUST_PEAK])]
            + [fraction_variant(f) for f in fractions]]
    if args.list:
        print_plan(rows, args.out)
        return 0
    results = run_rows(rows, args.out)
    body = render(results, seeds, fractions, command_line(argv))
    if plot(results, seeds, fractions, args.plot):
        body += f"\nPlot: `{_shown(args.plot)}`.\n"
    print(body)
    write_section(args.section, body, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
