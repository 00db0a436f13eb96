"""0/1 Adam on the demo and b1024: the main job's schedules against DeepSpeed's rule and the variants measured.

    python -m benchmarks.zero_one --seeds 3     # 15 demo runs beyond the convergence benchmark's, ~5 min each
    python -m benchmarks.zero_one --seeds 3 --preset b1024     # 3 more, ~10 min each

0/1 Adam (``onebitlamb.ZeroOneAdam``) sends 1 bit per element at most of its steps from the 17th
one on, not only after a warm-up. DeepSpeed's rule (``--compression-space momentum``) averages the
ranks' gradients with the 1-bit all-reduce and adds the result to the momentum; its one magnitude
per chunk then gives the elements with a small variance large Adam steps. The default averages
each rank's momentum over Adam's denominator instead (1-bit Adam's stage 2, in the variance
phase). Rows: LAMB and 1-bit LAMB with the main job's defaults and 0/1 Adam with the main job's
schedules (the convergence benchmark's runs, reused from the same folders), 0/1 Adam with
DeepSpeed's rule, and with the variance refreshed half as often (``--var-update-scaler 8``: the
interval doubles after 8 refreshes instead of 16; the full-precision refreshes are most of 0/1
Adam's bytes), and with those refreshes averaged in bfloat16 (``--warmup-dtype bfloat16``: half
their bytes, the schedule unchanged), and at half the learning rate (``--lr 1e-3``: 2e-3 is 1-bit
Adam's, which left 0/1 Adam on the plateau at seed 1236), and with the variance refreshed at every
step for 32 refreshes and every second for 32 more (``--var-update-scaler 32``: the plateau at seed
1236 set in once the interval reached 4, at step 49) in bfloat16 (which pays for the extra
refreshes). Writes the "zero-one" section of BENCHMARKS.md; with ``--preset b1024`` LAMB, 0/1 Adam
with the main job's schedules and that last variant, into "zero-one-b1024". Run from the
repository root.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from benchmarks import convergence
from benchmarks.variants import DEFAULT, LAMB, Variant, main_for

ZERO_ONE = Variant(next(row for row in convergence.ROWS if row.folder == "zerooneadam"))
DEEPSPEED_RULE = Variant(convergence.Row("0/1 Adam, DeepSpeed's 1-bit steps (the gradient)", "zerooneadam-momentum",
                                         [*ZERO_ONE.row.flags, "--compression-space", "momentum"]))
# the variance refreshed half as often: its full-precision steps are most of the run's bytes
SPARSER = Variant(convergence.Row("0/1 Adam, var_update_scaler 8", "zerooneadam-scaler8",
                                  [*ZERO_ONE.row.flags, "--var-update-scaler", "8"]))
# the same refreshes, averaged in bfloat16: half their bytes
BF16_VARIANCE = Variant(convergence.Row("0/1 Adam, variance refreshes in bfloat16", "zerooneadam-bf16",
                                        [*ZERO_ONE.row.flags, "--warmup-dtype", "bfloat16"]))
# half the learning rate: 2e-3 is 1-bit Adam's, which stalled 0/1 Adam on the demo's plateau at seed 1236
HALF_LR = Variant(convergence.Row("0/1 Adam, learning rate 1e-3", "zerooneadam-lr1e-3",
                                  [*ZERO_ONE.row.flags, "--lr", "1e-3"]))
# the variance refreshed densely for twice as long (the plateau at seed 1236 set in where the
# interval reached 4), in bfloat16 to pay for it
DENSER_BF16 = Variant(convergence.Row("0/1 Adam, var_update_scaler 32, refreshes in bfloat16",
                                      "zerooneadam-scaler32-bf16",
                                      [*ZERO_ONE.row.flags, "--var-update-scaler", "32", "--warmup-dtype",
                                       "bfloat16"]))
VARIANTS = [LAMB, DEFAULT, ZERO_ONE, DEEPSPEED_RULE, SPARSER, BF16_VARIANCE, HALF_LR, DENSER_BF16]
# on b1024 only the variant that held on the demo, beside the convergence benchmark's runs
B1024_VARIANTS = [LAMB, ZERO_ONE, DENSER_BF16]


def main(argv: Optional[Sequence[str]] = None) -> int:
    title = "0/1 Adam's 1-bit steps (an experiment)"
    return main_for("benchmarks.zero_one", __doc__, title, "zero-one",
                    {"demo": VARIANTS, "b1024": B1024_VARIANTS}, argv, presets=("demo", "b1024"))


if __name__ == "__main__":
    sys.exit(main())
