"""1-bit LAMB with its exchange in buckets (``overlap_with_backward``) against one buffer.

    python -m benchmarks.buckets --seeds 3     # 3 demo runs on 2 cores beyond the convergence benchmark's

With several buckets each has its own compression scale (and its own error buffers), so the
numbers differ from one exchange of the whole momentum; this measures whether the demo converges
as well. Rows: LAMB and 1-bit LAMB with the main job's defaults (the convergence benchmark's runs,
reused from the same folders), and 1-bit LAMB under the preset ``demo-buckets`` (demo with
``overlap_with_backward(bucket_cap_mb=1.0)``: 3 buckets on the demo's BERT; the main job clips the
local gradient after the backward, so there each bucket is exchanged again in ``step()`` and
nothing overlaps, but the numbers are the buckets'). Writes the "buckets" section of BENCHMARKS.md.
Run from the repository root.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from benchmarks import convergence
from benchmarks.report import command_line, write_section
from benchmarks.variants import DEFAULT, LAMB, Variant, run_variants, section, seeds_from

BUCKETS = Variant(convergence.Row("1-bit LAMB, automatic freeze, 1 MiB buckets", DEFAULT.row.folder,
                                  DEFAULT.row.flags), preset="demo-buckets")
VARIANTS = [LAMB, DEFAULT, BUCKETS]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.buckets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {convergence.FIRST_SEED} up")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"), help="the runs' folder")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    seeds = seeds_from(args.seeds)
    results = run_variants(args.out, seeds, VARIANTS)
    body = section("The exchange in buckets (an experiment)", command_line(argv), seeds, VARIANTS, results)
    print("\n" + body)
    if not args.no_write:
        write_section("buckets", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
