"""The convergence targets with the defaults: the check to run first after a change.

    python -m onebitlamb.benchmarks.targets                  # every run at seed 1234 (~2.5 h on 2 cores)
    python -m onebitlamb.benchmarks.targets --seeds b4096:3  # and b4096's runs at 2 more seeds
    python -m onebitlamb.benchmarks.targets --list           # every run: finished, to run or from step N

The full convergence study (``python -m onebitlamb.benchmarks.convergence``, docs/convergence.md)
takes most of a day with its sweeps and seeds. This runs the part of it that the issue's targets
are about, at the main job's seed: on every preset LAMB and 1-bit LAMB with the automatic freeze
and every default (the study's 75% cap, so that the criterion decides: "within 1% of LAMB, no
divergence, and the volume reduction next to it"); on ``b4096`` 1-bit Adam with the automatic
freeze too ("1-bit LAMB ahead of 1-bit Adam at a batch of 4K"); on ``b1024`` the hand-picked 20% and
35% freezes ("as good as the best hand-picked fraction", the target still open there; the best of
the two is the one with the lower mean loss over the seeds run). One seed cannot
settle the last two (docs/convergence.md), so ``--seeds PRESET:N`` repeats a preset's runs at N
seeds in all and judges by the mean over them; its tables also show where the runs stood before the
last quarter of the run, and on ``b1024`` how large the compressed steps were. The runs are the
study's own rows, in its folders (``--out`` is shared with it by default; more seeds are its
``--seeds`` rows), so each benchmark reuses what the other has run.
Results go to the "targets" section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from onebitlamb.benchmarks.convergence import (_ADAM, _ADAM_AUTO, DEFAULT_AUTO, DEFAULT_SEED, PRESETS, VARIANTS, Row, _gap, _loss,
                                               add_run_arguments, mean_and_margin, parse_seeds, pretrain_config,
                                               print_plan, row_at_seed, run_rows)
from onebitlamb.benchmarks.freeze_signals import frozen_coefficient, stage2_steps
from onebitlamb.benchmarks.report import command_line, heading, write_section

# b1024's hand-picked freezes: the paper's 20%, the best on the version-2 corpus, and 35%, the best
# on version 3 (docs/convergence.md)
HAND_PICKED = "1bit-lamb freeze 20%"
HAND_PICKED_LATE = "1bit-lamb freeze 35%"
# preset -> the study's variants this check runs there (LAMB and the default automatic freeze first)
CHECKS: Dict[str, List[str]] = {
    "b512": ["lamb", DEFAULT_AUTO],
    "demo": ["lamb", DEFAULT_AUTO],
    "b4096": ["lamb", DEFAULT_AUTO, _ADAM_AUTO, _ADAM],
    "b1024": ["lamb", DEFAULT_AUTO, HAND_PICKED, HAND_PICKED_LATE],
}
WITHIN = 0.01  # the target: at most 1% above LAMB's held-out loss


class Comparison(NamedTuple):
    """A target that sets the automatic freeze against another run of the same preset."""
    other: str       # the variant it is set against (one of CHECKS' after the first two)
    name: str        # what the tables call that run
    claim: str       # the target, as its verdict words it
    strict: bool     # the automatic freeze must end below it (ahead), not only no higher (as good)
    # the other run without its compression (Adam for 1-bit Adam): splits the order into the
    # uncompressed optimizers' order and what each compression costs
    uncompressed: Optional[str] = None
    uncompressed_name: str = ""


COMPARISONS: List[Tuple[str, Comparison]] = [
    ("b4096", Comparison(_ADAM_AUTO, "1-bit Adam auto", "1-bit LAMB ahead of 1-bit Adam", strict=True,
                         uncompressed=_ADAM, uncompressed_name="Adam")),
    ("b1024", Comparison(HAND_PICKED, "hand-picked 20%", "the automatic freeze as good as the hand-picked 20%",
                         strict=False)),
    ("b1024", Comparison(HAND_PICKED_LATE, "hand-picked 35%", "the automatic freeze as good as the hand-picked 35%",
                         strict=False)),
]
# preset -> the hand-picked freezes among its comparisons, of which the target names the best
HAND_PICKED_OF: Dict[str, List[str]] = {"b1024": [HAND_PICKED, HAND_PICKED_LATE]}
Results = Dict[Tuple[str, str, int], dict]  # (preset, variant, seed) -> the run's metrics


def runs(seeds: Optional[Dict[str, int]] = None) -> List[Row]:
    """The runs in the order they run: every preset at the main job's seed (the short presets first),
    then the presets ``seeds`` repeats (see ``parse_seeds``), seed by seed."""
    order = [row_at_seed(preset, variant, *VARIANTS[variant]) for preset, variants in CHECKS.items()
             for variant in variants]
    for preset, count in (seeds or {}).items():
        order += [row_at_seed(preset, variant, *VARIANTS[variant], seed)
                  for seed in range(DEFAULT_SEED + 1, DEFAULT_SEED + count) for variant in CHECKS[preset]]
    return order


def _freeze(metrics: dict, preset: str) -> str:
    """The automatic freeze's step, marked where the cap made it rather than the criterion."""
    step = metrics.get("freeze_step")
    if not step:
        return "-"
    optimizer, flags = VARIANTS[DEFAULT_AUTO]
    cap = pretrain_config(optimizer, PRESETS[preset] + flags).freeze_step  # with --auto-freeze: the latest
    return f"{step} (the cap)" if step == cap else str(step)


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _vs(loss: float, ref: float) -> str:
    return _gap(loss, ref) if loss == loss else "diverged"


