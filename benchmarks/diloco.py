"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105) as a reference, on the main job's data, model, batch, schedule and evaluation.

    python -m benchmarks.diloco --preset tiny --H 8                 # about a minute on 2 cores
    python -m benchmarks.diloco --preset tiny --H 8 16 --lamb       # a short grid, LAMB beside it
    python -m benchmarks.diloco --preset demo --H 8 16 32 64 --lamb # the demo's grid (hours on 2 cores)

The algorithm (``DiLoCo``). Every worker starts from the same parameters theta and takes H inner
steps with its own optimizer, here LAMB (``onebitlamb.Lamb`` on a process group of its one rank:
it sends nothing, and its moments stay this worker's). Then each worker's outer gradient is
``theta - theta_i``, what its H steps moved it by; the workers average it with one float32
all-reduce, and an outer optimizer steps theta with the average: SGD with Nesterov momentum, the
paper's lr 0.7 and momentum 0.9. Every worker continues from the new theta, the same bits on every
rank; the inner moments are not reset. With H = 1, outer lr 1 and no momentum it is parameter
averaging after every step, which for an inner SGD without momentum is synchronous SGD on the mean
gradient (the tests check that, and H > 1 against a loop of n workers in one process).

The job (``train_rank``): ``onebitlamb pretrain``'s, from its own building blocks (the config and
presets, the corpus and each step's shard, the model, the micro-batches, the clipping, the
learning-rate schedule, the held-out evaluation), with DiLoCo instead of the main job's optimizer.
The inner LAMB takes the flags' ``--lr`` (2e-2 by default, LAMB's) with the main job's warm-up and
decay; the outer learning rate is constant. The differences, all DiLoCo's own:

- the inner steps exchange nothing: no per-step check that every rank's loss is finite (a non-finite
  model reaches the next sync, whose averaged outer gradient then stops every rank alike);
- a sync every H steps, and one after the last step when H does not divide the steps, so that the
  run ends on parameters every rank shares;
- the held-out loss is that of the synced parameters theta (between syncs each rank holds its
  own), so an evaluation between two syncs reports the last sync's model;
- no checkpoints, no ``--resume``, no per-layer diagnostics (``metrics.json`` keeps the key, empty).

Each run writes OUT/PRESET/SEED/diloco-H<H> (OUT/PRESET-<N>steps/... when ``--steps`` is given):
``metrics.json`` and ``log.csv`` in the main job's format (``"optimizer": "diloco"`` and a
``"diloco"`` entry with H, the outer settings and the syncs), ``model_final.pt`` and ``curves.png``.
The bytes and rounds are each worker's, counted as the library counts its float32 all-reduce
(``onebitlamb.comm.allreduce_mean_`` into a ``CommStats``): ``2 (n-1)/n * 4 d`` bytes per sync
for ``d`` parameters, LAMB's bytes of one step. A folder that holds metrics.json of the same
settings is reused (``--overwrite`` runs it again); ``--lamb`` runs (or reuses) ``onebitlamb
pretrain --optimizer lamb`` with the same flags in OUT/PRESET/SEED/lamb, the folder
``benchmarks.convergence`` uses (with ``--out runs/convergence``, its finished LAMB run of the
same settings is the one reused), and puts it beside the grid. ``render`` makes a markdown section
of any such runs, for a whole-run comparison script to write with ``benchmarks.report.write_section``;
this script writes one only into the file ``--results`` names.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import json
import math
import os
import shlex
import sys
import time
import typing
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

import onebitlamb
from onebitlamb.comm import CommStats, allreduce_mean_
from onebitlamb.train import data, files, plots, runlog
from onebitlamb.train.config import SetupError, TrainConfig, add_arguments, changed_settings, config_from_args
from onebitlamb.train.loop import clip_gradients, forward_backward, lr_factor, prepare_corpus, start_rank
from onebitlamb.train.metrics import evaluate_mlm
from onebitlamb.train.ranks import check_ranks_agree, gather_bytes

# the paper's outer optimizer: SGD with Nesterov momentum
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
TITLE = "DiLoCo against LAMB on the main job"


# ----------------------------------------------------------------------------------------------
# The algorithm


