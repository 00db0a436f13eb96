"""Sharded models on emulated hosts: HSDP with LAMB against HSDP with 1-bit LAMB, and 1-D FSDP.

    sudo .venv/bin/python -m benchmarks.sharded                  # 10 Mbit/s, 100 Mbit/s, 1 Gbit/s between the hosts
    sudo .venv/bin/python -m benchmarks.sharded --rates 10Mbit/s --no-write   # print only

Two emulated hosts of two ranks each (``benchmarks.netsim``: network namespaces, a token bucket on
every link; the ranks of a host talk over its loopback, unshaped and uncounted). Per link rate, one
launch trains the demo's BERT (``onebitlamb pretrain --preset demo``'s shape, 64 sequences a rank a
step, as the demo's 4 workers take its 256) through every kind of step of each row:

- **LAMB, HSDP**: FSDP2 over each host's ranks, ``onebitlamb.Lamb`` across the hosts over the
  replicate group: each shard's gradient averaged in float32 (a ring all-reduce of ``1/S`` of the
  model per rank: what FSDP2's own HSDP all-reduce sends);
- **1-bit LAMB, HSDP**: the same with ``OneBitLamb``, its warm-up in float32 and in int8 (the main
  job's default), and its compression stage;
- **LAMB, 1-D FSDP over all four ranks**: no replicas (the optimizer alone), so every byte on the
  slow link is FSDP's own all-gathers and reduce-scatters: what a 1-bit exchange cannot replace.

For each: the median step time, the bytes each host's interface sent per step across the slow link
(kernel counters), the optimizer's own count of what it sent across (``comm_stats``) and inside the
host (``shard_comm_stats``). Then the whole demo run at each rate, every step at the time of its
kind: LAMB's 512 warm-up steps against 1-bit LAMB ``--shard 2``'s steps by kind as its run took them
(``python -m benchmarks.hsdp`` writes it). Writes the "sharded" section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence

from benchmarks.emulated import kb, ms, parse_rates, rate_label
from benchmarks.netsim.runner import run_workers
from benchmarks.netsim.topology import Network, check_available, cleanup_stale
from benchmarks.netsim.worker import COMPRESSION, WARMUP
from benchmarks.report import command_line, heading, table_row, write_section

HOSTS, RANKS_PER_HOST, BATCH = 2, 2, 64
ROWS = [("lamb", "hsdp"), ("onebitlamb", "hsdp"), ("onebitlamb-int8", "hsdp"), ("lamb", "fsdp")]
LABELS = {"lamb-hsdp": "LAMB, HSDP", "onebitlamb-hsdp": "1-bit LAMB, HSDP (float32 warm-up)",
          "onebitlamb-int8-hsdp": "1-bit LAMB, HSDP (int8 warm-up)", "lamb-fsdp": "LAMB, 1-D FSDP over 4 ranks"}
# the run whose steps by kind price 1-bit LAMB's whole demo run (benchmarks.hsdp's row)
SCHEDULE = os.path.join("runs", "convergence", "demo", "1234", "onebitlamb-auto-shard2")
DEMO_STEPS = 512


def measure(rates: Sequence[Optional[float]], warm: int, comp: int, timeout_s: float) -> List[dict]:
    """Per rate: the rows' results, rank by rank, and each host's interface bytes."""
    out = []
    for rate in rates:
        print(f"[sharded] {rate_label(rate)}", flush=True)
        spec = {"model": {}, "batch": BATCH, "optimizers": [], "warmup_steps": warm, "compression_steps": comp,
                "skip_steps": 1, "threads": 1, "hsdp": ROWS}
        with Network(HOSTS, rate, ranks_per_host=RANKS_PER_HOST) as net:
            ranks = run_workers(net, spec, timeout_s=timeout_s)
        out.append({"rate_bps": rate, "ranks": ranks})
    return out


def summarise(raw: List[dict]) -> List[dict]:
    """Per rate, row and kind: the slowest rank's median step, the bytes per step a host sent over
    its link (the mean of the hosts: the host's first rank reads its interface), the bytes the
    optimizer counted across the hosts and inside one, per rank."""
    rows = []
    for entry in raw:
        ranks = entry["ranks"]
        for key in ranks[0]["hsdp"]:
            for kind in (WARMUP, COMPRESSION):
                if kind not in ranks[0]["hsdp"][key]:
                    continue
                per_rank = [r["hsdp"][key][kind] for r in ranks]
                steps = [max(t) for t in zip(*(p["step_times"] for p in per_rank))]
                # every rank of a host reads the same interface: the first one's count is the host's
                hosts = [per_rank[h * RANKS_PER_HOST]["wire_bytes_per_step"] for h in range(HOSTS)]
                rows.append({"rate_bps": entry["rate_bps"], "row": key, "kind": kind,
                             "step_s": statistics.median(steps), "wire_per_host": statistics.mean(hosts),
                             "accounted_per_rank": per_rank[0]["accounted_bytes_per_step"],
                             "node_per_rank": per_rank[0]["node_accounted_bytes_per_step"],
                             "params": ranks[0]["hsdp"][key]["params"]})
    return rows


def schedule(folder: str) -> Optional[Dict[str, int]]:
    """The steps by kind of a finished run (its log.csv's stages); None without one."""
    if not os.path.exists(os.path.join(folder, "metrics.json")):
        return None
    counts: Dict[str, int] = {}
    with open(os.path.join(folder, "log.csv")) as f:
        for line in csv.DictReader(f):
            if line["stage"]:
                counts[line["stage"]] = counts.get(line["stage"], 0) + 1
    return counts


def section(rows: List[dict], steps: Optional[Dict[str, int]], command: str, load: str = "") -> str:
    lines = heading("Sharded models (HSDP) on emulated hosts", command,
                    f"; {HOSTS} emulated hosts of {RANKS_PER_HOST} ranks{load}")
    params = rows[0]["params"]
    lines += [f"The demo's BERT ({params:,} parameters), {BATCH} sequences a rank a step. Per step: the slowest "
              f"rank's median time, the bytes a host's interface sent across the slow link (kernel counters), and "
              f"what the optimizer counted per rank across the hosts (`comm_stats`) and inside the host "
              f"(`shard_comm_stats`).", "",
              table_row(["link", "row", "stage", "step (ms)", "slow link per host (KB)", "optimizer across (KB)",
                         "optimizer inside (KB)"]),
              table_row(["---", "---", "---", "---:", "---:", "---:", "---:"])]
    for r in rows:
        lines.append(table_row([rate_label(r["rate_bps"]), LABELS[r["row"]], r["kind"], ms(r["step_s"]),
                                kb(r["wire_per_host"]), kb(r["accounted_per_rank"]), kb(r["node_per_rank"])]))
    by = {(r["rate_bps"], r["row"], r["kind"]): r for r in rows}
    lines.append("")
    for rate in dict.fromkeys(r["rate_bps"] for r in rows):
        lamb = by.get((rate, "lamb-hsdp", WARMUP))
        onebit = by.get((rate, "onebitlamb-hsdp", COMPRESSION))
        fsdp = by.get((rate, "lamb-fsdp", WARMUP))
        if lamb and onebit and onebit["wire_per_host"] > 0:
            lines.append(f"- {rate_label(rate)}: after the freeze 1-bit LAMB sends "
                         f"{lamb['wire_per_host'] / onebit['wire_per_host']:.1f}x fewer bytes across the slow link "
                         f"than LAMB under HSDP" + (f"; 1-D FSDP over all four ranks sends "
                                                    f"{fsdp['wire_per_host'] / onebit['wire_per_host']:.0f}x more"
                                                    if fsdp else "") + ".")
    if steps is None:
        lines += ["", f"The whole demo run: not priced, `{SCHEDULE}` has no finished run (`python -m "
                  f"benchmarks.hsdp` writes it)."]
    else:
        lines += ["", f"The whole demo run at each rate, every step at the time of its kind: LAMB's {DEMO_STEPS} "
                  f"steps against 1-bit LAMB `--shard 2`'s ({steps.get(WARMUP, 0)} int8 warm-up steps, "
                  f"{steps.get(COMPRESSION, 0)} compressed; its run in `{SCHEDULE}`):", "",
                  table_row(["link", "LAMB, HSDP (min)", "1-bit LAMB, HSDP (min)", "LAMB's time over 1-bit LAMB's"]),
                  table_row(["---", "---:", "---:", "---:"])]
        for rate in dict.fromkeys(r["rate_bps"] for r in rows):
            need = [(rate, "lamb-hsdp", WARMUP), (rate, "onebitlamb-int8-hsdp", WARMUP),
                    (rate, "onebitlamb-hsdp", COMPRESSION)]
            if not all(k in by for k in need):
                continue
            lamb_s = DEMO_STEPS * by[need[0]]["step_s"]
            onebit_s = steps.get(WARMUP, 0) * by[need[1]]["step_s"] + steps.get(COMPRESSION, 0) * by[need[2]]["step_s"]
            lines.append(table_row([rate_label(rate), f"{lamb_s / 60:.1f}", f"{onebit_s / 60:.1f}",
                                    f"{lamb_s / onebit_s:.2f}x"]))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10Mbit/s,100Mbit/s,1Gbit/s",
                        help="link rates between the hosts, each with its unit (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="timed warm-up steps a row (default %(default)s)")
    parser.add_argument("--compression-steps", type=int, default=4,
                        help="timed compression steps of 1-bit LAMB (default %(default)s)")
    parser.add_argument("--schedule", default=SCHEDULE, help="1-bit LAMB --shard 2's demo run (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per launch (default %(default)s)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    check_available()
    cleanup_stale()
    before = os.getloadavg()[0]
    raw = measure(parse_rates(args.rates), args.warmup_steps,
                  args.compression_steps, args.timeout)
    # the step times include the CPU's other load: all four ranks share this machine's cores
    load = f"; load average {before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores)"
    body = section(summarise(raw), schedule(args.schedule), command_line(argv if argv is not None else sys.argv[1:]),
                   load)
    print(body)
    if not args.no_write:
        write_section("sharded", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
