"""Undoing a freeze that came too early: the main job with and without ``--unfreeze-rise``.

    python -m onebitlamb.benchmarks.unfreeze            # every case (~45 min on 2 cores)
    python -m onebitlamb.benchmarks.unfreeze --list     # what would run

Each case is an automatic freeze that came, or could come, too early, run at one seed with
``--unfreeze-rise``, which undoes the freeze when a layer's local gradient variance rises within a
window as fast as a plateau exit does (docs/convergence.md, "Undoing a freeze"), and LAMB at the
same seed for the gap. A run that never undoes its freeze is the same run as without the option,
to the bit (the rise is only watched; `tests/test_optimizers.py` checks it), so the run without
the option is only made when the run with it undid a freeze.
Results go to ``--out`` (run folders, reused) and to the "unfreeze" section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, NamedTuple, Optional, Sequence, Tuple

from onebitlamb.benchmarks.convergence import PRESETS, _gap, run_one
from onebitlamb.benchmarks.report import command_line, heading, write_section

# The threshold the cases run with: the automatic freeze's own mark of a plateau exit
# (freeze_transient), a layer's variance growing e^5-fold within one window
RISE = 5.0
STUDY_CAP = "0.75"  # the convergence study's cap: the criterion, not the cap, decides
RULE_BEFORE = ["--freeze-transient-end", "0"]  # the transient ends at half its peak
DEFAULT_RULE = ["--freeze-transient-end", "2.5"]


class Case(NamedTuple):
    name: str
    preset: str
    seed: int
    optimizer: str
    flags: List[str]  # after --auto-freeze --freeze-frac STUDY_CAP
    what: str


CASES: List[Case] = [
    Case("plateau", "demo", 1234, "onebitlamb", DEFAULT_RULE + ["--freeze-tolerance", "3", "--min-freeze-frac", "0.08"],
         "a freeze forced onto the plateau, before its exit (rule 1 with tolerance 3, from step 41)"),
    Case("exit", "demo", 1236, "onebitlamb", RULE_BEFORE,
         "the rule before; in the study it froze in the middle of the plateau exit (step 93, +16.5%)"),
    Case("spike", "demo", 1235, "onebitadam", DEFAULT_RULE + ["--lr", "4e-3"],
         "1-bit Adam at 4e-3; in the study a spike made rule 2 freeze on the plateau (step 67, 5.278)"),
    Case("early", "demo", 1235, "onebitlamb", RULE_BEFORE,
         "the rule before; in the study an early freeze that worked (step 88, -8.6%)"),
]


def case_flags(case: Case, rise: Optional[float]) -> List[str]:
    flags = PRESETS[case.preset] + ["--auto-freeze", "--freeze-frac", STUDY_CAP] + case.flags
    if case.optimizer == "onebitlamb":  # its cases ran when the freeze came as soon as the rule held
        flags.append("--no-freeze-after-trust-peak")
    flags += ["--seed", str(case.seed)]
    return flags + (["--unfreeze-rise", f"{rise:g}"] if rise is not None else [])


def case_name(case: Case) -> str:
    return f"{case.preset}_{case.optimizer}_{case.name}_seed_{case.seed}"


def freezes(stages: Sequence[str]) -> List[Tuple[str, int]]:
    """The run's freezes and undone freezes, in order: ("freeze", step) / ("undone", step), each the
    step at whose end it happened."""
    return [("freeze" if stages[i] == "compression" else "undone", i)
            for i in range(1, len(stages)) if stages[i - 1] != stages[i]]


def undid_a_freeze(metrics: dict) -> bool:
    return any(kind == "undone" for kind, _ in freezes(metrics["stage"]))


def largest_rise(metrics: dict) -> Optional[Tuple[float, int]]:
    """The largest rise a frozen step measured, and the step."""
    rise = metrics.get("variance_rise")
    best = None
    for i, row in enumerate(rise["per_step"] if rise else []):
        for value in row or []:
            if value is not None and (best is None or value > best[0]):
                best = (value, i + 1)
    return best


def describe(metrics: dict, lamb: dict) -> str:
    events = ", ".join(f"{'undone at ' if kind == 'undone' else ''}{step}" for kind, step in freezes(metrics["stage"]))
    loss, ref = metrics["final_eval_loss"], lamb["final_eval_loss"]
    volume = lamb["bytes_sent_per_rank"] / metrics["bytes_sent_per_rank"]
    return f"{events}; {loss:.3f} ({_gap(loss, ref)}); {volume:.2f}x less"


def render(results: List[Tuple[Case, dict, Optional[dict], dict]], command: str) -> str:
    lines = heading("Undoing a freeze: the main job with and without --unfreeze-rise", command)
    lines += [
        f"Each case at one seed with `--unfreeze-rise {RISE:g}`, without it where that run undid a freeze "
        "(otherwise the two are the same run), and LAMB at that seed. Freezes: the steps at whose end the "
        "optimizer froze, and those at whose end it undid a freeze. Held-out loss at the end, gap to LAMB, "
        "whole-run bytes per worker against LAMB's. Largest rise: the largest rise of a layer's local "
        "gradient variance (log) within a window that a frozen step measured, and the step.",
        "",
        "| case | flags | LAMB | without: freezes; loss; volume | with: freezes; loss; volume | largest rise |",
        "|---|---|---:|---|---|---|",
    ]
    for case, lamb, without, with_ in results:
        rise = largest_rise(with_)
        flags = " ".join(case.flags + ["--seed", str(case.seed)])
        lines.append(f"| {case.name}: {case.what} | {case.preset}, {case.optimizer}, `{flags}` "
                     f"| {lamb['final_eval_loss']:.3f} "
                     f"| {'the same run (nothing undone)' if without is None else describe(without, lamb)} "
                     f"| {describe(with_, lamb)} | {'-' if rise is None else f'{rise[0]:.1f} (step {rise[1]})'} |")
    return "\n".join(lines) + "\n"


def run_case(case: Case, out: str, cache: str) -> Tuple[dict, Optional[dict], dict]:
    """LAMB, the run without the option (None: the same run as with it, which undid nothing), and
    the run with it."""
    name = case_name(case)
    lamb = run_one(os.path.join(out, f"{case.preset}_lamb_seed_{case.seed}"), "lamb",
                   PRESETS[case.preset] + ["--seed", str(case.seed)], cache)
    with_ = run_one(os.path.join(out, f"{name}_unfreeze_{RISE:g}"), case.optimizer, case_flags(case, RISE), cache)
    without = (run_one(os.path.join(out, name), case.optimizer, case_flags(case, None), cache)
               if undid_a_freeze(with_) else None)
    return lamb, without, with_


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onebitlamb.benchmarks.unfreeze",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/unfreeze", help="run folders (reused when finished)")
    parser.add_argument("--results", default=None, help="results file (default: BENCHMARKS.md)")
    parser.add_argument("--list", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)
    if args.list:
        for case in CASES:
            lamb_flags = PRESETS[case.preset] + ["--seed", str(case.seed)]
            print(f"onebitlamb pretrain --preset demo --optimizer lamb {' '.join(lamb_flags)}")
            print(f"onebitlamb pretrain --preset demo --optimizer {case.optimizer} {' '.join(case_flags(case, RISE))}")
            print(f"onebitlamb pretrain --preset demo --optimizer {case.optimizer} {' '.join(case_flags(case, None))}"
                  "  (only if the run above undid a freeze)")
        return 0
    cache = os.path.join(args.out, "cache")
    results = []
    for case in CASES:
        print(f"case: {case_name(case)}", file=sys.stderr, flush=True)
        results.append((case, *run_case(case, args.out, cache)))
    body = render(results, command_line(argv))
    print(body)
    write_section("unfreeze", body, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
