"""Convergence: 1-bit LAMB against LAMB, each with the main job's defaults.

    python -m benchmarks.convergence                 # demo, seed 1234: a quarter of an hour on 2 cores
    python -m benchmarks.convergence --presets demo b1024 --seeds 3
    python -m benchmarks.convergence --list          # each run's state; runs nothing
    python -m benchmarks.convergence --presets large --rows lamb onebitlamb-auto --steps 60 \
        --torchrun 4 --section convergence-large    # on a GPU machine (.ci/gpu-check runs this)

Run from the repository root. For every preset and seed, four runs of ``onebitlamb pretrain``
(the rows of ROWS): LAMB, 1-bit LAMB and 1-bit Adam with the automatic freeze, and 0/1 Adam with
the main job's schedules: each optimizer as a user gets it. (Other settings are experiments:
``benchmarks/variants.py`` and the scripts built on it.) Seeds count up from 1234, the main job's.

Each run has its own folder, OUT/PRESET/SEED/ROW (the tokenized corpus, shared: OUT/cache). A
folder that holds metrics.json is a finished run and is reused as it is (move it away to run it
again); one that holds a checkpoint is an interrupted run, continued with ``--resume``. The table
goes to the "convergence" section of BENCHMARKS.md (or of ``--results``).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from benchmarks.report import command_line, heading, table_row, write_section
from onebitlamb.train import config as train_config
from onebitlamb.train.config import PRESETS
FIRST_SEED = 1234
TITLE = "Convergence: 1-bit LAMB against LAMB with the defaults"


class Row(NamedTuple):
    name: str          # the table's row
    folder: str        # the run's folder under OUT/PRESET/SEED
    flags: List[str]   # of `onebitlamb pretrain`, besides --preset, --seed and --out


ROWS = [
    Row("LAMB", "lamb", ["--optimizer", "lamb"]),
    Row("1-bit LAMB, automatic freeze (default)", "onebitlamb-auto", ["--optimizer", "onebitlamb", "--freeze", "auto"]),
    Row("1-bit Adam, automatic freeze (default)", "onebitadam-auto", ["--optimizer", "onebitadam", "--freeze", "auto"]),
    Row("0/1 Adam, the main job's schedules", "zerooneadam", ["--optimizer", "zerooneadam"]),
]

Results = Dict[Tuple[str, int, str], dict]  # (preset, seed, row name) -> the run's metrics.json


def run_folder(out: str, preset: str, seed: int, row: Row, steps: Optional[int] = None) -> str:
    """OUT/PRESET/SEED/ROW; OUT/PRESET-NsSTEPS/... for a run of other than the preset's steps."""
    return os.path.join(out, preset if steps is None else f"{preset}-{steps}steps", str(seed), row.folder)


def pretrain_args(preset: str, seed: int, row: Row, steps: Optional[int] = None) -> List[str]:
    """The arguments of ``onebitlamb pretrain`` for one run, without --out."""
    return ["pretrain", "--preset", preset, "--seed", str(seed), *row.flags,
            *([] if steps is None else ["--steps", str(steps)])]


def run_state(folder: str) -> str:
    """"finished", "interrupted at step N" (a checkpoint, no metrics) or "to run"."""
    if os.path.exists(os.path.join(folder, "metrics.json")):
        return "finished"
    pointer = os.path.join(folder, "checkpoint.json")
    if os.path.exists(pointer):
        with open(pointer) as f:
            return f"interrupted at step {json.load(f).get('step', '?')}"
    return "to run"


def launch(command: List[str]) -> None:
    """Runs one training as a child process, its output shown as it comes."""
    subprocess.run(command, check=True)


def run_one(folder: str, args: List[str], cache_dir: str, program: Sequence[str] = ("onebitlamb",)) -> dict:
    """The metrics of one run: read when it finished before, else trained (resumed when interrupted).
    ``cache_dir``: the tokenized corpus, shared by the runs (it does not change their numbers);
    ``program``: the module (and its first arguments) that takes ``onebitlamb``'s command line."""
    state = run_state(folder)
    if state == "finished" and tuple(program) == ("onebitlamb",):
        _check_finished_run(folder, args)
    if state != "finished":
        tail = [*args, "--out", folder, "--cache-dir", cache_dir, "--no-progress"]
        if state != "to run":
            tail.append("--resume")
        command = [sys.executable, "-m", *program, *tail]
        print(f"\n$ python -m {shlex.join([*program, *tail])}", flush=True)
        launch(command)
        if run_state(folder) != "finished":
            raise RuntimeError(f"{folder}: the run ended without metrics.json; the same command continues it")
    with open(os.path.join(folder, "metrics.json")) as f:
        return json.load(f)


def _check_finished_run(folder: str, args: List[str]) -> None:
    """Refuse a finished run read back for a command that would not give it: a default changed since
    (or a row's flags), which would otherwise put an old run's numbers under today's name."""
    cfg = train_config.config_from_flags([*args[1:], "--out", folder])
    with open(os.path.join(folder, "metrics.json")) as f:
        changed = train_config.changed_settings(cfg, json.load(f).get("config", {}))
    if changed:
        raise RuntimeError(f"{folder} holds a finished run with other settings than `onebitlamb "
                           f"{shlex.join(args)}` gives now (saved, now): {changed}; move it aside or choose "
                           f"another --out")


def _mean(values: Sequence[float], digits: int, unit: str = "") -> str:
    """The mean (signed when it has a unit), with the standard deviation over the seeds when there are several."""
    text = f"{statistics.mean(values):{'+' if unit else ''}.{digits}f}{unit}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def rounds_cell(runs: Sequence[dict]) -> str:
    """Collective calls per worker over the run, mean over the seeds ("-" for runs from before they
    were counted)."""
    rounds = [m.get("rounds_per_rank") for m in runs]
    return "-" if None in rounds else f"{statistics.mean(rounds):,.0f}"


