"""The warm-up's average quantised (``--warmup-dtype int8`` / ``int4`` / ``int2``) against float32, paired by seed.

    python -m benchmarks.warmup_quantised --seeds 5                 # 1-bit LAMB on the demo
    python -m benchmarks.warmup_quantised --seeds 5 --codecs int8   # the int8 row alone
    python -m benchmarks.warmup_quantised --seeds 5 --optimizer onebitadam
    python -m benchmarks.warmup_quantised --seeds 3 --preset b1024
    python -m benchmarks.warmup_quantised --seeds 1 --section warmup-quantised-fewer-bits  # where fewer bits stop holding

The warm-up sends full gradients, so it carries most of a 1-bit run's bytes. The quantised
average (``docs/algorithm.md``, "The warm-up's quantised average") sends blockwise codes with error
feedback instead. Rows: LAMB, the optimizer with its warm-up averaged in float32, then in each
quantised format; the row of the optimizer's default (int8 for 1-bit LAMB, float32 for 1-bit Adam:
``onebitlamb.train.config.DEFAULT_WARMUP_DTYPE``) is the main job's, the convergence benchmark's
runs, reused from the same folders. Below the table, each quantised row's gap to the float32
warm-up at the same seed (mean and 95% interval of the paired gaps), what decides whether it may become the
default: within 0.5% of the float32 warm-up and within 1% of LAMB. Writes the section
"warmup-quantised" (``-PRESET`` on another preset, ``-onebitadam`` for 1-bit Adam) of
BENCHMARKS.md. Run from the repository root.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Sequence

from benchmarks.report import command_line, mean_interval
from benchmarks.variants import DEFAULT_OF, LAMB, Variant, main_for, with_warmup

CODECS = ("int8", "int4", "int2")


def rows(optimizer: str = "onebitlamb", codecs: Sequence[str] = CODECS) -> List[Variant]:
    """LAMB, the optimizer with its warm-up averaged in float32, and in each codec (one of them, or
    float32, the optimizer's default: the main job's runs)."""
    return [LAMB, *(with_warmup(DEFAULT_OF[optimizer], dtype) for dtype in ("float32", *codecs))]


def paired_to_float32(seeds: Sequence[int], variants: Sequence[Variant], results: Dict[tuple, dict]) -> str:
    """Each quantised row's held-out loss against the float32 warm-up's at the same seed."""
    base = next(v for v in variants if v is not LAMB)  # the float32 warm-up (rows())
    lines = ["Paired with the float32 warm-up at the same seed: the held-out loss's gap (mean of the "
             "per-seed gaps, 95% interval), the freeze steps, and the whole run's bytes against the float32 "
             "warm-up's.", "",
             "| row | gap to the float32 warm-up | per seed | freeze steps (float32 warm-up) | bytes: float32 warm-up / row |",
             "|---|---:|---|---|---:|"]
    for v in variants:
        if v is LAMB or v is base:
            continue
        gaps = [100 * (results[s, v.row.name]["final_eval_loss"] / results[s, base.row.name]["final_eval_loss"] - 1)
                for s in seeds]
        mean, half = mean_interval(gaps)
        interval = f"{mean:+.2f}% ± {half:.2f}" if half is not None else f"{mean:+.2f}%"
        ratio = (sum(results[s, base.row.name]["bytes_sent_per_rank"] for s in seeds)
                 / sum(results[s, v.row.name]["bytes_sent_per_rank"] for s in seeds))
        freezes = ", ".join(f"{results[s, v.row.name]['freeze_step']} ({results[s, base.row.name]['freeze_step']})"
                            for s in seeds)
        lines.append(f"| {v.row.name} | {interval} | {', '.join(f'{g:+.2f}%' for g in gaps)} | {freezes} | "
                     f"{ratio:.2f}x |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_line(argv)
    # this module's own options, before the experiments' common ones (main_for)
    mine = argparse.ArgumentParser(add_help=False)
    mine.add_argument("--optimizer", choices=tuple(DEFAULT_OF), default="onebitlamb")
    mine.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS))
    own, argv = mine.parse_known_args(argv)
    adam = own.optimizer == "onebitadam"
    variants = rows(own.optimizer, own.codecs)
    title = "The warm-up's average quantised" + (": 1-bit Adam" if adam else "")
    name = "warmup-quantised" + ("-onebitadam" if adam else "")
    return main_for("benchmarks.warmup_quantised", __doc__, title, name, variants, argv, presets=("demo", "b1024"),
                    more=paired_to_float32, command=command)


if __name__ == "__main__":
    sys.exit(main())
