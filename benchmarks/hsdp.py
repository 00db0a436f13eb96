"""1-bit LAMB on a sharded model (HSDP, ``--shard 2``) against LAMB and unsharded 1-bit LAMB, paired by seed.

    python -m benchmarks.hsdp --seeds 3            # the demo: LAMB, 1-bit LAMB, 1-bit LAMB --shard 2
    python -m benchmarks.hsdp --seeds 3 --list     # each run's state; runs nothing

Run from the repository root. The runs are the convergence benchmark's (``OUT/PRESET/SEED/ROW``,
reused when finished, continued when interrupted) plus one row: the default 1-bit LAMB with
``--shard 2``, the model sharded with FSDP2 over each 2 of the 4 workers (2 replicas of 2 shards).

What sharding changes in the numbers: the 1-bit exchange runs per shard, over the pieces of every
layer that shard holds, so each rank compresses with its own scale per shard (``S`` scales where the
unsharded exchange has one, each set by its shard's RMS) and the server's chunks cut through rows
of several layers; every per-layer statistic (trust ratio, factor, the freeze's) stays that of the
whole layer. FSDP's reduce-scatter also averages each node's gradients first, which changes the
order of float sums. The table gives, per seed, the held-out loss of each row, the paired gaps
(against LAMB; sharded against unsharded) with their mean and 95% interval, and each rank's
optimizer state. Writes the section ``hsdp-PRESET`` of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from benchmarks import convergence
from benchmarks.fidelity import mean_interval
from benchmarks.report import command_line, heading, table_row, write_section

LAMB, DEFAULT = convergence.ROWS[0], convergence.ROWS[1]
SHARDED = convergence.Row("1-bit LAMB, --shard 2 (HSDP, 2 replicas x 2 shards)", "onebitlamb-auto-shard2",
                          [*DEFAULT.flags, "--shard", "2"])
ROWS = [LAMB, DEFAULT, SHARDED]


def gap_pct(loss: float, reference: float) -> float:
    return 100.0 * (loss - reference) / reference


def _interval(values: Sequence[float]) -> str:
    mean, half = mean_interval(values)
    return f"{mean:+.2f}%" + ("" if half is None else f" ± {half:.2f}")


def section(preset: str, seeds: Sequence[int], losses: dict, state: dict, command: str) -> str:
    lines = heading(f"Sharded models (HSDP): 1-bit LAMB with --shard 2 on {preset}", command)
    lines += ["Held-out loss at the end of each run, 4 workers; the gaps are paired by seed. The state is "
              "each rank's optimizer state (its tensors), rank 0's.", "",
              table_row(["seed", "LAMB", "1-bit LAMB", "1-bit LAMB --shard 2", "--shard 2 vs LAMB",
                         "--shard 2 vs unsharded"]),
              table_row(["---:"] * 6)]
    against_lamb, against_whole = [], []
    for seed in seeds:
        lamb, whole, sharded = (losses[(seed, row.folder)] for row in ROWS)
        against_lamb.append(gap_pct(sharded, lamb))
        against_whole.append(gap_pct(sharded, whole))
        lines.append(table_row([seed, f"{lamb:.4f}", f"{whole:.4f}", f"{sharded:.4f}",
                                f"{against_lamb[-1]:+.2f}%", f"{against_whole[-1]:+.2f}%"]))
    unsharded_vs_lamb = [gap_pct(losses[(s, DEFAULT.folder)], losses[(s, LAMB.folder)]) for s in seeds]
    lines.append(table_row(["mean (95%)", "", _interval(unsharded_vs_lamb) + " vs LAMB", "",
                            _interval(against_lamb), _interval(against_whole)]))
    whole_state, sharded_state = state[DEFAULT.folder], state[SHARDED.folder]
    lines += ["", f"Optimizer state per rank: {whole_state / 1e6:.2f} MB unsharded, {sharded_state / 1e6:.2f} MB "
              f"with --shard 2 ({sharded_state / whole_state:.2f}x).", ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hsdp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", help="default: demo")
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {convergence.FIRST_SEED} up")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"),
                        help="the runs' folder, shared with benchmarks.convergence (default runs/convergence)")
    parser.add_argument("--results", default=None, help="markdown file to write into (default BENCHMARKS.md)")
    parser.add_argument("--list", action="store_true", help="print each run's state and run nothing")
    args = parser.parse_args(argv)
    seeds = list(range(convergence.FIRST_SEED, convergence.FIRST_SEED + args.seeds))
    cache = os.path.join(args.out, "cache")
    losses, state = {}, {}
    for seed in seeds:
        for row in ROWS:
            folder = convergence.run_folder(args.out, args.preset, seed, row)
            if args.list:
                print(f"{folder}: {convergence.run_state(folder)}")
                continue
            metrics = convergence.run_one(folder, convergence.pretrain_args(args.preset, seed, row), cache)
            losses[(seed, row.folder)] = metrics["final_eval_loss"]
            state.setdefault(row.folder, (metrics.get("optimizer_state_bytes_by_rank") or [0])[0])
    if args.list:
        return 0
    path = write_section(f"hsdp-{args.preset}", section(args.preset, seeds, losses, state,
                                                       command_line(argv if argv is not None else sys.argv[1:])),
                         args.results)
    print(f"wrote the section hsdp-{args.preset} of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