def _within(auto: dict, lamb: dict) -> bool:
    return auto["final_eval_loss"] <= (1 + WITHIN) * lamb["final_eval_loss"]  # False for NaN: a divergence


def _three_quarters(metrics: dict) -> Optional[Tuple[int, float]]:
    """(step, held-out loss) of the last evaluation at or before three quarters of the run: where a
    run stood before the learning rate's last quarter of decay, where on ``b1024`` the order of two
    runs can still change."""
    points = [(samples, loss) for samples, loss in metrics.get("eval_curve") or []
              if samples <= 0.75 * metrics["samples"]]
    if not points:
        return None
    samples, loss = points[-1]
    return round(samples * metrics["steps"] / metrics["samples"]), loss


def _stage2_step(metrics: dict) -> str:
    """The median layer's relative step per unit learning rate after the freeze, the highest over the
    diagnosed steps (LAMB's is about 1): how much larger than LAMB's the compressed steps were."""
    steps = stage2_steps(metrics)
    return f"{steps[3]:.1f}" if steps else "-"


def _seeds(results: Results, preset: str) -> List[int]:
    return sorted(seed for (p, variant, seed) in results if p == preset and variant == DEFAULT_AUTO)


def _comparison(results: Results, preset: str, target: Comparison) -> Tuple[List[str], List[str]]:
    """The automatic freeze against ``target.other`` at every seed the preset ran: the per-seed table
    (more than one seed) and the verdict's bullet. With one seed the verdict is that seed's; with more,
    it rests on the mean of the per-seed differences and its standard error: "ahead" is met where the
    seeds settle the mean below zero (``settling_factor``: Student's t at 95%, 3.18 errors at four
    seeds), "as good" where it is at or below zero, either is not met where the seeds settle it on the
    wrong side, and "not settled" in between.
    A divergence of the automatic freeze loses the target; the other run's diverging counts as a seed
    the automatic freeze won, outside the mean."""
    seeds = _seeds(results, preset)
    table, differences, won, auto_diverged, then_step = [], [], 0, False, None
    both_lamb = VARIANTS[target.other][0] == "onebitlamb"  # so that their step sizes compare
    for seed in seeds:
        lamb, auto, other = (results[(preset, v, seed)] for v in ("lamb", DEFAULT_AUTO, target.other))
        ours, theirs = auto["final_eval_loss"], other["final_eval_loss"]
        ours_then, theirs_then = _three_quarters(auto), _three_quarters(other)
        if ours_then and theirs_then and ours_then[0] == theirs_then[0]:
            then_step = ours_then[0]
            finite = ours_then[1] == ours_then[1] and theirs_then[1] == theirs_then[1]  # NaN: diverged by then
            then = f" {_gap(ours_then[1], theirs_then[1]) if finite else 'a run diverged'} |"
        else:
            then = " - |"
        sizes = f" {_stage2_step(auto)} / {_stage2_step(other)} |" if both_lamb else ""
        if ours != ours:
            auto_diverged, cell = True, "auto diverged"
        elif theirs != theirs:
            won, cell = won + 1, f"{target.name} diverged"
        else:
            differences.append(100 * (ours / theirs - 1))
            won += ours < theirs if target.strict else ours <= theirs
            cell = f"{differences[-1]:+.1f}%"
        plain = ""
        if target.uncompressed:
            loss = results[(preset, target.uncompressed, seed)]["final_eval_loss"]
            plain = f" {_loss(loss)}, {_vs(loss, lamb['final_eval_loss'])} |"
        table.append(f"| {seed} | {_loss(lamb['final_eval_loss'])} | {_freeze(auto, preset)}, {_loss(ours)}, "
                     f"{_vs(ours, lamb['final_eval_loss'])} | {other.get('freeze_step') or '-'}, {_loss(theirs)}, "
                     f"{_vs(theirs, lamb['final_eval_loss'])} |{plain}{then}{sizes} {cell} |")
    if len(seeds) == 1:  # the loop's last (only) seed decides: won it or not
        return [], [f"- `{preset}`: the automatic freeze {_loss(ours)} against {target.name} (step "
                    f"{other.get('freeze_step')}) {_loss(theirs)}"
                    + (f", {_gap(ours, theirs)}" if ours == ours and theirs == theirs else "")
                    + f": {target.claim}: {_met(won == 1)} at this one seed (one seed cannot settle it: `--seeds "
                    f"{preset}:N`)." + _split(results, preset, target, seeds)]
    plain = f" {target.uncompressed_name}: loss, vs LAMB |" if target.uncompressed else ""
    sizes = " stage-2 step: auto / it |" if both_lamb else ""
    table = ["", f"`{preset}` at {len(seeds)} seeds. Last column: the automatic freeze against {target.name} at "
                 "the end, negative where the automatic freeze is ahead. \"auto vs it\" before it: the same at the "
                 "last evaluation before the run's last quarter" + (f" (step {then_step})" if then_step else "")
                 + ", in which the learning rate decays to 0."
                 + (" Stage-2 step: the median layer's relative step per unit learning rate after the freeze, the "
                    "highest at the diagnosed steps (LAMB's is about 1)." if both_lamb else ""), "",
             f"| seed | LAMB | 1-bit LAMB auto: freeze, loss, vs LAMB | {target.name}: freeze, loss, vs LAMB |"
             f"{plain} auto vs it {f'at step {then_step}' if then_step else 'three quarters in'} |{sizes} auto vs it |",
             "|---:|---:|---|---|" + ("---|" if plain else "") + "---:|" + ("---|" if both_lamb else "") + "---:|",
             *table]
    if len(differences) >= 2:
        mean, _, margin = mean_and_margin(differences)
        average = _mean_text(differences)
    else:  # the other run diverged at all seeds but one or none: those seeds decide
        mean, margin = (differences[0] if differences else -math.inf), 0.0
        average = "too few seeds with both runs for a mean"
    good = mean < 0 if target.strict else mean <= 0
    if auto_diverged or (not good and mean > margin):
        verdict = _met(False)
    elif good and (not target.strict or mean < -margin):
        verdict = _met(True)
    else:  # "ahead" on a mean the seeds do not settle, or "as good" behind within their spread
        verdict = "**not settled**"
    return table, [f"- `{preset}`: {target.claim}: {verdict} over {len(seeds)} seeds: the automatic freeze "
                   f"{'ahead' if target.strict else 'no worse'} at {won} of {len(seeds)}, {average}."
                   + _split(results, preset, target, seeds)]


