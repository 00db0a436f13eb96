"""1-bit LAMB's warm-up average sent in bfloat16 instead of float32.

    python -m benchmarks.warmup_precision --seeds 3     # about 7 demo runs on 2 cores beyond the convergence benchmark's

The warm-up sends full gradients, so it dominates a run's bytes (a 33% warm-up: about 94% of
them). bfloat16 halves them, as the paper's fp16 baseline does. Rows: LAMB and 1-bit LAMB with the
main job's defaults (the convergence benchmark's runs, reused from the same folders), and 1-bit
LAMB with the warm-up average in bfloat16 (``ONEBITLAMB_WARMUP_DTYPE=bfloat16``, which the
optimizers read at construction). Writes the "warmup-precision" section of BENCHMARKS.md. Run from
the repository root.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from benchmarks import convergence
from benchmarks.report import command_line, write_section
from benchmarks.variants import DEFAULT, LAMB, Variant, run_variants, section, seeds_from
from onebitlamb.optim.staged import WARMUP_DTYPE_VARIABLE

BF16 = Variant(convergence.Row("1-bit LAMB, automatic freeze, bfloat16 warm-up average", "onebitlamb-auto-bf16warmup",
                               DEFAULT.row.flags), environment={WARMUP_DTYPE_VARIABLE: "bfloat16"})
VARIANTS = [LAMB, DEFAULT, BF16]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.warmup_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {convergence.FIRST_SEED} up")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"), help="the runs' folder")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    seeds = seeds_from(args.seeds)
    results = run_variants(args.out, seeds, VARIANTS)
    body = section("Warm-up average in bfloat16 (an experiment)", command_line(argv), seeds, VARIANTS, results)
    print("\n" + body)
    if not args.no_write:
        write_section("warmup-precision", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
