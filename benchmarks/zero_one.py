"""0/1 Adam on the demo and b1024: the main job's schedules against DeepSpeed's rule and the variants measured.

    python -m benchmarks.zero_one --seeds 3     # 18 demo runs beyond the convergence benchmark's, ~5 min each
    python -m benchmarks.zero_one --seeds 3 --preset b1024     # 6 more, ~10 min each

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
refreshes). Each section also shows where each 0/1 Adam row parts from 1-bit Adam (the same
update rule in full precision until its automatic freeze; its row too): the gap at the same seed
every half of the variance phase. Writes the "zero-one" section of BENCHMARKS.md; with ``--preset
b1024`` LAMB, 1-bit Adam, 0/1 Adam with the main job's schedules and that last variant into
"zero-one-b1024". On both presets a last row takes that variant with every step after the
variance freeze a sync (``--local-step-scaler 1.0``: the local interval never doubles): what the
local steps cost, apart from the variance phase. Run from the repository root.
"""
from __future__ import annotations

import sys
from typing import Dict, Optional, Sequence

from benchmarks import convergence
from benchmarks.report import table_row
from benchmarks.variants import DEFAULT, LAMB, ONE_BIT_ADAM, Variant, main_for

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
# the same, every step after the variance freeze a sync (the local interval never doubles within the
# run): what the local steps cost, apart from what the variance phase did
DENSER_BF16_SYNCED = Variant(convergence.Row("0/1 Adam, var_update_scaler 32, bfloat16, every step a sync after the "
                                             "freeze", "zerooneadam-scaler32-bf16-synced",
                                             [*DENSER_BF16.row.flags, "--local-step-scaler", "1.0"]))
# the same update rule with a dense warm-up until its automatic freeze: where 0/1 Adam parts from it
VARIANTS = [LAMB, DEFAULT, ONE_BIT_ADAM, ZERO_ONE, DEEPSPEED_RULE, SPARSER, BF16_VARIANCE, HALF_LR, DENSER_BF16,
            DENSER_BF16_SYNCED]
# on b1024 only the variant that held on the demo, beside the convergence benchmark's runs
B1024_VARIANTS = [LAMB, ONE_BIT_ADAM, ZERO_ONE, DENSER_BF16, DENSER_BF16_SYNCED]


def _eval_losses(metrics: dict) -> Dict[int, float]:
    """The held-out loss at each evaluation, by step."""
    batch = metrics["config"]["global_batch"]
    return {samples // batch: loss for samples, loss in metrics["eval_curve"]}


def where_the_gap_opens(seeds: Sequence[int], variants: Sequence[Variant], results: Dict[tuple, dict]) -> str:
    """Each 0/1 Adam row's held-out loss against 1-bit Adam's at the same seed, every half of the
    variance phase: whether the gap opens in the variance phase (its 1-bit steps) or after it
    (the syncs and local steps)."""
    reference = [results[s, ONE_BIT_ADAM.row.name] for s in seeds]
    reference_losses = [_eval_losses(m) for m in reference]
    rows = [v for v in variants if v.row.folder.startswith("zerooneadam")]
    first = results[seeds[0], rows[0].row.name]
    freeze, last = first["freeze_step"], first["steps"]
    steps = [s for s in sorted(_eval_losses(first)) if s > 0 and (2 * s) % freeze == 0 or s == last]
    lines = [f"Where the gap opens: each 0/1 Adam row's held-out loss against 1-bit Adam's (the same update rule, "
             f"in full precision until its automatic freeze at step {', '.join(str(m['freeze_step']) for m in reference)}) "
             f"at the same seed, seed by seed ({', '.join(map(str, seeds))}), every half of the variance phase (it "
             f"ends at step {freeze}) and at the end.", "",
             table_row(["row", *(f"step {s}" for s in steps)]), "|---|" + "---:|" * len(steps)]
    for v in rows:
        losses = [_eval_losses(results[s, v.row.name]) for s in seeds]
        cells = []
        for step in steps:
            gaps = [100 * (mine[step] / ref[step] - 1) for mine, ref in zip(losses, reference_losses)]
            cells.append(" / ".join(f"{g:+.1f}%" for g in gaps))
        lines.append(table_row([v.row.name, *cells]))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    title = "0/1 Adam's 1-bit steps (an experiment)"
    return main_for("benchmarks.zero_one", __doc__, title, "zero-one",
                    {"demo": VARIANTS, "b1024": B1024_VARIANTS}, argv, presets=("demo", "b1024"),
                    more=where_the_gap_opens)


if __name__ == "__main__":
    sys.exit(main())