def preset_table(preset: str, seeds: Sequence[int], results: Results, rows: Sequence[Row] = ROWS) -> List[str]:
    """The table of one preset: one line per row, means over ``seeds``."""
    lamb = [results[preset, s, ROWS[0].name] for s in seeds]
    lamb_bytes = statistics.mean(m["bytes_sent_per_rank"] for m in lamb)
    first = lamb[0]
    lines = [
        f"### {preset}: {first['steps']} steps, {first['samples']:,} samples, {first['world_size']} workers, "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}",
        "",
        table_row(["row", "seeds", "held-out loss", "gap to LAMB", "freeze step", "MB sent per worker",
                   "LAMB's bytes / row's", "rounds per worker"]),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        runs = [results[preset, s, row.name] for s in seeds]
        gaps = [100 * (m["final_eval_loss"] / ref["final_eval_loss"] - 1) for m, ref in zip(runs, lamb)]
        steps = [m["freeze_step"] for m in runs]
        sent = statistics.mean(m["bytes_sent_per_rank"] for m in runs)
        lines.append(table_row([
            row.name, len(seeds), _mean([m["final_eval_loss"] for m in runs], 3),
            "-" if row is ROWS[0] else _mean(gaps, 1, "%"),
            "-" if steps[0] is None else (str(steps[0]) if len(set(steps)) == 1 else ", ".join(map(str, steps))),
            f"{sent / 1e6:,.1f}", f"{lamb_bytes / sent:.2f}x", rounds_cell(runs)]))
    return lines


def render(presets: Sequence[str], seeds: Sequence[int], results: Results, command: str,
           rows: Sequence[Row] = ROWS, machine: str = "", title: str = TITLE) -> str:
    lines = [
        *heading(title, command, machine),
        "Each row is `onebitlamb pretrain --preset PRESET --seed SEED` with its flags, every other setting at "
        "the main job's default:",
        "",
        *[f"- {row.name}: `{' '.join(row.flags)}`" for row in rows],
        "",
        "Held-out loss: the masked-language-model loss on the held-out samples at the end of the run, the mean "
        "over the seeds (± their standard deviation when there are several). Gap to LAMB: the row's loss over "
        "LAMB's at the same seed, minus 1, averaged over the seeds (lower is better). Freeze step: the last "
        "step before 1-bit compression, the variance frozen at its end (one per seed when they differ). MB sent "
        "per worker: the whole run's bytes, warm-up included, mean over the seeds. Rounds: the collective calls a "
        "worker made (each costs a latency on a slow link, whatever its size).",
    ]
    for preset in presets:
        lines += ["", *preset_table(preset, seeds, results, rows)]
    return "\n".join(lines) + "\n"


def _devices(torchrun: Optional[int]) -> str:
    """What trained, for the section's machine line: the GPU under torchrun when there is one."""
    if torchrun is None:
        return ""
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f", torchrun with {torchrun} ranks, {gpu}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), default=["demo"], help="default: demo")
    parser.add_argument("--seeds", type=int, default=1, help=f"how many seeds, from {FIRST_SEED} up (default 1)")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"),
                        help="the runs' folder (default %(default)s)")
    parser.add_argument("--results", default=None, help="markdown file to write the section into "
                                                        "(default: the repository's BENCHMARKS.md)")
    parser.add_argument("--list", action="store_true", help="print each run's state and run nothing")
    folders = [row.folder for row in ROWS]
    parser.add_argument("--rows", nargs="+", choices=folders, default=folders,
                        help="which rows (default: all; lamb, the reference, always among them)")
    parser.add_argument("--steps", type=int, default=None, help="every run's steps (default: the preset's)")
    parser.add_argument("--torchrun", type=int, default=None, metavar="N",
                        help="run each training under torchrun with N ranks on this machine (its GPUs when it "
                             "has them) instead of the main job's local workers")
    parser.add_argument("--section", default="convergence", help="the section of the results file (default "
                                                                  "%(default)s)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.torchrun is not None and args.torchrun < 1:
        parser.error(f"--torchrun must be at least 1, got {args.torchrun}")
    if "lamb" not in args.rows:
        parser.error("--rows must include lamb: every gap is measured against it")
    rows = [row for row in ROWS if row.folder in args.rows]
    program: Sequence[str] = ("onebitlamb",) if args.torchrun is None else (
        "torch.distributed.run", "--standalone", f"--nproc-per-node={args.torchrun}", "-m", "onebitlamb")
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))
    runs = [(p, s, row) for p in args.presets for s in seeds for row in rows]
    if args.list:
        for preset, seed, row in runs:
            folder = run_folder(args.out, preset, seed, row, args.steps)
            print(f"{folder:<50} {run_state(folder):<24} onebitlamb "
                  f"{shlex.join(pretrain_args(preset, seed, row, args.steps))}")
        return 0
    results: Results = {}
    for preset, seed, row in runs:
        results[preset, seed, row.name] = run_one(run_folder(args.out, preset, seed, row, args.steps),
                                                  pretrain_args(preset, seed, row, args.steps),
                                                  os.path.join(args.out, "cache"), program)
    command = command_line(argv, "python -m benchmarks.convergence")
    # another section is another heading (BENCHMARKS.md has one heading per section)
    title = TITLE if args.section == "convergence" else f"{TITLE}: {', '.join(args.presets)}" + (
        f", {len(seeds)} seeds" if len(seeds) > 1 else "") + (", under torchrun" if args.torchrun else "")
    body = render(args.presets, seeds, results, command, rows, _devices(args.torchrun), title)
    print("\n" + body)
    print(f"written to {write_section(args.section, body, args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
