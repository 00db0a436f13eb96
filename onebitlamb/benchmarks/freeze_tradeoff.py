"""Loss against bytes: 1-bit LAMB's automatic freeze beside freezes picked by hand before and after it.

    python -m onebitlamb.benchmarks.freeze_tradeoff        # demo at seeds 1238-1242, 20 runs (~2 h on 2 cores)
    python -m onebitlamb.benchmarks.freeze_tradeoff --runs demo:1238 --fractions 0.3,0.35,0.4
    python -m onebitlamb.benchmarks.freeze_tradeoff --automatic median_level --fractions 0.3 --section NAME
    python -m onebitlamb.benchmarks.freeze_tradeoff --runs b1024:1234,1235 --automatic median_level --fractions none
    python -m onebitlamb.benchmarks.freeze_tradeoff --runs demo:1235,1236 --automatic floor --section NAME
    python -m onebitlamb.benchmarks.freeze_tradeoff --list # every run: finished, to run or from step N

On ``demo`` the automatic freeze (it waits for the trust ratios' peak), with the early floor it had
by default until the floor under the wait, trails the hand-picked 35% by about half a percent of
held-out loss over nine seeds, and at most of them it froze earlier, sending fewer bytes
(docs/convergence.md). A later freeze costs bytes (each warm-up
step is a full fp32 all-reduce), so a comparison at one fraction mixes two things: how well the
automatic freeze picks its step at each seed, and how many bytes it spends. This runs, at each seed,
that automatic freeze, the same with each of the options named by ``--automatic`` (by default
``unclipped``: ``--trust-peak-layers unclipped``, the wait's median over the layers LAMB did not
clip; ``median_level``: ``--trust-peak-measure median_level``, the median of the layers' levels
instead of the median of their rises; ``floor``: ``--min-freeze-frac 0.3``, never frozen before 30%
of the steps, every default now), and 1-bit LAMB frozen by hand at each of ``--fractions`` (by default 30%,
about the automatic freeze's mean step on ``demo``, and 35%), and sets each run's loss beside its
bytes: against a fraction that sends about as much, the gap is the choice of step alone; against a
later one, it is what the extra bytes buy. The runs share the convergence study's folders
(``--out``), so the automatic freeze and the 35% reuse what ``trust_peak`` ran at the same seeds.
Writes the "freeze trade-off" section of BENCHMARKS.md and a plot of loss against bytes (``--plot``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from onebitlamb.benchmarks.convergence import (_AUTO_TRUST_PEAK, AUTO_FLOOR, AUTO_TRUST_PEAK_LEVEL,
                                               AUTO_TRUST_PEAK_UNCLIPPED, PRESETS, VARIANTS, _loss, add_run_arguments,
                                               mean_and_margin, pretrain_config, print_plan, row_at_seed, run_rows)
from onebitlamb.benchmarks.report import command_line, heading, table_row, write_section
from onebitlamb.benchmarks.targets import _mean_text
from onebitlamb.benchmarks.trust_peak import parse_runs

DEFAULT_RUNS = ["demo:1238,1239,1240,1241,1242"]
DEFAULT_FRACTIONS = (0.3, 0.35)


class Automatic(NamedTuple):
    """An automatic freeze the table sets beside the hand-picked ones."""
    variant: str      # the study's variant (VARIANTS), and so its run folder
    name: str         # in the summary's sentences
    label: str        # in the table's header
    marker: str       # in the plot
    description: str  # in the section's opening paragraph


# the automatic freeze every table sets the others against: the default until the floor under the
# wait (the tables before it call it "default"), whose runs they share with trust_peak's
BASE = Automatic(_AUTO_TRUST_PEAK, "the automatic freeze with the 5% floor", "5% floor", "*", "")
# the other automatic freezes that --automatic can set beside it (the wait's options, and the floor)
OTHERS = {
    "floor": Automatic(AUTO_FLOOR, "the automatic freeze with the 30% floor", "30% floor", "D",
                       "the same never frozen before 30% of the steps (`--min-freeze-frac 0.3`, every default "
                       "now)"),
    "unclipped": Automatic(AUTO_TRUST_PEAK_UNCLIPPED, "the unclipped one", "unclipped", "^",
                           "the same with `--trust-peak-layers unclipped` (that median over the layers whose "
                           "ratio LAMB did not clip in the window)"),
    "median_level": Automatic(AUTO_TRUST_PEAK_LEVEL, "the median-level one", "median level", "s",
                              "the same with `--trust-peak-measure median_level` (it waits for the median of the "
                              "layers' trust ratios to stop rising, not for the median of their rises)"),
}
DEFAULT_OTHERS = ("unclipped",)
_DEFAULT_AUTOMATIC = tuple(OTHERS[k] for k in DEFAULT_OTHERS)
_MARKER_NAMES = {"*": "star", "^": "triangle", "s": "square", "D": "diamond"}
REPO = Path(__file__).resolve().parents[2]
DEFAULT_PLOT = str(REPO / "docs" / "freeze_tradeoff.png")
Results = Dict[Tuple[str, str, int], dict]  # (preset, variant, seed) -> the run's metrics


def parse_fractions(text: str) -> List[float]:
    """``"0.3,0.35"`` -> ``[0.3, 0.35]``: sorted, each strictly between 0 and 1; ``"none"`` -> ``[]``
    (the automatic freezes alone, where the hand-picked ones at the same seeds are already measured)."""
    if text == "none":
        return []
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


def render(results: Results, seeds: Sequence[Tuple[str, int]], fractions: Sequence[float], command: str,
           others: Sequence[Automatic] = _DEFAULT_AUTOMATIC) -> str:
    """One row per (preset, seed): the base automatic freeze's step, loss and megabytes sent per worker,
    each of ``others``', each fraction's; then, per automatic freeze and fraction over the seeds, the one
    against the other, and each of ``others`` against the base one (``BASE``)."""
    names = [fraction_variant(f)[0] for f in fractions]
    labels = [f"{100 * f:g}%" for f in fractions]
    beside = "".join(f"{o.description}, " for o in others)
    compared = [f"{' and '.join(o.label for o in others)} against the {BASE.label}"] if others else []
    compared += ["the fraction with the lowest loss at that seed"] if fractions else []
    last = (f"The last column{'s' if len(compared) > 1 else ''}: {', and '.join(compared)}." if compared else "")
    by_hand = "and frozen by hand at fractions of the steps, " if fractions else ""
    title = "the automatic freeze and freezes picked by hand" if fractions else "the automatic freezes"
    lines = heading(f"Loss against bytes: {title}", command)
    lines += [
        "1-bit LAMB's automatic freeze (`--auto-freeze`, the study's 75% cap; it waits for the median layer's "
        "trust ratio to stop rising) with the floor it had by default before the floor under the wait "
        f"(`--min-freeze-frac 0.05`, the {BASE.label}), {beside}{by_hand}at the same seeds. Each cell: the "
        "freeze step, held-out loss at the end, megabytes sent per worker over the run"
        + (f"; a fraction's cell ends with the {BASE.label}'s loss against it." if fractions else ".")
        + (f" {last}" if last else ""),
        "",
        table_row(["preset", "seed", f"automatic, {BASE.label}", *(f"automatic, {o.label}" for o in others),
                   *labels, *(f"{o.label} vs {BASE.label}" for o in others),
                   *(["best fraction"] if fractions else [])]),
        "|---|---:|---|" + "---|" * len(others) + "---|" * len(labels) + "---:|" * len(others)
        + ("---|" if fractions else ""),
    ]
    for preset, seed in seeds:
        auto = results.get((preset, BASE.variant, seed))
        other_runs = [results.get((preset, o.variant, seed)) for o in others]
        cells, best = [], None
        for label, name in zip(labels, names):
            run = results.get((preset, name, seed))
            cells.append(_cell(run) + (f"; {_against(auto, run)}" if _finite(auto) and _finite(run) else ""))
            if _finite(run) and (best is None or run["final_eval_loss"] < best[1]):
                best = (label, run["final_eval_loss"])
        lines.append(table_row([preset, seed, _cell(auto), *(_cell(r) for r in other_runs), *cells,
                                *(_against(r, auto) if _finite(r) and _finite(auto) else "-" for r in other_runs),
                                *([best[0] if best else "-"] if fractions else [])]))
    lines.append("")
    for preset in dict.fromkeys(p for p, _ in seeds):
        lines += _summary(results, preset, [s for p, s in seeds if p == preset], labels, names, others)
    return "\n".join(lines) + "\n"


def _against(run: dict, other: dict) -> str:
    return f"{_relative(run['final_eval_loss'], other['final_eval_loss']):+.1f}%"


def _cell(run: Optional[dict]) -> str:
    if run is None:
        return "not run"
    if not _finite(run):
        return "diverged"
    return f"{run['freeze_step'] or '-'}, {_loss(run['final_eval_loss'])}, {_megabytes(run):.1f} MB"


def _comparison(results: Results, preset: str, seeds: Sequence[int], variant: str, other: str, name: str,
                other_name: str) -> Optional[str]:
    """``variant`` against ``other`` over the seeds where both ran without diverging: its loss against
    the other's (mean, standard error, 95% interval) and its bytes against the other's."""
    both = [s for s in seeds if _finite(results.get((preset, variant, s))) and _finite(results.get((preset, other, s)))]
    if not both:
        return None
    runs = [(results[(preset, variant, s)], results[(preset, other, s)]) for s in both]
    gaps = [_relative(a["final_eval_loss"], b["final_eval_loss"]) for a, b in runs]
    volume = statistics.fmean(a["bytes_sent_per_rank"] / b["bytes_sent_per_rank"] for a, b in runs)
    interval = ""
    if len(gaps) > 1:
        mean, _, margin = mean_and_margin(gaps)
        interval = f", at 95% between {mean - margin:+.1f}% and {mean + margin:+.1f}%"
    return (f"- `{preset}`, {name} against {other_name} over {_seeds(len(both))}: {_mean_text(gaps)}, no worse "
            f"at {sum(1 for g in gaps if g <= 0)}{interval}; it sent {volume:.2f}x the bytes")


def _summary(results: Results, preset: str, seeds: Sequence[int], labels: Sequence[str],
             names: Sequence[str], others: Sequence[Automatic]) -> List[str]:
    """Where each automatic freeze came; each against each fraction, and each of ``others`` against the
    base one; then each against the best fraction at each seed, which only hindsight picks."""
    lines: List[str] = []
    total = pretrain_config("onebitlamb", PRESETS[preset]).steps
    automatic = [BASE, *others]
    for a in automatic:
        steps = [r["freeze_step"] for s in seeds for r in [results.get((preset, a.variant, s))]
                 if _finite(r) and r["freeze_step"]]
        if steps:
            lines.append(f"- `{preset}`: {a.name} came at steps {min(steps)}-{max(steps)} of {total} (mean "
                         f"{statistics.fmean(steps):.0f}, {100 * statistics.fmean(steps) / total:.0f}% of the steps)")
    pairs = [(a.variant, a.name, fraction, f"the {label}") for a in automatic
             for label, fraction in zip(labels, names)]
    pairs += [(o.variant, o.name, BASE.variant, BASE.name) for o in others]
    for variant, name, other, other_name in pairs:
        line = _comparison(results, preset, seeds, variant, other, name, other_name)
        if line:
            lines.append(line)
    if len(names) > 1:
        for variant, name, *_ in automatic:
            best_gaps = []
            for s in seeds:
                fixed = [results[(preset, n, s)]["final_eval_loss"] for n in names if _finite(results.get((preset, n, s)))]
                if _finite(results.get((preset, variant, s))) and len(fixed) == len(names):
                    best_gaps.append(_relative(results[(preset, variant, s)]["final_eval_loss"], min(fixed)))
            if best_gaps:
                lines.append(f"- `{preset}`, {name} against the best of the fractions at each seed (picked in "
                             f"hindsight) over {_seeds(len(best_gaps))}: {_mean_text(best_gaps)}")
    return lines


def plot(results: Results, seeds: Sequence[Tuple[str, int]], fractions: Sequence[float], path: str,
         others: Sequence[Automatic] = _DEFAULT_AUTOMATIC) -> bool:
    """Loss (against the median fraction's at the same seed) over megabytes sent: a line through each
    seed's hand-picked freezes, the base automatic freeze as a star of the same colour, each of
    ``others`` with its own marker. False (and nothing written) when no seed has every one of these runs,
    or there is no fraction to measure against."""
    if not fractions:
        return False
    from onebitlamb.train.plots import _plt

    names = [fraction_variant(f)[0] for f in fractions]
    reference = names[len(names) // 2]
    automatic = [BASE, *others]
    complete = [(p, s) for p, s in seeds
                if all(_finite(results.get((p, n, s))) for n in names + [a.variant for a in automatic])]
    if not complete:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (preset, seed) in enumerate(complete):
        colour = f"C{k % 10}"
        base = results[(preset, reference, seed)]["final_eval_loss"]

        def point(run: dict) -> Tuple[float, float]:
            return _megabytes(run), _relative(run["final_eval_loss"], base)

        fixed = [point(results[(preset, n, seed)]) for n in names]
        ax.plot(*zip(*fixed), "o-", color=colour, label=f"{preset} seed {seed}")
        for a in automatic:
            ax.plot(*point(results[(preset, a.variant, seed)]), a.marker, color=colour, markersize=12)
        if k == len(complete) - 1:
            for fraction, xy in zip(fractions, fixed):
                ax.annotate(f"{100 * fraction:g}%", xy, textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("megabytes sent per worker over the run")
    ax.set_ylabel(f"held-out loss against the {100 * fractions[len(names) // 2]:g}% freeze (%)")
    shown = ", ".join(f"{a.label} ({_MARKER_NAMES[a.marker]})" for a in automatic)
    ax.set_title(f"1-bit LAMB: hand-picked freezes (dots), {shown}", fontsize=10)
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
                        help="the hand-picked freezes, as fractions of the steps (default: %(default)s; none: "
                             "the automatic freezes alone)")
    parser.add_argument("--automatic", nargs="*", choices=sorted(OTHERS), default=list(DEFAULT_OTHERS),
                        help="the automatic freezes to set beside the one with the 5%% floor (default: "
                             "%(default)s; none: that one alone)")
    parser.add_argument("--plot", default=DEFAULT_PLOT,
                        help="where to draw loss against bytes (default: docs/freeze_tradeoff.png in the repository)")
    add_run_arguments(parser, "run folders (shared with the study; reused)", "freeze trade-off")
    args = parser.parse_args(argv)
    try:
        seeds = parse_runs(args.runs)
        fractions = parse_fractions(args.fractions)
    except ValueError as exc:
        parser.error(str(exc))
    others = [OTHERS[k] for k in dict.fromkeys(args.automatic)]
    # seed by seed, so that a stopped benchmark leaves whole seeds behind
    rows = [row_at_seed(preset, variant, optimizer, flags, seed) for preset, seed in seeds
            for variant, optimizer, flags in [(a.variant, *VARIANTS[a.variant]) for a in [BASE, *others]]
            + [fraction_variant(f) for f in fractions]]
    if args.list:
        print_plan(rows, args.out)
        return 0
    results = run_rows(rows, args.out)
    body = render(results, seeds, fractions, command_line(argv), others)
    if plot(results, seeds, fractions, args.plot, others):
        body += f"\nPlot: `{_shown(args.plot)}`.\n"
    print(body)
    write_section(args.section, body, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