def flatten(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' values, one float32 vector (a copy), in ``params``' order."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


@torch.no_grad()
def load_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into the parameters, in place (``vector_to_parameters`` would make each
    parameter a view of ``flat`` instead)."""
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.copy_(chunk.view_as(p))


class DiLoCo:
    """DiLoCo's state on one rank: the parameters of the last sync (``anchor``, float32, the same on
    every rank), the outer optimizer that steps them, H, the counters and the bytes sent.

    Call ``step()`` after each step of the inner optimizer (which must not communicate: a
    ``torch.optim`` optimizer, or ``onebitlamb.Lamb`` on a process group of this rank alone). Every
    ``H``-th call syncs: the outer gradient ``anchor - params`` averaged over ``process_group``
    (one float32 all-reduce), the outer optimizer's step on the anchor with it, and the anchor
    copied into the parameters. ``step(sync=True)`` syncs now (the run's last step)."""

    def __init__(self, params: Iterable[torch.Tensor], H: int, *, outer_lr: float = OUTER_LR,
                 outer_momentum: float = OUTER_MOMENTUM, process_group: Optional[dist.ProcessGroup] = None) -> None:
        if isinstance(H, bool) or not isinstance(H, int) or H < 1:
            raise ValueError(f"H must be a number of inner steps >= 1, got {H!r}")
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got {outer_lr!r}, {outer_momentum!r}")
        unique: Dict[int, torch.Tensor] = {}
        for p in params:  # a tied weight once, as the optimizers take it
            if p.requires_grad and p.numel() > 0:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        self.H, self.process_group = H, process_group
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.anchor = flatten(self.params)
        self.outer = torch.optim.SGD([self.anchor], lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.comm_stats = CommStats()
        self.since_sync = 0  # inner steps since the last sync
        self.syncs = 0
        self.failed = False  # an inner step of this rank failed since the last sync

    @property
    def numel(self) -> int:
        return self.anchor.numel()

    def step(self, sync: bool = False, finite: bool = True) -> bool:
        """One inner step is done; sync when it is the H-th since the last sync (or ``sync``).
        ``finite=False``: this rank's inner step failed (its model is lost); it goes on to the next
        sync, which every rank reaches at the same step, and sends NaN there, so that every rank
        stops at that sync alike. Returns whether this step synced."""
        self.since_sync += 1
        self.failed = self.failed or not finite
        if not (sync or self.since_sync >= self.H):
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step, on every rank alike; FloatingPointError on every rank when the averaged
        outer gradient is not finite (on any rank), the parameters left as they were."""
        outer_grad = self.anchor - flatten(self.params)
        if self.failed:
            outer_grad.fill_(math.nan)
        allreduce_mean_(outer_grad, self.process_group, self.comm_stats)  # one float32 all-reduce, counted
        if not bool(torch.isfinite(outer_grad).all()):
            raise FloatingPointError(f"DiLoCo: the averaged outer gradient of sync {self.syncs + 1} is not finite "
                                     f"(a rank's model diverged in its inner steps)")
        self.anchor.grad = outer_grad
        self.outer.step()
        self.anchor.grad = None
        load_flat(self.params, self.anchor)
        self.since_sync = 0
        self.syncs += 1

    @contextlib.contextmanager
    def synced_parameters(self) -> Iterator[None]:
        """Inside: the parameters are the last sync's (what the run has agreed on), e.g. to evaluate
        between two syncs; after: this rank's own again, bit for bit."""
        if self.since_sync == 0:
            yield
            return
        own = flatten(self.params)
        load_flat(self.params, self.anchor)
        try:
            yield
        finally:
            load_flat(self.params, own)


def own_group(rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """A process group of this rank alone, for an inner optimizer that must not communicate
    (every rank makes every rank's group: ``dist.new_group`` is collective)."""
    groups = [dist.new_group([r], timeout=datetime.timedelta(seconds=timeout_s)) for r in range(world)]
    return groups[rank]


def inner_lamb(groups, cfg: TrainConfig, process_group: dist.ProcessGroup) -> onebitlamb.Lamb:
    """The main job's LAMB (``loop.make_optimizer`` for ``--optimizer lamb``), on this rank's own group."""
    return onebitlamb.Lamb(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                           weight_decay=cfg.weight_decay, process_group=process_group)


# ----------------------------------------------------------------------------------------------
# The job: one rank's run


@dataclass(frozen=True)
class Settings:
    """DiLoCo's own settings (the rest is the main job's TrainConfig)."""
    H: int
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM

    @property
    def name(self) -> str:
        """The run's folder and row: ``diloco-H8``, with the outer settings when not the paper's."""
        paper = (self.outer_lr, self.outer_momentum) == (OUTER_LR, OUTER_MOMENTUM)
        return f"diloco-H{self.H}" + ("" if paper else f"-olr{self.outer_lr:g}-om{self.outer_momentum:g}")


def train_rank(rank: int, world: int, cfg: TrainConfig, settings: Settings) -> dict:
    """One rank's DiLoCo run of the main job; rank 0 writes the results. Returns the summary
    (``error`` set when the run stopped: a non-finite loss or outer gradient)."""
    setup = start_rank(cfg, rank, world)  # the main job's seeds, data and model
    device, corpus, accum, model, names = setup.device, setup.corpus, setup.accum, setup.model, setup.names
    eval_inputs, eval_labels = setup.eval_inputs, setup.eval_labels
    master = rank == 0
    inner = inner_lamb(setup.groups, cfg, own_group(rank, world, cfg.timeout))
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lr_factor(cfg))
    diloco = DiLoCo(names.values(), settings.H, outer_lr=settings.outer_lr, outer_momentum=settings.outer_momentum)

    history = {"steps": [], "eval": [], "diagnostics": [], "train_time_s": 0.0, "wall_time_s": 0.0}
    log = RunLog(cfg, settings, history) if master else None

    def evaluate(step: int) -> Optional[str]:
        with diloco.synced_parameters():
            loss = evaluate_mlm(model, eval_inputs, eval_labels, 2 * cfg.micro_batch, device)
        if not math.isfinite(loss):
            return f"the held-out loss is {loss} after step {step}"
        history["eval"].append([step * cfg.global_batch, loss])
        return None

    error = evaluate(0)
    if log is not None and error is None:
        log.report(0)
    t_wall0, failed = time.perf_counter(), None
    for step in range(cfg.steps if error is None else 0):
        t0 = time.perf_counter()
        inputs, labels = data.rank_batch(corpus, step, rank, world, cfg.global_batch, cfg.seed, cfg.mask_prob)
        loss_sum = forward_backward(model, inner, inputs, labels, accum, cfg.micro_batch, device)
        if cfg.clip > 0:
            clip_gradients(model, cfg.clip)
        lr = scheduler.get_last_lr()[0]
        finite = True
        try:
            inner.step()  # this rank alone
        except FloatingPointError as exc:  # its skips in a row: it sends NaN at the next sync
            finite, failed = False, failed or f"rank {rank}, step {step + 1}: {exc}"
        scheduler.step()
        try:
            synced = diloco.step(sync=step + 1 == cfg.steps, finite=finite)
        except FloatingPointError as exc:
            error = failed or f"step {step + 1}: {exc}"
            break
        history["train_time_s"] += time.perf_counter() - t0
        history["steps"].append({"loss": loss_sum, "bytes": diloco.comm_stats.bytes_sent + inner.comm_stats.bytes_sent,
                                 "collectives": diloco.comm_stats.calls + inner.comm_stats.calls,
                                 "stage": "sync" if synced else "local", "lr": lr, "freeze": None,
                                 "skipped": bool(inner.last_step_skipped)})
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            error = evaluate(done)
            if error is not None:
                break
        history["wall_time_s"] = time.perf_counter() - t_wall0
        if log is not None:
            log.report(done)
    if log is not None:
        log.close()
    if error is not None:
        error = f"[{settings.name}] stopped: {error}; no metrics written"
        if master:
            print(error, file=sys.stderr, flush=True)
        return {"completed": False, "error": error, "step": len(history["steps"])}

    check_ranks_agree(model, rank, world, cfg.steps, device)  # the last sync left every rank alike
    assert inner.comm_stats.bytes_sent == 0, "the inner optimizer communicated"
    ranks_bytes = gather_bytes(diloco.comm_stats.bytes_sent, world, device)
    summary = {"completed": True, "step": cfg.steps}
    if master:
        summary.update(write_results(cfg, settings, world, history, ranks_bytes, list(names), model, diloco.syncs))
    return summary


class RunLog:
    """Rank 0's ``log.csv`` (the main job's columns and rows: ``runlog.row``) and a line per
    evaluation."""

    def __init__(self, cfg: TrainConfig, settings: Settings, history: dict) -> None:
        self.cfg, self.name, self.history = cfg, settings.name, history
        self.file = files.create(os.path.join(cfg.out, runlog.CSV_FILE), binary=False, newline="")
        self.csv = csv.writer(self.file)
        self.csv.writerow(runlog.COLUMNS)

    def report(self, step: int) -> None:
        values = runlog.row(step, self.history, self.cfg.global_batch)
        self.csv.writerow(values)
        self.file.flush()
        record = dict(zip(runlog.COLUMNS, values))
        if record["heldout_loss"] != "":
            rest = "" if step == 0 else (f" | train loss {record['loss']:.4f}, {record['bytes'] / 1e6:.2f} MB sent, "
                                         f"{record['collectives']} syncs, {step}/{self.cfg.steps}")
            print(f"[{self.name}] step {step}: held-out loss {record['heldout_loss']:.4f}{rest}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        self.file.close()


def write_results(cfg: TrainConfig, settings: Settings, world: int, history: dict, ranks_bytes: List[int],
                  layers: List[str], model, syncs: int) -> dict:
    """OUT/metrics.json with the keys of the main job's (``metrics.write_metrics``), DiLoCo's
    settings beside them, OUT/model_final.pt and OUT/curves.png. Returns the summary's numbers."""
    steps = history["steps"]
    samples = cfg.steps * cfg.global_batch
    metrics = {
        "optimizer": "diloco",
        "world_size": world,
        "final_eval_loss": history["eval"][-1][1],
        "samples": samples,
        "steps": cfg.steps,
        "freeze_step": None,
        "warmup_steps": 0,
        "skipped_steps": [i + 1 for i, r in enumerate(steps) if r["skipped"]],
        "bytes_sent_per_rank": sum(ranks_bytes) / len(ranks_bytes),
        "bytes_sent_by_rank": ranks_bytes,
        "rounds_per_rank": steps[-1]["collectives"] if steps else 0,
        "wall_time_s": history["wall_time_s"],
        "train_time_s": history["train_time_s"],
        "samples_per_s": samples / max(history["train_time_s"], 1e-9),
        "eval_curve": history["eval"],
        "bytes_curve": [[i + 1, r["bytes"]] for i, r in enumerate(steps)],
        "rounds_curve": [[i + 1, r["collectives"]] for i, r in enumerate(steps)],
        "train_loss": [r["loss"] for r in steps],
        "stage": [r["stage"] for r in steps],
        "lr": [r["lr"] for r in steps],
        "diagnostics": history["diagnostics"],
        "config": dataclasses.asdict(cfg),  # the inner optimizer's ("optimizer": "lamb") and the job's
        "freeze": None,
        "layers": layers,
        "diloco": {**dataclasses.asdict(settings), "nesterov": settings.outer_momentum > 0, "inner": cfg.optimizer,
                   "syncs": syncs, "sync_steps": [i + 1 for i, r in enumerate(steps) if r["stage"] == "sync"]},
    }
    data.atomic_save(model.state_dict(), os.path.join(cfg.out, "model_final.pt"))
    files.write_json(os.path.join(cfg.out, "metrics.json"), metrics)
    try:  # after the metrics are safe: a figure that fails to draw must not fail the run
        plots.plot_run(metrics, os.path.join(cfg.out, "curves.png"))
    except Exception as exc:  # noqa: BLE001 (matplotlib's errors have no common type)
        print(f"[{settings.name}] curves.png not drawn: {exc!r}", file=sys.stderr)
    print(f"[{settings.name}] done: held-out loss {metrics['final_eval_loss']:.4f} after {samples} samples, "
          f"{metrics['bytes_sent_per_rank'] / 1e6:.2f} MB and {metrics['rounds_per_rank']} rounds per worker "
          f"({syncs} syncs), {metrics['wall_time_s']:.0f} s", file=sys.stderr, flush=True)
    return {k: metrics[k] for k in ("final_eval_loss", "samples", "bytes_sent_per_rank", "rounds_per_rank")}


# ----------------------------------------------------------------------------------------------
# Launching, the grid, the LAMB beside it, the table


def run(cfg: TrainConfig, settings: Settings, overwrite: bool = False) -> dict:
    """The metrics of one DiLoCo run in ``cfg.out``: read when a run of the same settings finished
    there, else trained on ``cfg.workers`` local ranks (gloo on loopback)."""
    done = os.path.join(cfg.out, "metrics.json")
    if os.path.exists(done) and not overwrite:
        with open(done) as f:
            saved = json.load(f)
        differ = {**changed_settings(cfg, saved.get("config", {})),
                  **{k: (saved.get("diloco", {}).get(k), v) for k, v in dataclasses.asdict(settings).items()
                     if saved.get("diloco", {}).get(k) != v}}
        if differ:
            raise SetupError(f"{cfg.out} holds a finished run of other settings ({differ}, saved then now): "
                             f"give another --out, or --overwrite to run it again")
        print(f"[{settings.name}] reusing the finished run in {cfg.out}", file=sys.stderr, flush=True)
        return saved
    from onebitlamb.comm.launch import spawn_local

    cfg.check(cfg.workers)
    os.makedirs(cfg.out, exist_ok=True)
    for name in ("metrics.json", "model_final.pt", "curves.png"):  # an earlier run's, before this one writes
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(cfg.out, name))
    prepare_corpus(cfg)  # once, before the ranks load it
    print(f"[{settings.name}] {cfg.workers} workers, {cfg.steps} steps of {cfg.global_batch} samples, inner LAMB "
          f"lr {cfg.lr:g} (warm-up {cfg.warmup_steps} steps), a sync every {settings.H} steps, outer SGD lr "
          f"{settings.outer_lr:g} momentum {settings.outer_momentum:g}"
          f"{' (Nesterov)' if settings.outer_momentum > 0 else ''}", file=sys.stderr, flush=True)
    summary = spawn_local(train_rank, cfg.workers, args=(cfg, settings), timeout_s=7 * 24 * 3600,
                          collective_timeout_s=cfg.timeout, threads_per_worker=cfg.threads)[0]
    if summary.get("error"):
        return {"error": summary["error"]}
    with open(done) as f:
        return json.load(f)


# the flags of `onebitlamb pretrain` that have no meaning here (the inner optimizer is LAMB, there
# are no checkpoints) or that this script sets itself (out, overwrite)
SKIPPED_FLAGS = ("optimizer", "out", "resume", "overwrite", "freeze", "var_freeze", "var_update_scaler",
                 "local_step_scaler", "warmup_dtype", "compression_space", "stage2_bound", "trust_ratio_after_freeze",
                 "bucket_cap_mb", "local_size", "agree_every", "ckpt_every", "progress", "stop_after_steps")


def run_root(out: str, cfg: TrainConfig, steps_given: bool) -> str:
    """OUT/PRESET/SEED, OUT/PRESET-<N>steps/SEED when --steps was given (``convergence.run_folder``'s)."""
    return os.path.join(out, cfg.preset if not steps_given else f"{cfg.preset}-{cfg.steps}steps", str(cfg.seed))


def pretrain_flags(args: argparse.Namespace) -> List[str]:
    """The flags of ``onebitlamb pretrain`` given on this command line (those it shares), as given:
    the LAMB run beside the grid is the same job (``--cache-dir`` and ``--out`` are the caller's)."""
    hints = typing.get_type_hints(TrainConfig)
    out: List[str] = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is None or "help" not in f.metadata or f.name in SKIPPED_FLAGS + ("cache_dir",):
            continue
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            if value != f.default:
                out.append(("--no-" + flag[2:]) if f.default else flag)
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def run_lamb(root: str, args: argparse.Namespace, cfg: TrainConfig) -> dict:
    """``onebitlamb pretrain --optimizer lamb`` with this command line's flags, in ROOT/lamb (run, or
    reused when finished with the same settings; ``benchmarks.convergence.run_one``)."""
    from benchmarks.convergence import run_one

    folder = os.path.join(root, "lamb")
    lamb_cfg = dataclasses.replace(cfg, optimizer="lamb", out=folder)
    saved = os.path.join(folder, "metrics.json")
    if os.path.exists(saved):
        with open(saved) as f:
            differ = changed_settings(lamb_cfg, json.load(f).get("config", {}))
        if differ:
            raise SetupError(f"{folder} holds a finished LAMB run of other settings ({differ}, saved then now): "
                             f"give another --out")
    return run_one(folder, ["pretrain", "--optimizer", "lamb", *pretrain_flags(args)], cfg.cache_dir)


def render(runs: Dict[str, dict], command: str, reference: str = "lamb") -> str:
    """A markdown section (``benchmarks.report.write_section``'s body) of finished runs, ``{row name:
    metrics.json}``: held-out loss, its gap to ``reference``'s (when among them), bytes, rounds and
    syncs per worker. For a whole-run comparison script: any runs in the main job's format."""
    from benchmarks.report import heading, table_row

    ref = runs.get(reference)
    first = next(iter(runs.values()))
    lines = [*heading(TITLE, command),
             f"{first['steps']} steps of {first['samples'] // first['steps']} samples on {first['world_size']} "
             f"workers, "
             f"seed {first['config']['seed']}, preset {first['config']['preset']}. DiLoCo: each worker's own LAMB "
             f"(the main job's lr and schedule) for H steps, then the workers' parameter change averaged (one float32 "
             f"all-reduce) and stepped by SGD with Nesterov momentum; the held-out loss is the synced model's. Gap: "
             f"the row's held-out loss over {reference}'s, minus 1 (lower is better).",
             "",
             table_row(["run", "H", "outer lr / momentum", "held-out loss", f"gap to {reference}", "MB sent per worker",
                        f"{reference}'s bytes / row's", "rounds per worker"]),
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in runs.items():
        d = m.get("diloco")
        gap = "-" if ref is None or m is ref else f"{100 * (m['final_eval_loss'] / ref['final_eval_loss'] - 1):+.2f}%"
        ratio = "-" if ref is None else f"{ref['bytes_sent_per_rank'] / max(m['bytes_sent_per_rank'], 1):.2f}x"
        lines.append(table_row([name, "-" if d is None else d["H"],
                                "-" if d is None else f"{d['outer_lr']:g} / {d['outer_momentum']:g}",
                                f"{m['final_eval_loss']:.4f}", gap, f"{m['bytes_sent_per_rank'] / 1e6:,.2f}",
                                ratio, m.get("rounds_per_rank", "-")]))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diloco", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--H", nargs="+", type=int, default=[8], metavar="H",
                        help="inner steps between two syncs; several: a grid, one run each (default 8)")
    parser.add_argument("--outer-lr", type=float, default=OUTER_LR, help="the outer SGD's learning rate (the paper's: "
                                                                         "%(default)s)")
    parser.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM,
                        help="the outer SGD's Nesterov momentum, 0 = plain SGD (the paper's: %(default)s)")
    parser.add_argument("--out", default=os.path.join("runs", "diloco"),
                        help="the runs' folder: OUT/PRESET/SEED/diloco-H<H> (default %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="run again a grid point that finished before")
    parser.add_argument("--lamb", action="store_true",
                        help="also run (or reuse) onebitlamb pretrain --optimizer lamb with the same flags, in "
                             "OUT/PRESET/SEED/lamb, and measure the grid against it")
    parser.add_argument("--beside", nargs="+", default=[], metavar="RUN",
                        help="finished runs of the main job (their folders, OUT/PRESET/SEED/NAME) to put in the table "
                             "beside DiLoCo's, named by their folders: 1-bit LAMB's, for instance")
    parser.add_argument("--results", default=None, metavar="FILE",
                        help="write the table as the 'diloco' section of this markdown file (default: print only)")
    add_arguments(parser, skip=SKIPPED_FLAGS)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(h < 1 for h in args.H):
        parser.error(f"--H must be at least 1, got {args.H}")
    if not args.outer_lr > 0 or not 0 <= args.outer_momentum < 1:
        parser.error(f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got {args.outer_lr}, "
                     f"{args.outer_momentum}")
    try:
        probe = config_from_args(args, optimizer="lamb", out=os.path.join(args.out, "probe"))
        root = run_root(args.out, probe, args.steps is not None)
        cache = args.cache_dir or os.path.join(args.out, "cache")
        runs: Dict[str, dict] = {}
        if args.lamb:
            runs["lamb"] = run_lamb(root, args, dataclasses.replace(probe, cache_dir=cache))
        for h in dict.fromkeys(args.H):
            settings = Settings(h, args.outer_lr, args.outer_momentum)
            cfg = dataclasses.replace(probe, out=os.path.join(root, settings.name), cache_dir=cache)
            result = run(cfg, settings, args.overwrite)
            if "error" in result:
                print(f"{settings.name}: {result['error']}", file=sys.stderr)
                continue
            runs[settings.name] = result
    except SetupError as exc:
        print(f"python -m benchmarks.diloco: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if not runs:
        return 1
    for folder in args.beside:
        try:
            with open(os.path.join(folder, "metrics.json")) as f:
                runs[os.path.basename(os.path.normpath(folder))] = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"python -m benchmarks.diloco: error: --beside {folder}: no finished run there ({exc})",
                  file=sys.stderr)
            return 2
    from benchmarks.report import write_section
    from onebitlamb.train.compare import format_table

    print("\n" + format_table(runs))
    command = " ".join(["python -m benchmarks.diloco", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    if args.results:
        print(f"written to {write_section('diloco', render(runs, command), args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
