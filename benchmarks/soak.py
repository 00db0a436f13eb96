"""Soak: a long compression stage on 4 local gloo ranks, watching the error buffers and memory.

    python -m benchmarks.soak [--quick] [--results PATH] [--plot PNG]     # from the repository root

A small real model (an MLP regressing a fixed random teacher with label noise, each rank drawing
its own data) is trained on 4 ranks spawned by ``spawn_local`` (gloo on loopback, one thread
each) by 1-bit LAMB, then by 1-bit Adam: 20 warm-up steps, then 2,000 compression-stage steps at a
constant learning rate (no decay that would shrink the momentum and hide a growing error).

Every ``--every`` steps each rank records the norms of its compression errors
(``opt.state["flat"]["worker_error"]`` and ``["server_error"]``), in absolute terms (the
compressor's units: each layer's momentum scaled by ``momentum_scale``) and relative to the norm
of the momentum they compress (the synchronized momentum in the same units, its whole length for
the worker error, this rank's chunk of it for the server error); the mean training loss since the
last record; and the process's resident memory (VmRSS of ``/proc/self/status``).

Verdicts: the errors are *bounded* when the largest norm (over ranks) in the stage's last quarter
is at most ERROR_GROWTH_LIMIT times the largest in its first quarter; memory is *flat* when every
rank's resident memory grew by less than RSS_GROWTH_LIMIT_MB from the first record after the freeze
(the first compression step allocates the communication buffers and the compressor's workspaces,
once) to the median of its records in the last quarter (the allocator moves RSS by a MiB or two
now and then, both ways; a leak of 3 KiB a step would pass the limit).

The table goes to the "soak" section of BENCHMARKS.md (or of ``--results``), the plot (error
norms, loss and resident memory against the compression step, one line per rank) to
docs/soak.png (or ``--plot``). ``--quick``: a few steps, a smoke test of the whole pipeline.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from benchmarks.report import command_line, heading, table_row, write_section

DOCS = Path(__file__).resolve().parents[1] / "docs"
TITLE = "Soak: 2,000 compression-stage steps on 4 ranks"
WORLD_SIZE = 4
FREEZE_STEP = 20
COMPRESSION_STEPS = 2000
RECORD_EVERY = 10
QUICK = dict(freeze=5, steps=40, every=2)
ERROR_GROWTH_LIMIT = 2.0   # bounded: last quarter's max <= this x first quarter's max
RSS_GROWTH_LIMIT_MB = 5.0  # flat: resident memory grows by less than this over the stage
OPTIMIZERS = {"onebitlamb": "1-bit LAMB", "onebitadam": "1-bit Adam"}
BUFFERS = {"worker": "worker error", "server": "server error"}

# the problem: inputs -> teacher (fixed, random) + label noise; the student is the trained MLP
IN, HIDDEN, OUT, TEACHER_HIDDEN = 64, 512, 16, 64
BATCH, NOISE, LR, WEIGHT_DECAY, SEED = 64, 0.1, 0.01, 0.01, 0


def rss_mb() -> float:
    """This process's resident memory in MiB (VmRSS); where /proc is missing, the peak so far."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0)


def build_model(seed: int = SEED):
    """The student (the same initial weights on every rank) and the teacher it regresses."""
    import torch

    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(IN, TEACHER_HIDDEN), torch.nn.Tanh(),
                                  torch.nn.Linear(TEACHER_HIDDEN, OUT))
    student = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                  torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))
    for p in teacher.parameters():
        p.requires_grad_(False)
    return student, teacher


def error_norms(opt, rank: int, world_size: int) -> Dict[str, float]:
    """Norms of this rank's two error buffers, absolute and relative to the momentum they compress
    (the synchronized momentum in the compressor's units)."""
    import torch

    flat = opt.state["flat"]
    worker, server = flat["worker_error"], flat["server_error"]
    layer_numels = torch.tensor(flat["layer_numels"])
    scaled = torch.zeros_like(worker)
    d = int(layer_numels.sum())
    torch.mul(flat["exp_avg"], torch.repeat_interleave(flat["momentum_scale"], layer_numels), out=scaled[:d])
    chunk = server.numel()
    m_all, m_chunk = scaled.norm().item(), scaled[rank * chunk:(rank + 1) * chunk].norm().item()
    w, s = worker.norm().item(), server.norm().item()
    return dict(worker=w, server=s, worker_rel=w / m_all if m_all > 0 else float("nan"),
                server_rel=s / m_chunk if m_chunk > 0 else float("nan"))


