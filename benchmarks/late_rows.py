"""What elements born after the freeze cost a step: a mostly cold embedding table, on 2 gloo ranks.

    python -m benchmarks.late_rows                     # the section "late-rows-cost" of BENCHMARKS.md
    python -m benchmarks.late_rows --rows 50000 --repeats 5   # a quick look

1-bit LAMB's stage-2 step on one table of ``--rows`` rows of width 64, frozen at step 3, then
timed over ``--steps`` steps in three states: every row had a gradient before the freeze (nothing
waits to be born: the step as it was before the rule); 90% of the rows had none and none is met
(each step's check gathers the gradient at the waiting elements); 90% had none and each step
meets 0.1% of the table's rows for the first time (the agreement's all-gather of their indices,
and the born elements' own variance). The step times are medians over ``--repeats`` runs of
``--steps`` steps, measured side by side in one start of the ranks; the ratios are to the first
state's (docs/algorithm.md, "Elements born after the freeze").
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List, Optional

import torch

import onebitlamb
from benchmarks.report import command_line, heading, table_row, write_section

STATES = {"none waiting": (0.0, 0.0), "90% waiting, none met": (0.9, 0.0),
          "90% waiting, 0.1% of rows met a step": (0.9, 0.001)}


def _time_state(rank: int, rows: int, waiting: float, met: float, steps: int) -> float:
    """Seconds per stage-2 step of one run in one state."""
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(rows, 64))
    opt = onebitlamb.OneBitLamb([table], lr=1e-3, freeze_step=3)
    cold = int(waiting * rows)
    per_step = max(1, int(met * rows)) if met else 0
    g = torch.Generator().manual_seed(rank)
    timed = 0.0
    for step in range(1, 4 + steps):
        grad = torch.randn(rows, 64, generator=g)
        grad[rows - cold:] = 0  # the cold rows: no gradient yet
        if step > 3 and per_step:  # new rows met at this step (each rank its own)
            first = rows - cold + (step - 4) * per_step * 2 + rank * per_step
            grad[first:first + per_step] = torch.randn(per_step, 64, generator=g)
        table.grad = grad
        start = time.perf_counter()
        opt.step()
        if step > 3:
            timed += time.perf_counter() - start
    return timed / steps


def _measure(rank: int, world: int, rows: int, steps: int, repeats: int) -> dict:
    times = {name: [] for name in STATES}
    for _ in range(repeats):  # interleaved, so that the machine's noise falls on every state alike
        for name, (waiting, met) in STATES.items():
            times[name].append(_time_state(rank, rows, waiting, met, steps))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: Optional[List[str]] = None) -> None:
    from onebitlamb.comm.launch import spawn_local
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--results", default="BENCHMARKS.md")
    args = ap.parse_args(argv)
    if args.rows < 1000 or args.steps < 1 or args.repeats < 1:
        raise SystemExit("--rows must be at least 1000, --steps and --repeats at least 1")
    if 2 * args.steps * max(1, int(0.001 * args.rows)) > 0.9 * args.rows:
        raise SystemExit("--steps too many for the cold rows: each step meets new ones")
    medians = spawn_local(_measure, 2, (args.rows, args.steps, args.repeats), timeout_s=3600)[0]
    base = medians["none waiting"]
    lines = heading("What elements born after the freeze cost a step", command_line(argv),
                    ", 2 gloo ranks")
    lines += [f"1-bit LAMB's stage-2 step on one table of {args.rows:,} rows x 64 (`benchmarks/late_rows.py`): "
              f"median of {args.repeats} runs of {args.steps} steps, rank 0's clock.", "",
              table_row(["state", "ms a step", "over the first"]), table_row(["---", "---:", "---:"])]
    for name, seconds in medians.items():
        lines.append(table_row([name, f"{1000 * seconds:.1f}", f"{seconds / base:.2f}x"]))
    text = "\n".join(lines) + "\n"
    write_section("late-rows-cost", text, path=args.results)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
