"""Time to reach LAMB's loss on slow links: LAMB, the 1-bit optimizers and torchft's DiLoCo.

    python -m benchmarks.time_to_loss --preset tiny --seeds 1 --H 4 --outer-lr 0.7   # every row, minutes
    python -m benchmarks.time_to_loss --seeds 3 --network 2=docs/netsim_results.json 4=runs/netsim-4hosts.json

For every seed (from 1234 up, paired: the same data, model, batch and held-out evaluation for
every row): the convergence benchmark's runs of ``onebitlamb pretrain`` (LAMB, 1-bit LAMB and
1-bit Adam with their defaults, 0/1 Adam with the main job's schedules; ``benchmarks.convergence``,
whose finished runs are reused) and torchft's DiLoCo and streaming DiLoCo (``benchmarks.diloco``).
DiLoCo's H and outer lr are chosen on the grid ``--H`` x ``--outer-lr`` at the first seed, by the
final held-out loss, every grid run on the same budget (steps, samples) as the other rows; the
choice then runs at every seed.

The target is LAMB's final held-out loss at each seed (and 1% above it). For each row, the first
evaluation at or below it, and the time to get there: every step before it priced at the time
measured on emulated hosts for its kind of step at that link rate (``benchmarks.network``'s raw
results, ``--network HOSTS=FILE``, as its whole-run table prices a run). A row that never gets
there says so, with its final gap to the target. A streaming DiLoCo sync sends one fragment: it is
priced as a local step plus the measured full sync's extra time times the fragment's share of the
parameters (a model; the emulated hosts time the full sync only).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks import diloco
from benchmarks.network import step_kinds
from benchmarks.report import command_line, heading, table_row, write_section

FIRST_SEED = 1234
TITLE = "Time to reach LAMB's loss on emulated links"
RATES = (10e6, 100e6, 1e9)
NETWORK_DEFAULT = ("2=docs/netsim_results.json",)
SLACK = 0.01  # the second target: 1% above LAMB's final loss


@dataclass(frozen=True)
class Row:
    """A row of the table: its label, the convergence benchmark's folder (None: DiLoCo's, chosen on
    the grid) and the network benchmark's optimizer whose measured steps price its steps."""
    label: str
    folder: Optional[str]
    priced_as: str
    fragments: int = 1


ROWS = (
    Row("LAMB", "lamb", "lamb"),
    Row("1-bit LAMB (defaults: int8 warm-up, automatic freeze)", "onebitlamb-auto", "onebitlamb-int8"),
    Row("1-bit Adam (automatic freeze)", "onebitadam-auto", "onebitadam"),
    Row("0/1 Adam (the main job's schedules)", "zerooneadam", "zerooneadam"),
    Row("torchft DiLoCo", None, "diloco", 1),
    Row("torchft streaming DiLoCo", None, "diloco", 2),
)


# ----------------------------------------------------------------------------------------------
# Pricing: pure functions of a run's steps, its evaluations and the measured step times


def step_prices(kinds: Sequence[str], seconds: Dict[str, float], sync_share: float = 1.0) -> List[float]:
    """The time of each step, its kind's measured time; a ``sync`` of a fraction ``sync_share`` of
    the model (streaming DiLoCo's fragment) at a local step's time plus that share of the full
    sync's extra. KeyError names a kind with no measured time."""
    if not 0 < sync_share <= 1:
        raise ValueError(f"sync_share must be in (0, 1], got {sync_share!r}")
    out = []
    for kind in kinds:
        if kind not in seconds:
            raise KeyError(f"no measured time for a {kind!r} step (measured: {sorted(seconds)})")
        if kind == diloco.SYNC and sync_share < 1:
            local = seconds[diloco.LOCAL]
            out.append(local + sync_share * (seconds[kind] - local))
        else:
            out.append(seconds[kind])
    return out


