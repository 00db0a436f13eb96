"""LAMB, 1-bit LAMB, 1-bit Adam and 0/1 Adam pretraining the same BERT with identical settings.

    onebitlamb compare --preset demo --out runs/demo        # what `make demo` runs

Each optimizer runs ``onebitlamb pretrain`` into ``OUT/<optimizer>`` with the same seed, data
order, model, schedule, clipping and number of samples (only the default learning rate differs
between the LAMB family and the Adams, as in the paper; ``--lr`` sets one for all). Then this prints the
table, writes ``OUT/metrics.json``,
``OUT/table.md``, ``OUT/compare.png`` and ``OUT/diagnostics.png``. ``--resume`` skips finished
runs (when their settings are the ones asked for) and continues an interrupted one from its
checkpoint. An earlier comparison in OUT is refused without ``--resume`` or ``--overwrite``,
before anything starts, as ``pretrain`` refuses an earlier run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from typing import Dict, List

from onebitlamb.compression.wire import warmup_format
from onebitlamb.docs import pointer
from onebitlamb.train import config, files, pretrain
from onebitlamb.train.checkpoints import check_run_names, existing_run
from onebitlamb.train.ranks import under_torchrun
from onebitlamb.train.plots import LABELS, plot_compare, plot_diagnostics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """pretrain's flags, with --optimizers instead of --optimizer."""
    config.add_arguments(parser, skip=("optimizer",))
    parser.add_argument("--optimizers", nargs="+", choices=config.OPTIMIZERS, default=list(config.COMPARED_BY_DEFAULT),
                        help=f"which to run (default: {' '.join(config.COMPARED_BY_DEFAULT)}; LAMB is the reference "
                             f"of the table)")


# the files a comparison writes into OUT itself (each optimizer's run is in OUT/<optimizer>)
# (a write of metrics.json cut short leaves it under the run's temporary name: files.temporary_name)
COMPARE_FILES = ("metrics.json", "table.md", "compare.png", "diagnostics.png")


