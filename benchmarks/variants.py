"""What the experiments on the demo share: runs of 1-bit LAMB variants beside LAMB and the default
over a few seeds, and the table that compares them (``warmup_precision.py``, ``exchange.py``).

A variant is a row of the convergence benchmark: `onebitlamb pretrain` with the row's flags, in a
folder of its own. Finished runs are reused from their folders, so the rows LAMB and the default
come from the convergence benchmark's runs when they are there.
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Dict, List, NamedTuple, Optional, Sequence

from benchmarks import convergence
from benchmarks.report import command_line, heading, table_row, write_section


class Variant(NamedTuple):
    row: convergence.Row
    folder: str = "demo"  # the runs' folder under OUT (then SEED/ROW)


LAMB, DEFAULT = Variant(convergence.ROWS[0]), Variant(convergence.ROWS[1])


def seeds_from(count: int) -> List[int]:
    return list(range(convergence.FIRST_SEED, convergence.FIRST_SEED + count))


def run_variants(out: str, seeds: Sequence[int], variants: Sequence[Variant]) -> Dict[tuple, dict]:
    """Every variant at every seed (finished runs read back): ``(seed, row name) -> metrics``."""
    results = {}
    for seed in seeds:
        for v in variants:
            results[seed, v.row.name] = convergence.run_one(
                convergence.run_folder(out, v.folder, seed, v.row),
                convergence.pretrain_args("demo", seed, v.row), os.path.join(out, "cache"))
    return results


def section(title: str, command: str, seeds: Sequence[int], variants: Sequence[Variant],
            results: Dict[tuple, dict], note: str = "") -> str:
    """The section: per variant, the held-out loss over the seeds, its gap to LAMB at the same seed,
    the freeze steps and the whole run's bytes against LAMB's (the first variant must be LAMB)."""
    lamb = [results[s, variants[0].row.name] for s in seeds]
    lines = [*heading(title, command),
             f"Seeds {', '.join(map(str, seeds))}: held-out loss (mean ± standard deviation over the seeds), its gap "
             f"to LAMB at the same seed, the freeze step per seed, and the whole run's bytes per worker against "
             f"LAMB's. Each row is `onebitlamb pretrain --preset demo` with its flags." + note, "",
             table_row(["row", "held-out loss", "gap to LAMB", "freeze steps", "LAMB's bytes / row's"]),
             "|---|---:|---:|---:|---:|"]
    for v in variants:
        runs = [results[s, v.row.name] for s in seeds]
        losses = [m["final_eval_loss"] for m in runs]
        gaps = [100 * (m["final_eval_loss"] / ref["final_eval_loss"] - 1) for m, ref in zip(runs, lamb)]
        ratio = statistics.mean(m["bytes_sent_per_rank"] for m in lamb) / statistics.mean(
            m["bytes_sent_per_rank"] for m in runs)
        spread = f" ± {statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        gap = ("-" if v is variants[0] else
               f"{statistics.mean(gaps):+.2f}% (from {min(gaps):+.2f}% to {max(gaps):+.2f}%)")
        lines.append(table_row([v.row.name, f"{statistics.mean(losses):.3f}{spread}", gap,
                                ", ".join(str(m["freeze_step"]) for m in runs) if v is not variants[0] else "-",
                                f"{ratio:.2f}x"]))
    return "\n".join(lines)


def main_for(prog: str, doc: str, title: str, name: str, variants: Sequence[Variant],
             argv: Optional[Sequence[str]], note: str = "") -> int:
    """An experiment's command line: run (or read back) its variants and write its section ``name``."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help=f"how many seeds, from {convergence.FIRST_SEED} up")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"), help="the runs' folder")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    seeds = seeds_from(args.seeds)
    body = section(title, command_line(argv), seeds, variants, run_variants(args.out, seeds, variants), note)
    print("\n" + body)
    if not args.no_write:
        write_section(name, body)
    return 0
