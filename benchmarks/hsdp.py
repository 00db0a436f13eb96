"""1-bit LAMB on a sharded model (HSDP, ``--shard 2``) against LAMB and unsharded 1-bit LAMB, paired by seed.

    python -m benchmarks.hsdp --seeds 3              # the demo: LAMB and 1-bit LAMB --shard 2 at 3 seeds
    python -m benchmarks.hsdp --seeds 3 --unsharded  # and unsharded 1-bit LAMB (else its recorded gaps)
    python -m benchmarks.hsdp --seeds 3 --list       # each run's state; runs nothing

Run from the repository root. The runs are the convergence benchmark's (``OUT/PRESET/SEED/ROW``,
reused when finished, continued when interrupted) plus one row: the default 1-bit LAMB with
``--shard 2``, the model sharded with FSDP2 over each 2 of the 4 workers (2 replicas of 2 shards).
Unsharded 1-bit LAMB's paired gap to LAMB is its run with ``--unsharded``; without, the gap
``benchmarks.fidelity`` recorded at the same seed (``onebitlamb/train/measured.json``), whose runs
are the same code and settings (a demo run takes 15-20 minutes on 2 cores).

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
import json
import os
import sys
from typing import Dict, Optional, Sequence

from benchmarks import convergence
from benchmarks.report import command_line, heading, mean_interval, table_row, write_section
from onebitlamb.comm.launch import spawn_local

LAMB, DEFAULT = convergence.ROWS[0], convergence.ROWS[1]
SHARDED = convergence.Row("1-bit LAMB, --shard 2 (HSDP, 2 replicas x 2 shards)", "onebitlamb-auto-shard2",
                          [*DEFAULT.flags, "--shard", "2"])
# per seed, the sharded run first: where a run of LAMB at that seed is already going, it finishes meanwhile
ROWS = [SHARDED, LAMB, DEFAULT]
MEASURED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "onebitlamb", "train",
                        "measured.json")


def recorded_gaps(preset: str) -> Dict[int, float]:
    """Unsharded 1-bit LAMB's gap to LAMB by seed, as ``benchmarks.fidelity`` recorded it (percent)."""
    with open(MEASURED) as f:
        entry = json.load(f).get(preset, {}).get("onebitlamb", {})
    return dict(zip(entry.get("seeds", []), entry.get("gaps_pct", [])))


def gap_pct(loss: float, reference: float) -> float:
    return 100.0 * (loss - reference) / reference


def _interval(values: Sequence[float]) -> str:
    mean, half = mean_interval(values)
    return f"{mean:+.2f}%" + ("" if half is None else f" ± {half:.2f}")


def section(preset: str, seeds: Sequence[int], losses: dict, state: dict, command: str) -> str:
    """The table: per seed LAMB's and the sharded run's held-out loss and their paired gap, and
    unsharded 1-bit LAMB's gap at that seed (run here when ``losses`` has it, else as
    ``benchmarks.fidelity`` recorded it: the unsharded path is the same code) and the difference."""
    recorded = recorded_gaps(preset)
    lines = heading(f"Sharded models (HSDP): 1-bit LAMB with --shard 2 on {preset}", command)
    lines += ["Held-out loss at the end of each run, 4 workers; the gaps are paired by seed (95% intervals, "
              "Student's t). Unsharded 1-bit LAMB's gap is its run here where there is one, else the one "
              "`python -m benchmarks.fidelity` recorded (marked *).", "",
              table_row(["seed", "LAMB", "1-bit LAMB --shard 2", "--shard 2 vs LAMB", "unsharded vs LAMB",
                         "--shard 2 minus unsharded (points)"]),
              table_row(["---:"] * 6)]
    sharded_gaps, whole_gaps, differences = [], [], []
    for seed in seeds:
        lamb, sharded = losses[(seed, LAMB.folder)], losses[(seed, SHARDED.folder)]
        sharded_gaps.append(gap_pct(sharded, lamb))
        if (seed, DEFAULT.folder) in losses:
            whole, mark = gap_pct(losses[(seed, DEFAULT.folder)], lamb), ""
        else:
            whole, mark = recorded.get(seed), "*"
        cells = ["-", "-"]
        if whole is not None:
            whole_gaps.append(whole)
            differences.append(sharded_gaps[-1] - whole)
            cells = [f"{whole:+.2f}%{mark}", f"{differences[-1]:+.2f}"]
        lines.append(table_row([seed, f"{lamb:.4f}", f"{sharded:.4f}", f"{sharded_gaps[-1]:+.2f}%", *cells]))
    lines.append(table_row(["mean (95%)", "", "", _interval(sharded_gaps),
                            _interval(whole_gaps) if whole_gaps else "-",
                            _interval(differences).replace("%", "") if differences else "-"]))
    if state:
        lines += ["", f"1-bit LAMB's state per rank after the freeze (its tensors, rank 0; the main job's optimizer "
                  f"on the demo's model, 4 ranks): {state['unsharded'] / 1e6:.2f} MB unsharded, "
                  f"{state['--shard 2'] / 1e6:.2f} MB with --shard 2 ({state['--shard 2'] / state['unsharded']:.2f}x)."]
    return "\n".join(lines + [""])