def run(args: argparse.Namespace) -> int:
    """As ``pretrain``: 0 done, 130 interrupted, 1 a non-finite loss or a rank that stopped
    answering, 2 refused at the start."""
    from onebitlamb.comm.launch import WorkerError

    try:
        return _run(args)
    except (config.SetupError, files.OutError) as exc:
        print(f"onebitlamb compare: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (config.RunError, WorkerError) as exc:
        return pretrain.report_stop(exc, "onebitlamb compare")
    except pretrain.StoppedTwice as exc:
        print(f"onebitlamb compare: error: {exc}", file=sys.stderr, flush=True)
        return 130


def _run(args: argparse.Namespace) -> int:
    args.cache_dir = args.cache_dir or os.path.join(args.out, "cache")  # one tokenized corpus for all
    # under torchrun every process runs this; rank 0 alone writes the results
    master = not under_torchrun() or int(os.environ["RANK"]) == 0
    configs = {name: config.config_from_args(args, optimizer=name, out=os.path.join(args.out, name))
               for name in args.optimizers}
    files.usable_out(args.out, args.resume)
    # held for the comparison's life, as each run holds its OUT/<optimizer> (pretrain.train)
    with files.RunLock(args.out) if master else contextlib.nullcontext():
        check_out_dir(args, configs, remove=master)
        return _compare(args, configs, master)


def _compare(args: argparse.Namespace, configs: Dict[str, "config.TrainConfig"], master: bool) -> int:
    runs: Dict[str, dict] = {}
    t_start = time.perf_counter()
    for name, cfg in configs.items():
        metrics_path = os.path.join(cfg.out, "metrics.json")
        if args.resume and os.path.exists(metrics_path):
            print(f"[{name}] finished before, reusing {metrics_path}", file=sys.stderr)
        else:
            t0 = time.perf_counter()
            result = pretrain.train(cfg)
            if not result["completed"]:
                print(f"compare stopped during {name}; `onebitlamb compare ... --resume` continues it",
                      file=sys.stderr)
                return pretrain.exit_code(result)
            if not master:
                continue
            with open(metrics_path) as f:
                m = json.load(f)
            m["process_time_s"] = time.perf_counter() - t0  # including start-up and data loading
            files.write_json(metrics_path, m)
        if master:
            with open(metrics_path) as f:
                runs[name] = json.load(f)
    if not master:
        return 0

    table = format_table(runs)
    falls = where_the_seed_falls(runs, read_measured())
    if falls:
        table += "\n\n" + "\n".join(falls)
    total = sum(m.get("process_time_s", m["wall_time_s"]) for m in runs.values())
    table += f"\ntotal {total:.0f} s for the {len(runs)} runs including start-up (this invocation: " \
             f"{time.perf_counter() - t_start:.0f} s)"
    print(table)
    files.write_text(os.path.join(args.out, "table.md"), table + "\n")
    summary = {name: {k: m.get(k) for k in ("final_eval_loss", "samples", "bytes_sent_per_rank", "rounds_per_rank",
                                            "wall_time_s",
                                            "train_time_s", "samples_per_s", "freeze_step", "world_size",
                                            "eval_curve", "bytes_curve", "rounds_curve", "diagnostics")}
               for name, m in runs.items()}
    for name, m in summary.items():
        m["eval_curve"] = [list(p) for p in m["eval_curve"]]
    out = {"optimizers": summary, "comparison": comparison(runs), "config": runs[args.optimizers[0]]["config"],
           "table": table}
    files.write_json(os.path.join(args.out, "metrics.json"), out, indent=1)
    plot_compare(runs, os.path.join(args.out, "compare.png"))
    plot_diagnostics(runs, os.path.join(args.out, "diagnostics.png"))
    print(f"wrote {args.out}/metrics.json, table.md, compare.png, diagnostics.png", file=sys.stderr)
    return 0


def check_out_dir(args: argparse.Namespace, configs: Dict[str, "config.TrainConfig"], remove: bool) -> None:
    """Before any run starts: without --resume, an earlier comparison or run in OUT is refused
    (--overwrite removes their own files, nothing else); with it, a finished run is reused only
    if its settings are the ones asked for."""
    found: List[str] = []
    for name, cfg in configs.items():
        check_run_names(cfg.out)  # a file of the user's where a run writes its own: refused, --overwrite too
        if args.resume:
            metrics_path = os.path.join(cfg.out, "metrics.json")
            if os.path.exists(metrics_path):
                with open(metrics_path) as f:
                    changed = config.changed_settings(cfg, json.load(f).get("config", {}))
                if changed:
                    raise config.SetupError(config.resume_refusal(
                        changed, f"--resume: the finished run {cfg.out} has different settings"))
        else:
            found += [f"{name}/{x}" for x in existing_run(cfg.out)]
    for f in COMPARE_FILES:
        if os.path.islink(os.path.join(args.out, f)):
            raise config.SetupError(f"{os.path.join(args.out, f)} is a link, where the comparison writes its own "
                                    f"{f}: not following it; remove the link, or choose another --out")
    # a file of the user's where the comparison writes its own: refused, --overwrite too
    check_run_names(args.out, re.compile("|".join(map(re.escape, COMPARE_FILES))))
    if not args.resume:
        found = [f for f in COMPARE_FILES if os.path.isfile(os.path.join(args.out, f))] + found
    if found and not args.overwrite:
        raise config.SetupError(f"{args.out} holds an earlier comparison ({', '.join(found)}): continue it with "
                                f"--resume, or start over with --overwrite (which removes the runs' own files "
                                f"only), or choose another --out")
    if remove:
        os.makedirs(args.out, exist_ok=True)
        if args.overwrite:
            for f in COMPARE_FILES:
                if os.path.isfile(os.path.join(args.out, f)):
                    os.remove(os.path.join(args.out, f))
            # each run's own files go when it starts (pretrain.train)


MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured.json")


def read_measured(path: str = MEASURED) -> dict:
    """The paired gaps to LAMB that ``benchmarks/fidelity.py`` measured over several seeds, by
    preset and optimizer ({} when the file is missing)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def where_the_seed_falls(runs: Dict[str, dict], measured: dict) -> List[str]:
    """One line per optimizer measured over several seeds with these settings: this run's gap to
    LAMB beside the measured mean and its 95% interval. One seed is a draw: on another machine the
    last bits differ and a 1-bit run may freeze a step earlier, which moves its final loss by about
    a percent."""
    lamb = runs.get("lamb")
    if lamb is None:
        return []
    lines = []
    for name, m in runs.items():
        entry = measured.get(m["config"].get("preset"), {}).get(name)
        # an entry measured (or a run saved) before a setting existed or was renamed, in today's terms
        ran = config.saved_settings(m["config"])
        if entry is None or any(ran.get(k, v) != v for k, v in config.saved_settings(entry["settings"]).items()):
            continue
        gap = 100 * (m["final_eval_loss"] / lamb["final_eval_loss"] - 1)
        spread = f" ± {entry['half_width_pct']:.2f} (95% interval)" if entry["half_width_pct"] is not None else ""
        seeds = entry["seeds"]
        lines.append(f"{LABELS.get(name, name)}: {gap:+.2f}% against LAMB at this seed; over seeds {seeds[0]}-"
                     f"{seeds[-1]} ({entry['command']}; {pointer('convergence', 'What the defaults give, in full')}) "
                     f"{entry['mean_pct']:+.2f}%{spread}, from "
                     f"{min(entry['gaps_pct']):+.2f}% to {max(entry['gaps_pct']):+.2f}%")
    return lines


def comparison(runs: Dict[str, dict]) -> dict:
    """Relative numbers against LAMB (when it ran): loss gap in percent, volume reduction."""
    ref = runs.get("lamb")
    out = {}
    for name, m in runs.items():
        row = {}
        if ref is not None:
            row["loss_gap_vs_lamb_pct"] = 100.0 * (m["final_eval_loss"] - ref["final_eval_loss"]) / ref["final_eval_loss"]
            row["volume_reduction_vs_lamb"] = ref["bytes_sent_per_rank"] / max(m["bytes_sent_per_rank"], 1)
        if m.get("freeze_step") and name != "zerooneadam":  # 0/1 Adam sends 1 bit before its freeze too
            w = m["freeze_step"] / m["steps"]
            # the warm-up's wire format until the freeze (r: its bytes an element over float32's), then 1 bit
            # per value: the bound the measured reduction approaches
            r = warmup_format(m.get("config", {}).get("warmup_dtype", "float32")).bytes_per_element / 4
            row["ideal_volume_reduction_fp32"] = 1.0 / (w * r + (1 - w) / 32)
        out[name] = row
    return out


def format_table(runs: Dict[str, dict]) -> str:
    rel = comparison(runs)
    samples = next(iter(runs.values()))["samples"]
    head = ["optimizer", f"held-out loss @ {samples} samples", "vs LAMB", "MB sent/worker",
            "volume vs LAMB", "rounds/worker", "wall s", "samples/s"]
    rows = []
    for name, m in runs.items():
        r = rel[name]
        gap = r.get("loss_gap_vs_lamb_pct")
        red = r.get("volume_reduction_vs_lamb")
        rows.append([LABELS.get(name, name), f"{m['final_eval_loss']:.4f}",
                     "-" if name == "lamb" or gap is None else f"{gap:+.2f}%",
                     f"{m['bytes_sent_per_rank'] / 1e6:.1f}",
                     "1.00x" if name == "lamb" else ("-" if red is None else f"{red:.2f}x less"),
                     "-" if m.get("rounds_per_rank") is None else str(m["rounds_per_rank"]),
                     f"{m['wall_time_s']:.0f}", f"{m['samples_per_s']:.0f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
    notes = []
    for name, r in rel.items():
        if "ideal_volume_reduction_fp32" in r:
            m = runs[name]
            dtype = m.get("config", {}).get("warmup_dtype", "float32")
            notes.append(f"{LABELS.get(name, name)}: warm-up {m['freeze_step']}/{m['steps']} steps, its average in {dtype}; "
                         f"ideal whole-run reduction vs fp32 LAMB 1/(w r+(1-w)/32) = {r['ideal_volume_reduction_fp32']:.2f}x "
                         f"(r: the warm-up's bytes an element over float32's)")
    world = next(iter(runs.values())).get("world_size")
    notes.append(f"{world} workers; bytes and rounds (collectives called) are what each worker sent through the "
                 f"optimizer (optimizer.comm_stats); "
                 f"wall s = training loop incl. evaluation, without start-up")
    return "\n".join(out + [""] + notes)
