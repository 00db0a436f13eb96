"""Does rounding move the automatic freeze? The default 1-bit LAMB at each seed, and again with
another order of float sums.

    python -m benchmarks.freeze_rounding --seeds 5                         # the demo's default (int8 warm-up)
    python -m benchmarks.freeze_rounding --seeds 5 --warmup-dtype float32  # with the float32 warm-up
    python -m benchmarks.freeze_rounding --seeds 5 --optimizer onebitadam  # 1-bit Adam's default

Rows: LAMB, the main job's default 1-bit LAMB or, with ``--optimizer onebitadam``, 1-bit Adam (the
convergence benchmark's runs, reused from the same folders) and the same run with ``--threads 2``:
each worker then sums its matrix products in another order, and nothing else changes
(``benchmarks.fidelity --rounding`` reruns the first seed the same way, into the same folders). Another machine of the same kind changes the rounding the
same way: at seed 1234 one without AVX-512 froze the demo at step 209 instead of 170 before the
freeze waited for its trust ratios with a tolerance.

Below the table, per seed: the freeze step of both runs and how far it moved, and the held-out
loss's change. The bound: at most 5 steps at each seed. Writes the section
"freeze-rounding" (``-onebitadam`` for 1-bit Adam, ``-float32`` with the float32 warm-up) of
BENCHMARKS.md. Run from the repository root.

For 1-bit Adam the loss's change says more than the freeze's: it is the rounding's share of the
spread in a paired comparison (``benchmarks.warmup_quantised --optimizer onebitadam``), the gap a
change must clear before five seeds can tell it from rounding.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Sequence

from benchmarks.fidelity import ROUNDING_FLAGS, rounding_row
from benchmarks.report import command_line
from benchmarks.variants import DEFAULT_OF, LAMB, Variant, main_for, with_warmup

MOST_STEPS_MOVED = 5  # the bound on the freeze's move from rounding alone


def rows(warmup_dtype: Optional[str] = None, optimizer: str = "onebitlamb") -> List[Variant]:
    """LAMB, the optimizer's default run (with ``warmup_dtype``: ``benchmarks.warmup_quantised``'s
    row, the same runs) and the same with other rounding."""
    default = DEFAULT_OF[optimizer]
    base = default if warmup_dtype is None else with_warmup(default, warmup_dtype)
    rerun = rounding_row(base.row)
    return [LAMB, base, Variant(rerun._replace(name=f"{base.row.name}, {' '.join(ROUNDING_FLAGS)}"))]


def moved(seeds: Sequence[int], variants: Sequence[Variant], results: Dict[tuple, dict]) -> str:
    """Per seed, the freeze step and held-out loss of the run and of its rerun with other rounding."""
    base, rerun = variants[1].row.name, variants[2].row.name
    lines = [f"The freeze step per seed, and what `{' '.join(ROUNDING_FLAGS)}` (the order of float sums alone) "
             f"did to it and to the held-out loss.", "",
             "| seed | freeze step | with other rounding | moved by | held-out loss | with other rounding | change |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    moves = []
    for s in seeds:
        a, b = results[s, base], results[s, rerun]
        moves.append(abs(b["freeze_step"] - a["freeze_step"]))
        lines.append(f"| {s} | {a['freeze_step']} | {b['freeze_step']} | {b['freeze_step'] - a['freeze_step']:+d} | "
                     f"{a['final_eval_loss']:.4f} | {b['final_eval_loss']:.4f} | "
                     f"{100 * (b['final_eval_loss'] / a['final_eval_loss'] - 1):+.2f}% |")
    steps = [results[s, base]["freeze_step"] for s in seeds]
    held = "holds" if max(moves) <= MOST_STEPS_MOVED else "does not hold"
    lines += ["", f"Over the seeds the freeze came at steps {min(steps)}-{max(steps)}; other rounding moved it by at "
                  f"most {max(moves)} steps (the bound of {MOST_STEPS_MOVED} {held})."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_line(argv)
    mine = argparse.ArgumentParser(add_help=False)
    mine.add_argument("--warmup-dtype", choices=("float32", "int8"), default=None,
                      help="the warm-up average (default: the main job's)")
    mine.add_argument("--optimizer", choices=tuple(DEFAULT_OF), default="onebitlamb")
    own, argv = mine.parse_known_args(argv)
    adam = own.optimizer == "onebitadam"
    suffix = ("-onebitadam" if adam else "") + ("" if own.warmup_dtype is None else f"-{own.warmup_dtype}")
    qualifiers = (["1-bit Adam"] if adam else []) + ([f"{own.warmup_dtype} warm-up"] if own.warmup_dtype else [])
    title = "The automatic freeze under other rounding" + (f": {', '.join(qualifiers)}" if qualifiers else "")
    return main_for("benchmarks.freeze_rounding", __doc__, title, "freeze-rounding" + suffix,
                    rows(own.warmup_dtype, own.optimizer), argv, more=moved, command=command)


if __name__ == "__main__":
    sys.exit(main())
