"""Runs of 1-bit LAMB variants beside LAMB and the default over a few seeds, and the table that
compares them (``warmup_quantised.py``; ``network.py`` takes its rows' folders from here).

A variant is a row of the convergence benchmark: `onebitlamb pretrain` with the row's flags, in a
folder of its own. Finished runs are reused from their folders, so the rows LAMB and the default
come from the convergence benchmark's runs when they are there.
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from benchmarks import convergence
from benchmarks.report import command_line, heading, table_row, write_section
from onebitlamb.train.config import DEFAULT_WARMUP_DTYPE


class Variant(NamedTuple):
    row: convergence.Row
    folder: str = "demo"  # the runs' folder under OUT (then SEED/ROW)


LAMB, DEFAULT = Variant(convergence.ROWS[0]), Variant(convergence.ROWS[1])
ONE_BIT_ADAM = Variant(convergence.ROWS[2])  # 1-bit Adam with the main job's defaults
# the optimizer (``--optimizer``) an experiment on the default 1-bit run may take instead
DEFAULT_OF = {"onebitlamb": DEFAULT, "onebitadam": ONE_BIT_ADAM}


def with_warmup(base: Variant, dtype: str) -> Variant:
    """``base`` (an optimizer with the main job's defaults) with its warm-up averaged in ``dtype``: the
    same runs where that is the optimizer's default, else ``--warmup-dtype DTYPE`` in a folder of its own."""
    optimizer = base.row.flags[base.row.flags.index("--optimizer") + 1]
    name = f"{base.row.name.replace(' (default)', '')}, {dtype} warm-up average"
    if dtype == DEFAULT_WARMUP_DTYPE[optimizer]:
        return Variant(base.row._replace(name=name + " (default)"), base.folder)
    return Variant(convergence.Row(name, f"{base.row.folder}-{dtype}warmup", [*base.row.flags, "--warmup-dtype", dtype]),
                   base.folder)



def seeds_from(count: int) -> List[int]:
    return list(range(convergence.FIRST_SEED, convergence.FIRST_SEED + count))


def variant_folder(v: Variant, preset: str) -> str:
    """The runs' folder under OUT: the variant's own on the demo, ``PRESET`` + its suffix on another preset
    (the convergence benchmark's runs of that preset are in OUT/PRESET)."""
    return v.folder if preset == "demo" else preset + v.folder[len("demo"):]


def run_variants(out: str, seeds: Sequence[int], variants: Sequence[Variant],
                 preset: str = "demo") -> Dict[tuple, dict]:
    """Every variant at every seed (finished runs read back): ``(seed, row name) -> metrics``."""
    results = {}
    for seed in seeds:
        for v in variants:
            results[seed, v.row.name] = convergence.run_one(
                convergence.run_folder(out, variant_folder(v, preset), seed, v.row),
                convergence.pretrain_args(preset, seed, v.row), os.path.join(out, "cache"))
    return results


def section(title: str, command: str, seeds: Sequence[int], variants: Sequence[Variant],
            results: Dict[tuple, dict], preset: str = "demo") -> str:
    """The section: per variant, the held-out loss over the seeds, its gap to the first variant (the
    reference: LAMB, or where LAMB was not run, the first row) at the same seed, the freeze steps and
    the whole run's bytes against the reference's."""
    lamb = [results[s, variants[0].row.name] for s in seeds]
    ref = "LAMB" if variants[0] is LAMB else "the first row"
    lines = [*heading(title, command),
             f"Seeds {', '.join(map(str, seeds))}: held-out loss (mean ± standard deviation over the seeds), its gap "
             f"to {ref} at the same seed, the freeze step per seed, the whole run's bytes per worker against "
             f"{ref}'s, and its rounds (collective calls) per worker, mean over the seeds. Each row is "
             f"`onebitlamb pretrain --preset {preset}` with its flags.", "",
             table_row(["row", "held-out loss", f"gap to {ref}", "freeze steps", f"{ref}'s bytes / row's",
                        "rounds per worker"]),
             "|---|---:|---:|---:|---:|---:|"]
    for v in variants:
        runs = [results[s, v.row.name] for s in seeds]
        losses = [m["final_eval_loss"] for m in runs]
        gaps = [100 * (m["final_eval_loss"] / ref["final_eval_loss"] - 1) for m, ref in zip(runs, lamb)]
        ratio = statistics.mean(m["bytes_sent_per_rank"] for m in lamb) / statistics.mean(
            m["bytes_sent_per_rank"] for m in runs)
        spread = f" ± {statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        gap = ("-" if v is variants[0] else f"{gaps[0]:+.2f}%" if len(gaps) == 1 else
               f"{statistics.mean(gaps):+.2f}% (from {min(gaps):+.2f}% to {max(gaps):+.2f}%)")
        lines.append(table_row([v.row.name, f"{statistics.mean(losses):.3f}{spread}", gap,
                                ", ".join(str(m["freeze_step"]) for m in runs) if v is not LAMB else "-",
                                f"{ratio:.2f}x", convergence.rounds_cell(runs)]))
    return "\n".join(lines)


def main_for(prog: str, doc: str, title: str, name: str, variants: Sequence[Variant],
             argv: Optional[Sequence[str]], presets: Sequence[str] = ("demo",),
             more: Optional[Callable[[Sequence[int], Sequence[Variant], Dict[tuple, dict]], str]] = None,
             command: Optional[str] = None) -> int:
    """An experiment's command line: run (or read back) its variants on one of ``presets`` and write its
    section ``name``; ``more(seeds, variants, results)``: what the section adds below its table;
    ``command``: the command the section names, where the caller took arguments of its own."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {convergence.FIRST_SEED} up")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"), help="the runs' folder")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    parser.add_argument("--section", default=None,
                        help=f"the section of BENCHMARKS.md to write (default: {name}, -PRESET on another preset)")
    if len(presets) > 1:
        parser.add_argument("--preset", choices=presets, default=presets[0], help="default: %(default)s")
        parser.add_argument("--without-lamb", action="store_true",
                            help="leave LAMB's runs out; the gaps are then to the first row at the same seed")
    args = parser.parse_args(argv)
    preset = getattr(args, "preset", presets[0])
    if getattr(args, "without_lamb", False):
        variants = [v for v in variants if v is not LAMB]
    seeds = seeds_from(args.seeds)
    results = run_variants(args.out, seeds, variants, preset)
    # one heading per section: the demo's section keeps the bare title, another preset's or section's names it
    if args.section:
        title = f"{title}: {args.section}"
    elif preset != "demo":
        title = f"{title}: {preset}"
    body = section(title, command or command_line(argv), seeds, variants, results, preset)
    if more is not None:
        body += "\n\n" + more(seeds, variants, results)
    print("\n" + body)
    if not args.no_write:
        write_section(args.section or (name if preset == "demo" else f"{name}-{preset}"), body)
    return 0
