"""1-bit LAMB's exchange in buckets (``overlap_with_backward``) and across nodes (``node_groups``)
against the flat exchange of one buffer: convergence on the demo.

    python -m benchmarks.exchange --seeds 3     # 6 demo runs on 2 cores beyond the convergence benchmark's

Both change the numbers, not only the speed. With several buckets each has its own compression
scale and its own error buffers. Across nodes, each node first averages exactly, and the 1-bit
exchange runs between the nodes, on shards. This measures whether the demo converges as well.
Rows: LAMB and 1-bit LAMB with the main job's defaults but a float32 warm-up average (the
quantised one runs over one flat bucket only), 1-bit LAMB with ``--bucket-cap-mb 1`` (``bucket_cap_mb=1.0,
overlap_with_backward=True``: 3 buckets on the demo's BERT; the main job clips the local gradient
after the backward, so each bucket is exchanged again in ``step()`` and nothing overlaps, but the
numbers are the buckets'), and with ``--local-size 2`` (the 4 workers as 2 nodes of 2,
``node_groups(2)``). Writes the "exchange" section of BENCHMARKS.md. Run from the repository root.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from benchmarks import convergence
from benchmarks.variants import FLOAT32_WARMUP, LAMB, Variant, main_for

# each with the float32 warm-up, the one the three share (the int8 one runs over one flat bucket only)
BUCKETS = Variant(convergence.Row("1-bit LAMB, automatic freeze, 1 MiB buckets", FLOAT32_WARMUP.row.folder,
                                  [*FLOAT32_WARMUP.row.flags, "--bucket-cap-mb", "1"]), folder="demo-buckets")
NODES = Variant(convergence.Row("1-bit LAMB, automatic freeze, 2 nodes of 2 ranks", FLOAT32_WARMUP.row.folder,
                                [*FLOAT32_WARMUP.row.flags, "--local-size", "2"]), folder="demo-nodes")
VARIANTS = [LAMB, FLOAT32_WARMUP, BUCKETS, NODES]
NOTE = (" A rank's bytes on 2 nodes of 2 include the node stages' float32 (the reduce-scatter and all-gather "
        "inside a node, on its fast links); what crosses between nodes is in the hierarchy section.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    title = "The exchange in buckets and across nodes: convergence (experiments)"
    return main_for("benchmarks.exchange", __doc__, title, "exchange", VARIANTS, argv, NOTE)


if __name__ == "__main__":
    sys.exit(main())