def _soak_worker(rank: int, world_size: int, kind: str, freeze: int, steps: int, every: int) -> dict:
    """One rank: ``freeze`` warm-up steps, ``steps`` compression steps; a record every ``every``."""
    import torch

    import onebitlamb

    cls = {"onebitlamb": onebitlamb.OneBitLamb, "onebitadam": onebitlamb.OneBitAdam}[kind]
    student, teacher = build_model()
    opt = cls(student.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, freeze_step=freeze)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    records: List[dict] = []
    losses: List[float] = []
    t0 = time.perf_counter()
    warmup_s = compression_s = 0.0
    for t in range(1, freeze + steps + 1):
        x = torch.randn(BATCH, IN, generator=gen)
        y = teacher(x) + NOISE * torch.randn(BATCH, OUT, generator=gen)
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(student(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        k = t - freeze  # compression steps done
        if k == 0:
            if opt.stage != "compression":
                raise RuntimeError(f"{kind}: not frozen after step {t}")
            warmup_s = time.perf_counter() - t0
        if k >= 0 and k % every == 0:
            window = losses[-every:]
            records.append(dict(step=k, loss=sum(window) / len(window), rss_mb=rss_mb(),
                                **error_norms(opt, rank, world_size)))
    compression_s = time.perf_counter() - t0 - warmup_s
    return dict(records=records, warmup_s=warmup_s, compression_s=compression_s,
                numel=sum(p.numel() for p in student.parameters()), skipped=opt.skipped_steps)


def run(kind: str, freeze: int, steps: int, every: int, world_size: int = WORLD_SIZE) -> List[dict]:
    """Each rank's result of one soak."""
    from onebitlamb.comm.launch import spawn_local

    return spawn_local(_soak_worker, world_size, args=(kind, freeze, steps, every),
                       timeout_s=1800, collective_timeout_s=120)


# ---------------------------------------------------------------- summary (pure, tested by hand)
def quarter(records: Sequence[dict], steps: int, q: int) -> List[dict]:
    """The records of the compression stage's quarter ``q`` (1..4): ``(q-1) steps/4 < step <= q steps/4``."""
    return [r for r in records if (q - 1) * steps / 4 < r["step"] <= q * steps / 4]


def summarize(per_rank: Sequence[Sequence[dict]], steps: int) -> dict:
    """Verdicts and figures of one soak from each rank's records (dicts with step, loss, rss_mb,
    worker, server, worker_rel, server_rel; step 0 is the end of the warm-up).

    For each error norm (absolute and relative): min and max over all ranks in the first and the
    last quarter, the ratio of the maxima and whether it is within ERROR_GROWTH_LIMIT; and the
    ratio of the last quarter's mean to the second's (past the transient after the freeze, where
    the buffers fill up: a slow drift shows there). Memory: the
    resident memory at the freeze, at the first record after it (the baseline) and at the end,
    each as the min and max over ranks; the largest growth of one rank from its baseline to the
    median of its last quarter, and whether it is under RSS_GROWTH_LIMIT_MB. Loss: the mean over ranks at the freeze and
    at the end."""
    out: dict = {"errors": {}}
    for key in ("worker", "server", "worker_rel", "server_rel"):
        first, second, last = ([r[key] for records in per_rank for r in quarter(records, steps, q)]
                               for q in (1, 2, 4))
        if not first or not second or not last:
            raise ValueError(f"too few records for quarters of {steps} steps")
        ratio = max(last) / max(first)
        out["errors"][key] = dict(first_min=min(first), first_max=max(first), last_min=min(last),
                                  last_max=max(last), ratio=ratio, bounded=ratio <= ERROR_GROWTH_LIMIT,
                                  drift=(sum(last) / len(last)) / (sum(second) / len(second)))
    at = lambda records, i, key: records[i][key]  # noqa: E731
    base_index = 1  # the first record after the freeze
    growth = [statistics.median(x["rss_mb"] for x in quarter(r, steps, 4)) - at(r, base_index, "rss_mb")
              for r in per_rank]
    out["rss"] = dict(
        freeze=(min(at(r, 0, "rss_mb") for r in per_rank), max(at(r, 0, "rss_mb") for r in per_rank)),
        baseline_step=per_rank[0][base_index]["step"],
        baseline=(min(at(r, base_index, "rss_mb") for r in per_rank), max(at(r, base_index, "rss_mb") for r in per_rank)),
        end=(min(at(r, -1, "rss_mb") for r in per_rank), max(at(r, -1, "rss_mb") for r in per_rank)),
        growth=max(growth), flat=max(growth) < RSS_GROWTH_LIMIT_MB)
    n = len(per_rank)
    out["loss"] = dict(freeze=sum(at(r, 0, "loss") for r in per_rank) / n,
                       end=sum(at(r, -1, "loss") for r in per_rank) / n)
    return out


# ---------------------------------------------------------------- report
def _range(lo: float, hi: float, fmt: str) -> str:
    return f"{lo:{fmt}} – {hi:{fmt}}"


def render(results: Dict[str, dict], command: str, freeze: int, steps: int, every: int, elapsed_s: float,
           plot_path: str) -> str:
    numel = next(iter(results.values()))["ranks"][0]["numel"]
    lines = [
        *heading(TITLE if steps == COMPRESSION_STEPS else f"{TITLE} (here {steps:,})", command,
                 f", {os.cpu_count()} cores shared by the {WORLD_SIZE} ranks and other work, "
                 f"load average at the end {os.getloadavg()[0]:.1f}"),
        f"An MLP ({IN}-{HIDDEN}-{HIDDEN}-{OUT}, GELU, {numel:,} parameters) regressing a fixed random teacher "
        f"with label noise {NOISE:g}, batch {BATCH} per rank, each rank its own data; {WORLD_SIZE} local gloo "
        f"ranks, one thread each; lr {LR:g} constant, weight decay {WEIGHT_DECAY:g}, `freeze_step={freeze}`, "
        f"then {steps:,} compression-stage steps, a record every {every} steps. The whole run took "
        f"{elapsed_s / 60:.1f} min. Plot: {plot_path}.",
        "",
        "Error norms: min – max over the 4 ranks' records in the compression stage's first and last quarter; "
        "absolute in the compressor's units (each layer's momentum scaled by `momentum_scale`), relative to the "
        "norm of the synchronized momentum in those units (the server error: this rank's chunk of it). "
        f"Bounded: the last quarter's max at most {ERROR_GROWTH_LIMIT:g}x the first quarter's. The first quarter "
        "holds the transient after the freeze (the buffers fill within a few dozen steps, then settle lower); "
        "the drift column compares the last quarter's mean with the second quarter's, past it.",
        "",
        table_row(["optimizer", "norm", "first quarter", "last quarter", "last max / first max",
                   "drift: last / 2nd quarter mean", "bounded"]),
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for kind, res in results.items():
        s = res["summary"]
        for key, label in (("worker", "worker error"), ("server", "server error"),
                           ("worker_rel", "worker error / momentum"), ("server_rel", "server error / momentum chunk")):
            e = s["errors"][key]
            lines.append(table_row([OPTIMIZERS[kind], label, _range(e["first_min"], e["first_max"], ".3g"),
                                    _range(e["last_min"], e["last_max"], ".3g"), f"{e['ratio']:.2f}",
                                    f"{e['drift']:.2f}", "yes" if e["bounded"] else "NO"]))
    lines += [
        "",
        "Resident memory (VmRSS) of each rank's process, MiB, min – max over the ranks: at the freeze, after the "
        "first record of the compression stage (the baseline: the first compression step allocates the "
        "communication buffers and workspaces once) and at the end; growth: the largest of one rank's, from its "
        f"baseline to the median of its last quarter; flat: under {RSS_GROWTH_LIMIT_MB:g} MiB. Loss: mean training loss of the last {every} steps, "
        "averaged over the ranks. Steps per second: the slowest rank's.",
        "",
        table_row(["optimizer", "RSS at freeze", "RSS baseline (step)", "RSS at end", "growth", "flat",
                   "loss at freeze", "loss at end", "warm-up steps/s", "compression steps/s"]),
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for kind, res in results.items():
        s, ranks = res["summary"], res["ranks"]
        m = s["rss"]
        warm = freeze / max(r["warmup_s"] for r in ranks)
        comp = steps / max(r["compression_s"] for r in ranks)
        lines.append(table_row([
            OPTIMIZERS[kind], _range(*m["freeze"], ".1f"), f"{_range(*m['baseline'], '.1f')} ({m['baseline_step']})",
            _range(*m["end"], ".1f"), f"{m['growth']:+.2f}", "yes" if m["flat"] else "NO",
            f"{s['loss']['freeze']:.4f}", f"{s['loss']['end']:.4f}", f"{warm:.1f}", f"{comp:.1f}"]))
    skipped = {kind: max(r["skipped"] for r in res["ranks"]) for kind, res in results.items()}
    verdicts = []
    for kind, res in results.items():
        s = res["summary"]
        bounded = all(e["bounded"] for e in s["errors"].values())
        verdicts.append(f"{OPTIMIZERS[kind]}: errors {'bounded' if bounded else 'NOT bounded'}, memory "
                        f"{'flat' if s['rss']['flat'] else 'NOT flat'}, {skipped[kind]} steps skipped")
    lines += ["", "Verdict: " + "; ".join(verdicts) + "."]
    return "\n".join(lines) + "\n"


def plot(results: Dict[str, dict], path: Path) -> None:
    """Worker and server error norms, loss and resident memory against the compression step, one
    line per rank, one column per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("worker", "worker error norm", "linear"), ("server", "server error norm", "linear"),
              ("loss", "training loss (window mean)", "linear"), ("rss_mb", "resident memory (MiB)", "linear")]
    cols = len(results)
    fig, axes = plt.subplots(len(panels), cols, figsize=(5.5 * cols, 2.4 * len(panels)), sharex=True, squeeze=False)
    for c, (kind, res) in enumerate(results.items()):
        for row, (key, label, scale) in enumerate(panels):
            ax = axes[row][c]
            for rank, records in enumerate(res["ranks"]):
                recs = records["records"]
                ax.plot([r["step"] for r in recs], [r[key] for r in recs], lw=1, label=f"rank {rank}")
            ax.set_yscale(scale)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(OPTIMIZERS[kind])
            if key == "rss_mb":
                limit = res["summary"]["rss"]["baseline"][1] + RSS_GROWTH_LIMIT_MB
                ax.axhline(limit, color="grey", ls="--", lw=1, label=f"highest baseline + {RSS_GROWTH_LIMIT_MB:g} MiB")
                ax.legend(fontsize=8, loc="lower right")
                ax.set_xlabel("compression-stage step")
                ax.ticklabel_format(axis="y", useOffset=False)
        axes[0][c].legend(fontsize=8, ncol=2)
    fig.suptitle(f"Soak: {WORLD_SIZE} gloo ranks, error buffers and memory over the compression stage")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shown(path: Path) -> str:
    """A path as the section names it: relative to the repository root when inside it."""
    root = DOCS.parent
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['freeze']} warm-up and {QUICK['steps']} compression steps, a smoke test")
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS),
                        help="which to soak (default: all)")
    parser.add_argument("--results", type=Path, default=None,
                        help="markdown file to write the section into (default: BENCHMARKS.md)")
    parser.add_argument("--plot", type=Path, default=DOCS / "soak.png", help="PNG to write (default: docs/soak.png)")
    args = parser.parse_args(argv)
    command = command_line(argv, "python -m benchmarks.soak")
    freeze, steps, every = ((QUICK["freeze"], QUICK["steps"], QUICK["every"]) if args.quick
                            else (FREEZE_STEP, COMPRESSION_STEPS, RECORD_EVERY))
    start = time.perf_counter()
    results: Dict[str, dict] = {}
    for kind in args.optimizers:
        t0 = time.perf_counter()
        ranks = run(kind, freeze, steps, every)
        summary = summarize([r["records"] for r in ranks], steps)
        results[kind] = dict(ranks=ranks, summary=summary)
        print(f"{OPTIMIZERS[kind]}: {time.perf_counter() - t0:.0f} s; worker error max ratio "
              f"{summary['errors']['worker']['ratio']:.2f}, RSS growth {summary['rss']['growth']:+.2f} MiB", flush=True)
    elapsed = time.perf_counter() - start
    plot(results, args.plot)
    body = render(results, command, freeze, steps, every, elapsed, _shown(args.plot))
    path = write_section("soak", body, args.results)
    print(body)
    print(f"written to {path} and {args.plot}")
    return body


if __name__ == "__main__":
    main()