def _mean_text(values: Sequence[float], unit: str = "%") -> str:
    """One seed's value, or the mean over seeds with its standard error and whether the seeds settle
    its sign (at 95%, two-sided: ``settling_factor`` standard errors from zero)."""
    if len(values) == 1:
        return f"{values[0]:+.1f}{unit}"
    mean, error, margin = mean_and_margin(values)
    settled = "the seeds settle it" if abs(mean) > margin else "within the seeds' spread"
    return f"mean {mean:+.1f}{unit} ± {error:.1f} (standard error; {settled})"


def _split(results: Results, preset: str, target: Comparison, seeds: Sequence[int]) -> str:
    """Where the order of the two compressed runs comes from, at the seeds none of the four diverged:
    1-bit LAMB / 1-bit Adam = (LAMB / Adam) x (1-bit LAMB / LAMB) / (1-bit Adam / Adam), the order
    of the uncompressed optimizers and what each compression costs."""
    if not target.uncompressed:
        return ""
    orders, lamb_costs, other_costs = [], [], []
    for seed in seeds:
        lamb, auto, other, plain = (results[(preset, v, seed)]["final_eval_loss"]
                                    for v in ("lamb", DEFAULT_AUTO, target.other, target.uncompressed))
        if all(loss == loss for loss in (lamb, auto, other, plain)):
            orders.append(100 * (lamb / plain - 1))
            lamb_costs.append(100 * (auto / lamb - 1))
            other_costs.append(100 * (other / plain - 1))
    if not orders:
        return " (A run diverged at every seed: no split of the order.)"
    name = target.uncompressed_name
    return (f" Where the order comes from ({len(orders)} of {len(seeds)} seeds, none diverged): LAMB against "
            f"{name}, both uncompressed, {_mean_text(orders)}; what the compression costs, 1-bit LAMB against LAMB "
            f"{_mean_text(lamb_costs)}, {target.name} against {name} {_mean_text(other_costs)}; the first cost "
            f"less the second {_mean_text([a - b for a, b in zip(lamb_costs, other_costs)], ' points')}.")


