"""1-bit LAMB's warm-up average sent in bfloat16 instead of float32.

    python -m benchmarks.warmup_precision --seeds 3     # about 7 demo runs on 2 cores beyond the convergence benchmark's
    python -m benchmarks.warmup_precision --seeds 3 --preset b1024 --without-lamb   # 6 runs, about 17 minutes each

The warm-up sends full gradients, so it dominates a run's bytes (a 33% warm-up: about 94% of
them). bfloat16 halves them, as the paper's fp16 baseline does. Rows: LAMB and 1-bit LAMB with the
main job's defaults but the warm-up average in float32, and 1-bit LAMB with it in bfloat16
(``--warmup-dtype bfloat16``: the optimizers' ``warmup_dtype=torch.bfloat16``). Writes the "warmup-precision" section of BENCHMARKS.md. Run from
the repository root. On ``b1024`` it writes the section "warmup-precision-b1024", both 1-bit LAMB
rows with the paper's stage 2 (``--compression-space momentum``); with ``--without-lamb`` the LAMB
runs are left out and the gaps are to the float32 warm-up at the same seed.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from benchmarks import convergence
from benchmarks.variants import DEFAULT, FLOAT32_WARMUP, LAMB, Variant, main_for

BF16 = Variant(convergence.Row("1-bit LAMB, automatic freeze, bfloat16 warm-up average", "onebitlamb-auto-bf16warmup",
                               [*DEFAULT.row.flags, "--warmup-dtype", "bfloat16"]))
VARIANTS = [LAMB, FLOAT32_WARMUP, BF16]
# on b1024 both warm-ups under the paper's stage 2 (compression_space="momentum"), the default when
# the study began, so that the pair differs in the warm-up alone
PAPER = ["--compression-space", "momentum"]
B1024_VARIANTS = [
    LAMB,
    Variant(convergence.Row("1-bit LAMB, automatic freeze, paper's stage 2", "onebitlamb-paper-float32warmup",
                            [*FLOAT32_WARMUP.row.flags, *PAPER])),
    Variant(convergence.Row("1-bit LAMB, automatic freeze, paper's stage 2, bfloat16 warm-up average",
                            "onebitlamb-paper-bf16warmup", [*DEFAULT.row.flags, *PAPER, "--warmup-dtype", "bfloat16"])),
]


def main(argv: Optional[Sequence[str]] = None) -> int:
    title = "Warm-up average in bfloat16 (an experiment)"
    return main_for("benchmarks.warmup_precision", __doc__, title, "warmup-precision",
                    {"demo": VARIANTS, "b1024": B1024_VARIANTS}, argv, presets=("demo", "b1024"))


if __name__ == "__main__":
    sys.exit(main())
