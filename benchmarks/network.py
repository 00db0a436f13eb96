"""Network benchmark: LAMB, 1-bit LAMB and 1-bit Adam pretraining a small BERT on emulated hosts.

    sudo .venv/bin/python -m benchmarks.network      # from the repository root; default: 2 hosts, 10M..1G + unshaped

Every host is a network namespace on a bridge, every link shaped by a token bucket (see
``onebitlamb.netsim``). For each rate: step time in the warm-up and in the compression stage,
LAMB's share of a step spent communicating, the compression-stage and end-to-end speed-up, the
bytes each host's interface counted per step, and the alpha-beta cost model's prediction beside
every measured step. Writes the "network" section of BENCHMARKS.md, a PNG of speed-up against
link rate and the raw results (JSON) next to it. Same options as ``onebitlamb netsim``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.report import command_line, machine_line, write_section
from onebitlamb.netsim import cli, experiment

DOCS = Path(__file__).resolve().parents[1] / "docs"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.network",
                                     description=__doc__.splitlines()[0])
    cli.add_arguments(parser)
    parser.add_argument("--plot", default=str(DOCS / "netsim_speedup.png"), help="PNG to write (default %(default)s)")
    parser.add_argument("--raw", default=str(DOCS / "netsim_results.json"), help="raw results (default %(default)s)")
    parser.add_argument("--results", default=None, help="the BENCHMARKS.md to update (default: the repository's)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    res = cli.execute(args)
    if isinstance(res, int):
        return res
    s, raw, summary = res
    tables = experiment.format_tables(summary, s.warmup_fraction)
    targets = experiment.check_targets(summary)
    print(tables)
    print()
    print("\n".join(targets))
    if args.no_write:
        return 0
    Path(args.raw).write_text(json.dumps({"raw": raw, "summary": summary}, indent=1))
    experiment.plot(summary, args.plot)
    m = s.model
    body = "\n".join([
        "## Network: LAMB vs 1-bit LAMB / 1-bit Adam on emulated hosts",
        "",
        f"Command: `{command_line(argv if argv is not None else None)}` (as root)",
        "",
        f"Machine: {machine_line()}. {s.hosts} hosts (network namespaces on a bridge, tbf on both ends of "
        f"every link, bucket {s.burst_ms:g} ms of the rate), one worker each with {s.threads} torch thread(s), "
        f"all sharing this machine's CPUs. BERT hidden {m['hidden']}, {m['layers']} layers, "
        f"{summary['calibration']['params']:,} parameters, {s.batch} x 64 tokens per host per step; "
        f"{s.warmup_steps} timed warm-up and {s.compression_steps} timed compression steps per optimizer "
        f"(one untimed step before each stage). Run took {raw['elapsed_s'] / 60:.1f} min. "
        f"Method and discussion: docs/netsim.md. Plot: docs/{Path(args.plot).name}.",
        "",
        tables,
        "",
        "Targets:",
        "",
        *[f"- {t}" for t in targets],
    ])
    path = write_section("network", body, args.results)
    print(f"\nwrote {path}, {args.plot}, {args.raw}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