def _state_bytes(rank: int, world: int) -> Dict[str, int]:
    """This rank's 1-bit LAMB state (its tensors, in bytes) for the demo's model on 4 ranks, after
    its freeze (the errors exist from then), unsharded and under --shard 2: the main job's
    optimizer (``make_optimizer``) on the main job's model and groups, a few steps of random
    gradients."""
    import warnings

    import torch

    from onebitlamb.train import config, loop
    from onebitlamb.train.model import build_model
    from onebitlamb.train.sharding import Sharding

    cfg = config.config_from_flags(["--preset", "demo", "--out", "unused", "--freeze", "0.004"])
    out = {}
    warnings.simplefilter("ignore")  # the early freeze's warning: the errors' sizes are all this reads
    for name, shard in (("unsharded", 1), ("--shard 2", 2)):
        model = build_model(cfg.model, cfg.seed)
        sharding = Sharding(world, shard, torch.device("cpu")) if shard > 1 else None
        if sharding is not None:
            sharding.shard(model)
        groups, _ = loop.param_groups(model, cfg.weight_decay)
        opt = loop.make_optimizer(cfg, groups, None if sharding is None else sharding.replicate_group)
        for step in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-3
            opt.step()
        out[name] = loop.optimizer_state_bytes(opt)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hsdp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo", help="default: demo")
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {convergence.FIRST_SEED} up")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"),
                        help="the runs' folder, shared with benchmarks.convergence (default runs/convergence)")
    parser.add_argument("--results", default=None, help="markdown file to write into (default BENCHMARKS.md)")
    parser.add_argument("--list", action="store_true", help="print each run's state and run nothing")
    parser.add_argument("--unsharded", action="store_true",
                        help="also run unsharded 1-bit LAMB at every seed (default: its recorded gaps)")
    args = parser.parse_args(argv)
    seeds = list(range(convergence.FIRST_SEED, convergence.FIRST_SEED + args.seeds))
    cache = os.path.join(args.out, "cache")
    losses = {}
    for seed in seeds:
        for row in ROWS if args.unsharded else ROWS[:2]:
            folder = convergence.run_folder(args.out, args.preset, seed, row)
            if args.list:
                print(f"{folder}: {convergence.run_state(folder)}")
                continue
            metrics = convergence.run_one(folder, convergence.pretrain_args(args.preset, seed, row), cache)
            losses[(seed, row.folder)] = metrics["final_eval_loss"]
    if args.list:
        return 0
    state = spawn_local(_state_bytes, 4, (), timeout_s=600, collective_timeout_s=300)[0]
    path = write_section(f"hsdp-{args.preset}", section(args.preset, seeds, losses, state,
                                                       command_line(argv if argv is not None else sys.argv[1:])),
                         args.results)
    print(f"wrote the section hsdp-{args.preset} of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