def time_to_target(eval_curve: Sequence[Tuple[int, float]], prices: Sequence[float],
                   target: float) -> Optional[Tuple[int, float]]:
    """The first evaluation ``(step, held-out loss)`` at or below ``target``, as ``(step, seconds
    of the steps up to it)``; None when no evaluation gets there."""
    for step, loss in eval_curve:
        if loss <= target:
            if step > len(prices):
                raise ValueError(f"an evaluation after step {step}, but only {len(prices)} steps are priced")
            return step, float(sum(prices[:step]))
    return None


@dataclass
class Reach:
    """One row at one seed on one link: the step and seconds it reached the target at (None: not
    reached), and its final gap to the target (final loss / target - 1)."""
    step: Optional[int]
    seconds: Optional[float]
    final_gap: float


def reach(eval_curve: Sequence[Tuple[int, float]], prices: Sequence[float], target: float) -> Reach:
    got = time_to_target(eval_curve, prices, target)
    gap = eval_curve[-1][1] / target - 1
    return Reach(None, None, gap) if got is None else Reach(got[0], got[1], gap)


def cell(reaches: Sequence[Reach]) -> str:
    """Minutes to the target, the mean over the seeds that got there (± their standard deviation);
    where some did not, how many did, and the mean final gap of the others: a row that misses the
    target at one seed by a hair still shows how soon it got there at the others."""
    missed = [r for r in reaches if r.seconds is None]
    minutes = [r.seconds / 60 for r in reaches if r.seconds is not None]
    gap = f"final gap {100 * statistics.mean(r.final_gap for r in missed):+.2f}%" if missed else ""
    if not minutes:
        return f"not reached ({len(missed)} of {len(reaches)} seeds), {gap}"
    spread = f" ± {statistics.stdev(minutes):.2f}" if len(minutes) > 1 else ""
    reached = f"{statistics.mean(minutes):.2f}{spread} min"
    if not missed:
        return reached
    return f"{reached} ({len(minutes)} of {len(reaches)} seeds; the other{'s' if len(missed) > 1 else ''}: {gap})"


# ----------------------------------------------------------------------------------------------
# Reading the runs and the measured step times