def _percent_against_lamb(results: Results, preset: str, variant: str, seed: int) -> float:
    """A run's final loss against LAMB's at the same seed, in percent (NaN for a divergence)."""
    loss, lamb = (results[(preset, v, seed)]["final_eval_loss"] for v in (variant, "lamb"))
    return 100 * (loss / lamb - 1)


def _best_hand_picked(results: Results, preset: str) -> str:
    """The verdict's bullet naming the best of the preset's hand-picked freezes: the lowest mean, over
    the seeds, of its loss against LAMB's at the same seed (a divergence counts as worse than any
    loss). Its comparison above is the target "as good as the best hand-picked fraction"."""
    seeds = _seeds(results, preset)
    means = {}
    for variant in HAND_PICKED_OF[preset]:
        gaps = [_percent_against_lamb(results, preset, variant, seed) for seed in seeds]
        means[variant] = statistics.fmean(gaps)
    best = min(means, key=lambda v: (means[v] != means[v], means[v]))  # NaN (a divergence) last
    name = {target.other: target.name for p, target in COMPARISONS if p == preset}
    listed = ", ".join(f"{name[v]} {means[v]:+.1f}%" if means[v] == means[v] else f"{name[v]} diverged at a seed"
                       for v in means)
    return (f"- `{preset}`: the best hand-picked fraction over {len(seeds)} seed{'s' if len(seeds) > 1 else ''} "
            f"(mean loss against LAMB: {listed}) is the {name[best]}; the target \"as good as the best "
            f"hand-picked fraction\" is the comparison with it above.")


