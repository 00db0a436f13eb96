"""DDP benchmark: plain usage against DistributedDataParallel + register_ddp on emulated hosts.

    sudo .venv/bin/python -m benchmarks.ddp      # from the repository root; default: 4 hosts, 50M, 200M, 1G

Plain usage: an unwrapped model, the optimizer all-reduces the flat gradient inside ``step()``,
after the backward. DDP + ``onebitlamb.register_ddp``: DDP's bucketed all-reduce averages the
warm-up's gradients behind the backward, and sends nothing once the optimizer compresses. Both
train the netsim's BERT in one launch per link rate, their steps interleaved (an order drawn
afresh each round, each step after a barrier, ``onebitlamb.netsim.worker.ddp_steps``), through
the warm-up and the compression stage. Writes the "ddp" section of BENCHMARKS.md: step times of
both, the per-step ratio, the bytes the optimizer's ``comm_stats`` accounted (in the backward,
DDP's, and in ``step()``) and the bytes each host's interface counted.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from benchmarks import emulated
from benchmarks.report import command_line, heading
from onebitlamb.netsim import experiment


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4, help="emulated hosts, one worker each (default %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb (default: DDP's own, 25 MB after a 1 MB first bucket)")
    emulated.add_run_options(parser, rates="50M,200M,1G", warmup_steps=8, compression_steps=8, per="host",
                             runs="usage")
    args = parser.parse_args(argv)
    if args.hosts < 2:
        parser.error("--hosts must be >= 2")
    s = emulated.settings(parser, args, args.hosts)
    if emulated.unavailable("benchmarks.ddp", "hosts"):
        return 3
    done = emulated.run_unwinding("benchmarks.ddp", lambda: experiment.run_ddp(s, args.bucket_cap_mb,
                                                                                 log=emulated.log))
    if done is None:
        return 130
    raw, load = done
    summary = experiment.summarise_ddp(raw)
    table = experiment.format_ddp_table(summary)
    print(table)
    if args.no_write:
        return 0
    emulated.save_raw(args.raw, raw, summary)
    m = s.model
    cap = "DDP's default buckets" if args.bucket_cap_mb is None else f"bucket_cap_mb={args.bucket_cap_mb:g}"
    lines = [
        *heading("DDP: plain usage vs DistributedDataParallel + register_ddp on emulated hosts",
                 command_line(argv if argv is not None else None),
                 f". Run as root. {s.hosts} hosts (network namespaces on a bridge, tbf on both ends of every link, bucket "
                 f"{s.burst_ms:g} ms of the rate), one worker each with {s.threads} torch thread(s), gloo, all "
                 f"sharing this machine's {os.cpu_count()} cores with other work ({load})."),
        f"BERT hidden {m['hidden']}, {m['layers']} layers, {summary['params']:,} parameters, {s.batch} x 64 "
        f"tokens per host per step. Plain: the unwrapped model, the optimizer all-reduces the flat gradient "
        f"in `step()`. DDP: `DistributedDataParallel(model)` ({cap}, broadcast_buffers on) with "
        f"`register_ddp`. Both in one launch per rate, steps interleaved (order drawn afresh each round, "
        f"every step after a barrier); {s.warmup_steps} timed warm-up and {s.compression_steps} timed "
        f"compression steps of each (one untimed step before each stage). Run took "
        f"{raw['elapsed_s'] / 60:.1f} min.",
        "",
        "Step time: median over steps of the slowest rank; in brackets the medians of forward + backward "
        "(with DDP this includes waiting for its last bucket) and of `optimizer.step()`. Ratio: per step, "
        "plain over DDP (above 1: DDP faster). Accounted bytes: what this rank's `optimizer.comm_stats` "
        "recorded per step, during the backward (DDP's hook) and in `step()`. Wire bytes: the host's "
        "`tx_bytes` per step (TCP/IP headers, ACKs, DDP's buffer broadcast and gloo's own messages "
        "included; one bare barrier's bytes subtracted), mean over ranks. Qdisc drops per rate: "
        + ", ".join(f"{k} {v}" for k, v in summary["qdisc_drops"].items()) + ".",
    ]
    return emulated.write_report("ddp", lines, table, None, [], args)


if __name__ == "__main__":
    sys.exit(main())