def eval_steps(metrics: dict) -> List[Tuple[int, float]]:
    """A run's held-out evaluations as ``(step, loss)`` (metrics.json records them by samples)."""
    batch = metrics["samples"] // metrics["steps"]
    return [(int(samples) // batch, float(loss)) for samples, loss in metrics["eval_curve"]]


def measured_seconds(path: str) -> Dict[float, Dict[str, Dict[str, float]]]:
    """``benchmarks.network``'s raw results (its ``--raw`` file): per link rate, per optimizer,
    the median measured time of each kind of step (``network.by_kind``: kinds shared between
    optimizers filled in)."""
    from benchmarks.network import by_kind

    with open(path) as f:
        rows = json.load(f)["summary"]["rows"]
    out: Dict[float, Dict[str, Dict[str, float]]] = {}
    for (rate, name, kind), r in by_kind(rows).items():
        out.setdefault(rate, {}).setdefault(name, {})[kind] = r["measured_s"]
    return out


def parse_network(specs: Sequence[str]) -> Dict[int, str]:
    """``HOSTS=FILE`` pairs: the raw results measured on that many emulated hosts."""
    out = {}
    for spec in specs:
        hosts, sep, path = spec.partition("=")
        if not sep or not hosts.isdigit() or int(hosts) < 2 or not path:
            raise ValueError(f"--network takes HOSTS=FILE with HOSTS >= 2 (2=docs/netsim_results.json), got {spec!r}")
        out[int(hosts)] = path
    return out


# ----------------------------------------------------------------------------------------------
# The runs


def run_folder(out: str, preset: str, seed: int, steps: Optional[int]) -> str:
    return os.path.join(out, preset if steps is None else f"{preset}-{steps}steps", str(seed))


def convergence_run(out: str, preset: str, seed: int, folder: str, steps: Optional[int]) -> dict:
    """The convergence benchmark's run of row ``folder`` (trained, or reused when finished)."""
    from benchmarks import convergence

    row = next(r for r in convergence.ROWS if r.folder == folder)
    return convergence.run_one(os.path.join(run_folder(out, preset, seed, steps), folder),
                               convergence.pretrain_args(preset, seed, row, steps), os.path.join(out, "cache"))


def diloco_run(out: str, preset: str, seed: int, settings: diloco.Settings, steps: Optional[int]) -> dict:
    folder = os.path.join(run_folder(out, preset, seed, steps), settings.name)
    cfg = diloco.config(preset, seed, folder, settings, steps, os.path.join(out, "cache"))
    return diloco.run(cfg, settings)


def choose(out: str, preset: str, steps: Optional[int], candidates: Sequence[diloco.Settings], log=print):
    """The grid point with the lowest final held-out loss at the first seed (a run that stopped
    loses), with its metrics and every point's final loss."""
    losses = {}
    for s in candidates:
        m = diloco_run(out, preset, FIRST_SEED, s, steps)
        losses[s] = m.get("final_eval_loss", math.inf)
        log(f"[time_to_loss] grid {s.name}: final held-out loss {losses[s]:.4f}")
    best = min(candidates, key=lambda s: losses[s])
    return best, losses


def measure(args) -> dict:
    """Every row's runs at every seed: ``{row label: {seed: metrics}}``, and the DiLoCo grid's record."""
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))
    runs: Dict[str, Dict[int, dict]] = {row.label: {} for row in ROWS}
    chosen, grids = {}, {}
    for row in ROWS:
        if row.folder is None:
            candidates = diloco.grid(args.H, args.outer_lr, [row.fragments])
            if not candidates:
                raise ValueError(f"no H of {args.H} is a multiple of {row.fragments} fragments")
            chosen[row.label], grids[row.label] = choose(args.out, args.preset, args.steps, candidates)
        for seed in seeds:
            if row.folder is not None:
                runs[row.label][seed] = convergence_run(args.out, args.preset, seed, row.folder, args.steps)
            else:
                runs[row.label][seed] = diloco_run(args.out, args.preset, seed, chosen[row.label], args.steps)
    return {"seeds": seeds, "runs": runs, "chosen": chosen, "grids": grids}


def sync_share(row: Row) -> float:
    """The share of the parameters one sync of this row sends: a fragment's, about 1/F of them
    (``diloco.fragments``), 1 for the others."""
    return 1.0 / row.fragments


def table(measured: dict, network: Dict[int, Dict[float, Dict[str, Dict[str, float]]]], slack: float) -> List[str]:
    """The markdown table for the target LAMB's final loss times ``1 + slack``."""
    seeds, runs = measured["seeds"], measured["runs"]
    columns = [(h, rate) for h in sorted(network) for rate in RATES]
    lines = [table_row(["row"] + [f"{h} hosts, {_rate(rate)}" for h, rate in columns] + ["bytes a worker sent"]),
             "|---|" + "---:|" * (len(columns) + 1)]
    lamb = ROWS[0].label
    for row in ROWS:
        cells = []
        for hosts, rate in columns:
            times = network[hosts].get(rate, {}).get(row.priced_as)
            if times is None:
                cells.append("not measured")
                continue
            reaches = []
            for seed in seeds:
                m, target = runs[row.label][seed], runs[lamb][seed]["final_eval_loss"] * (1 + slack)
                if "final_eval_loss" not in m:  # a run that stopped (diverged)
                    reaches.append(Reach(None, None, math.inf))
                    continue
                prices = step_prices(step_kinds(m["stage"], row.priced_as, m.get("freeze_step")), times,
                                     sync_share(row))
                reaches.append(reach(eval_steps(m), prices, target))
            cells.append(cell(reaches))
        label = row.label
        if row.label in measured["chosen"]:
            s = measured["chosen"][row.label]
            label += f" (H {s.H}, outer lr {s.outer_lr:g}{f', {s.fragments} fragments' if s.fragments > 1 else ''})"
        lines.append(table_row([label] + cells + [bytes_cell(runs[row.label], runs[lamb])]))
    return lines