def _ranks(values: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def rank_correlation(xs: Sequence[float], ys: Sequence[float], shuffles: int = 20000) -> Tuple[float, float]:
    """Spearman's rank correlation of two samples and a two-sided permutation p-value: the share of
    ``shuffles`` random pairings (a fixed seed, so the report does not change from one rendering to
    the next) whose correlation is at least as far from 0."""
    def pearson(a: Sequence[float], b: Sequence[float]) -> float:
        ma, mb = statistics.fmean(a), statistics.fmean(b)
        cov = sum((u - ma) * (v - mb) for u, v in zip(a, b))
        norm = math.sqrt(sum((u - ma) ** 2 for u in a) * sum((v - mb) ** 2 for v in b))
        return cov / norm if norm > 0 else 0.0

    rx, ry = _ranks(xs), _ranks(ys)
    rho = pearson(rx, ry)
    rng, shuffled, extreme = random.Random(0), list(ry), 0
    for _ in range(shuffles):
        rng.shuffle(shuffled)
        extreme += abs(pearson(rx, shuffled)) >= abs(rho) - 1e-12
    return rho, extreme / shuffles


def _step_size_order(results: Results, preset: str) -> List[str]:
    """Do larger compressed steps go with a lower loss? Over every 1-bit LAMB run of the preset at
    every seed (the automatic freeze and the hand-picked ones), the rank correlation with the loss
    against LAMB at the same seed of the stage-2 step (``_stage2_step``) and of what sets much of it,
    the frozen trust ratio (``frozen_coefficient``). Nothing with under 4 runs."""
    variants = [v for v in CHECKS[preset][1:] if VARIANTS[v][0] == "onebitlamb"]
    steps, coefficients, gaps = [], [], []
    for variant in variants:
        for seed in _seeds(results, preset):
            run = results[(preset, variant, seed)]
            sizes = stage2_steps(run) if run.get("diagnostics") else None
            coefficient = frozen_coefficient(run)
            if sizes and coefficient is not None and run["final_eval_loss"] == run["final_eval_loss"]:
                steps.append(sizes[3])
                coefficients.append(coefficient)
                gaps.append(_percent_against_lamb(results, preset, variant, seed))
    if len(steps) < 4:
        return []
    (rho, p), (rho_c, p_c) = rank_correlation(steps, gaps), rank_correlation(coefficients, gaps)
    return [f"- `{preset}`, larger compressed steps against the loss: over its {len(steps)} 1-bit LAMB runs (the "
            f"automatic freeze and the hand-picked ones, every seed), the stage-2 step ranges {min(steps):.1f}-"
            f"{max(steps):.1f} and its rank correlation with the loss against LAMB is {rho:+.2f} (permutation p = "
            f"{p:.3f}); the median layer's frozen trust ratio ranges {min(coefficients):.3f}-"
            f"{max(coefficients):.3f} and its rank correlation with that loss is {rho_c:+.2f} (p = {p_c:.3f}). "
            "Negative: the larger, the further ahead of LAMB the run ended."]


def render(results: Results, command_text: str) -> str:
    lines = heading("Convergence targets with the defaults", command_text)
    lines += [
        f"Held-out MLM loss at the end of each preset's run (seed {DEFAULT_SEED}), 1-bit LAMB with `--auto-freeze "
        "--freeze-frac 0.75` and otherwise the defaults (the study's row \"" + DEFAULT_AUTO + "\"). Freeze: the "
        "step at whose end it froze (\"the cap\": 75% of the steps, where the criterion had not fired yet). "
        "Volume: LAMB's bytes per worker over the run divided by the run's. "
        "Target: within 1% of LAMB's loss (or ahead), no divergence.",
        "",
        "| preset | LAMB | 1-bit LAMB auto: freeze, loss, vs LAMB | volume | within 1% |",
        "|---|---:|---|---:|---|",
    ]
    verdicts = []
    for preset in CHECKS:
        lamb, auto = results[(preset, "lamb", DEFAULT_SEED)], results[(preset, DEFAULT_AUTO, DEFAULT_SEED)]
        loss = auto["final_eval_loss"]
        verdicts.append(_within(auto, lamb))
        volume = (f"{lamb['bytes_sent_per_rank'] / auto['bytes_sent_per_rank']:.2f}x"
                  if auto["bytes_sent_per_rank"] else "-")
        lines.append(f"| {preset} | {_loss(lamb['final_eval_loss'])} | {_freeze(auto, preset)}, "
                     f"{_loss(loss)}, {_vs(loss, lamb['final_eval_loss'])} | {volume} | {_met(verdicts[-1])} |")
    others = [_within(results[(p, DEFAULT_AUTO, seed)], results[(p, "lamb", seed)])
              for p in CHECKS for seed in _seeds(results, p) if seed != DEFAULT_SEED]
    bullets = [f"- Within 1% of LAMB with the defaults: {_met(all(verdicts + others))}: within on {sum(verdicts)} of "
               f"{len(verdicts)} presets" + (f" at seed {DEFAULT_SEED} and on {sum(others)} of the {len(others)} runs "
                                             f"at other seeds (the tables below)." if others else ".")]
    for preset, target in COMPARISONS:
        table, verdict = _comparison(results, preset, target)
        lines += table
        bullets += verdict
    for preset in HAND_PICKED_OF:
        bullets += [_best_hand_picked(results, preset)] + _step_size_order(results, preset)
    return "\n".join(lines + [""] + bullets) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onebitlamb.benchmarks.targets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", default=[], metavar="PRESET:N",
                        help="also run the preset's checks at more seeds, N in all (e.g. b4096:3: seeds "
                             f"{DEFAULT_SEED}-{DEFAULT_SEED + 2}); its targets are then judged by the mean")
    add_run_arguments(parser, "run folders, the convergence study's by default (reused when finished)", "targets")
    args = parser.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        parser.error(str(exc))
    plan = runs(seeds)
    if args.list:
        print_plan(plan, args.out)
        return 0
    results = run_rows(plan, args.out)
    body = render(results, command_line(argv))
    print(body)
    write_section(args.section, body, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
