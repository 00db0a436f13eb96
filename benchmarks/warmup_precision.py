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
import statistics
import sys
from typing import Optional, Sequence

from benchmarks import convergence
from benchmarks.report import command_line, heading, table_row, write_section
from onebitlamb.optim.staged import WARMUP_DTYPE_VARIABLE

LAMB, DEFAULT = convergence.ROWS[0], convergence.ROWS[1]
BF16 = convergence.Row("1-bit LAMB, automatic freeze, bfloat16 warm-up average", "onebitlamb-auto-bf16warmup",
                       DEFAULT.flags)
ROWS = [LAMB, DEFAULT, BF16]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.warmup_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {convergence.FIRST_SEED} up")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"), help="the runs' folder")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    seeds = list(range(convergence.FIRST_SEED, convergence.FIRST_SEED + args.seeds))
    results = {}
    for seed in seeds:
        for row in ROWS:
            if row is BF16:
                os.environ[WARMUP_DTYPE_VARIABLE] = "bfloat16"  # the child pretrain inherits it
            try:
                results[seed, row.name] = convergence.run_one(
                    convergence.run_folder(args.out, "demo", seed, row),
                    convergence.pretrain_args("demo", seed, row), os.path.join(args.out, "cache"))
            finally:
                os.environ.pop(WARMUP_DTYPE_VARIABLE, None)
    lamb = [results[s, LAMB.name] for s in seeds]
    lines = [*heading("Warm-up average in bfloat16", command_line(argv)),
             f"`demo`, seeds {', '.join(map(str, seeds))}: held-out loss (mean ± standard deviation over the "
             f"seeds), its gap to LAMB at the same seed, the freeze step per seed, and the whole run's bytes per "
             f"worker against LAMB's.", "",
             table_row(["row", "held-out loss", "gap to LAMB", "freeze steps", "LAMB's bytes / row's"]),
             "|---|---:|---:|---:|---:|"]
    for row in ROWS:
        runs = [results[s, row.name] for s in seeds]
        losses = [m["final_eval_loss"] for m in runs]
        gaps = [100 * (m["final_eval_loss"] / ref["final_eval_loss"] - 1) for m, ref in zip(runs, lamb)]
        ratio = statistics.mean(m["bytes_sent_per_rank"] for m in lamb) / statistics.mean(
            m["bytes_sent_per_rank"] for m in runs)
        spread = f" ± {statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        gap = "-" if row is LAMB else f"{statistics.mean(gaps):+.2f}% (from {min(gaps):+.2f}% to {max(gaps):+.2f}%)"
        lines.append(table_row([row.name, f"{statistics.mean(losses):.3f}{spread}", gap,
                                ", ".join(str(m["freeze_step"]) for m in runs) if row is not LAMB else "-",
                                f"{ratio:.2f}x"]))
    body = "\n".join(lines)
    print("\n" + body)
    if not args.no_write:
        write_section("warmup-precision", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