def bytes_cell(runs: Dict[int, dict], lamb: Dict[int, dict]) -> str:
    """The bytes a worker sent over the whole run, the mean over seeds, and LAMB's over them (the
    ratio of the means)."""
    sent = [m["bytes_sent_per_rank"] for m in runs.values() if "bytes_sent_per_rank" in m]
    lamb_sent = [m["bytes_sent_per_rank"] for m in lamb.values() if "bytes_sent_per_rank" in m]
    if not sent or not lamb_sent:  # runs that stopped before they wrote their metrics
        return "not measured"
    mine, theirs = statistics.mean(sent), statistics.mean(lamb_sent)
    return f"{mine / 1e6:,.0f} MB ({theirs / mine:.1f}x fewer than LAMB)" if mine else "0 MB"


def _rate(bps: float) -> str:
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


def render(measured: dict, network: Dict[int, dict], network_files: Dict[int, str], command: str,
           preset: str) -> str:
    first = measured["runs"][ROWS[0].label][measured["seeds"][0]]
    lines = [*heading(TITLE, command),
             f"Preset {preset}: {first['steps']} steps of {first['samples'] // first['steps']} samples on "
             f"{first['world_size']} workers, seeds {', '.join(map(str, measured['seeds']))} (paired: every row the "
             f"same data, model, batch and held-out evaluation at a seed). Target: LAMB's final held-out loss at each "
             f"seed. A cell: the minutes of training until the first evaluation at or below the target (mean ± "
             f"standard deviation over the seeds that got there, and how many did where some did not), every "
             f"step priced at the time measured for its kind of step on "
             f"the emulated hosts at that rate ({', '.join(f'{h} hosts: `{p}`' for h, p in sorted(network_files.items()))}"
             f"); \"not reached\" with the final held-out loss over the target, minus 1. A streaming DiLoCo sync is "
             f"priced as a local step plus the fragment's share of a full sync's extra time.", ""]
    for label, grid_losses in measured["grids"].items():
        lines.append(f"{label}: grid at seed {FIRST_SEED}, final held-out loss: " + ", ".join(
            f"{s.name} {loss:.4f}" for s, loss in grid_losses.items()) + ".")
    lines += ["", "To LAMB's final loss:", "", *table(measured, network, 0.0), "",
              f"To {100 * SLACK:g}% above it:", "", *table(measured, network, SLACK)]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from onebitlamb.train.config import PRESETS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_loss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="demo")
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {FIRST_SEED} up (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="every run's steps (default: the preset's)")
    parser.add_argument("--H", nargs="+", type=int, default=[8, 16, 32], help="DiLoCo's grid of H")
    parser.add_argument("--outer-lr", nargs="+", type=float, default=[diloco.OUTER_LR, 0.4],
                        help="DiLoCo's grid of outer learning rates")
    parser.add_argument("--network", nargs="+", default=list(NETWORK_DEFAULT), metavar="HOSTS=FILE",
                        help="benchmarks.network's raw results (--raw) per number of hosts (default %(default)s; "
                             "4 hosts: sudo .venv/bin/python -m benchmarks.network --hosts 4 --rates "
                             "10Mbit/s,100Mbit/s,1Gbit/s --raw FILE --plot FILE.png --results FILE.md)")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"), help="the runs' folder")
    parser.add_argument("--results", default=None, help="write the section into this markdown file "
                                                        "(default: print only)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    try:
        files = parse_network(args.network)
    except ValueError as exc:
        parser.error(str(exc))
    network = {}
    for hosts, path in files.items():
        if not os.path.exists(path):
            parser.error(f"--network {hosts}={path}: no such file (benchmarks.network --raw writes it)")
        network[hosts] = measured_seconds(path)
    if 4 not in network:
        network[4] = {}  # its columns say "not measured"
    measured = measure(args)
    body = render(measured, network, files, command_line(argv, "python -m benchmarks.time_to_loss"), args.preset)
    print("\n" + body)
    if args.results:
        print(f"written to {write_section('time-to-loss', body, args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
