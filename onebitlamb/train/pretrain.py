"""Masked-language-model pretraining of a small BERT with LAMB, 1-bit LAMB or 1-bit Adam.

    onebitlamb pretrain --optimizer onebitlamb --preset demo --out runs/onebitlamb
    torchrun --nnodes 2 --nproc-per-node 8 ... -m onebitlamb pretrain --optimizer onebitlamb ...

Read top to bottom: configuration, launching, then one rank's run (data, model, optimizer,
schedule, the loop with gradient accumulation, evaluation, diagnostics, checkpoints).

Launching: without torchrun this process prepares the corpus, then starts ``--workers`` local
processes joined by a gloo group on loopback. Under torchrun (``RANK``/``WORLD_SIZE`` set) every
process is one rank and the group comes from the environment (nccl with CUDA, else gloo).

The model is not wrapped in DDP: gradients of the micro-batches accumulate locally, with no
communication, and ``optimizer.step()`` does all of it (averages the gradients in LAMB and in the
warm-up stage, sends the 1-bit compressed momentum after the freeze). Gradient clipping, when on,
therefore acts on each worker's *local* accumulated gradient right before ``step()``, identically
for the three optimizers: in the warm-up stage before the gradients are averaged, in the
compression stage before they enter the local momentum that is compressed.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from onebitlamb.optim.optimizers import TRUST_PEAK_LAYERS, TRUST_PEAK_MEASURES
from onebitlamb.train import data
from onebitlamb.train.data import atomic_save
from onebitlamb.train.model import ModelConfig, build_model, mlm_loss

OPTIMIZERS = ("lamb", "onebitlamb", "onebitadam")

# ----------------------------------------------------------------------------------------------
# Configuration

# Values every preset shares; a preset overrides some, command-line flags override both.
DEFAULTS = dict(
    optimizer="onebitlamb", seed=1234, corpus=None, stdlib_tests=False, heldout_fraction=0.05,
    vocab_size=4096, seq_len=64, hidden=128, layers=2, heads=2, intermediate=512, dropout=0.0,
    workers=4, micro_batch=16, global_batch=256, steps=512,
    # 1-bit Adam's rate from the convergence study's sweeps on this model: best at 2e-3 on global
    # batches of 256, 512 and 4096, half and twice it worse on each (docs/convergence.md)
    lr=None, lr_lamb=2e-2, lr_adam=2e-3, warmup_frac=0.1, freeze_frac=0.35,
    weight_decay=0.01, clip=1.0, beta1=0.9, beta2=0.999, eps=1e-6, mask_prob=0.15,
    eval_every=32, eval_samples=512, ckpt_every=64,
    # 1-bit optimizers: freeze_frac is the freeze, or with auto_freeze the latest it may happen
    # min_freeze_frac None: 0.3 under 1-bit LAMB's wait for the trust peak (docs/convergence.md, "A
    # floor under the wait"), 0.05 elsewhere, the floor the criterion alone and 1-bit Adam were measured with
    auto_freeze=False, min_freeze_frac=None, freeze_window=20, freeze_tolerance=0.3, freeze_transient=5.0,
    # half the transient threshold, not half the spread's peak (docs/convergence.md, "A spike on the plateau")
    freeze_transient_end=2.5, unfreeze_rise=0.0,
    # with auto_freeze, 1-bit LAMB waits for its trust ratios' peak (docs/convergence.md, "Freezing
    # after the trust ratios' peak"); without it there is no automatic freeze to delay
    freeze_after_trust_peak=True, trust_peak_layers="all", trust_peak_measure="median_rise",
    compression_space="momentum", update_guard=0.0,
)
PRESETS = {
    # for the tests: a few seconds on 2 workers
    "tiny": dict(vocab_size=512, seq_len=32, hidden=32, layers=1, heads=2, intermediate=64,
                 workers=2, micro_batch=4, global_batch=16, steps=8, eval_every=4, eval_samples=32,
                 ckpt_every=2),
    # `make demo`: ~10 minutes for the three optimizers on 2 CPU cores
    "demo": dict(),
    # the same comparison at a larger scale: a day on CPUs, meant for GPUs under torchrun (see docs);
    # the stdlib's test suites triple the default corpus, so 2M samples are ~20 epochs, not ~70
    "large": dict(stdlib_tests=True, vocab_size=8192, seq_len=128, hidden=256, layers=4, heads=4,
                  intermediate=1024, workers=8, micro_batch=32, global_batch=2048, steps=1000, lr_lamb=1e-2,
                  lr_adam=5e-4, eval_every=50, eval_samples=2048, ckpt_every=50),
}
# Fields that may change between a run and its resumption (they do not affect the numbers).
RESUMABLE_CHANGES = {"out", "cache_dir", "resume", "stop_after_steps", "progress", "threads"}


@dataclass
class TrainConfig:
    optimizer: str
    out: str
    seed: int
    corpus: Optional[List[str]]
    stdlib_tests: bool
    heldout_fraction: float
    vocab_size: int
    seq_len: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    dropout: float
    workers: int
    micro_batch: int
    global_batch: int
    steps: int
    lr: float
    warmup_frac: float
    freeze_frac: float
    weight_decay: float
    clip: float
    beta1: float
    beta2: float
    eps: float
    mask_prob: float
    eval_every: int
    eval_samples: int
    ckpt_every: int
    auto_freeze: bool
    min_freeze_frac: float
    freeze_window: int
    freeze_tolerance: float
    freeze_transient: float
    freeze_transient_end: float
    unfreeze_rise: float
    freeze_after_trust_peak: bool
    trust_peak_layers: str
    trust_peak_measure: str
    compression_space: str
    update_guard: float
    cache_dir: str = ""
    resume: bool = False
    stop_after_steps: int = 0
    progress: bool = True
    threads: int = 1
    preset: str = "demo"

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(self.vocab_size, self.seq_len, self.hidden, self.layers, self.heads,
                           self.intermediate, self.dropout)

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_frac * self.steps))

    @property
    def freeze_step(self) -> int:
        return max(1, round(self.freeze_frac * self.steps))

    def check(self, world_size: int) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.global_batch % (world_size * self.micro_batch):
            raise ValueError(f"--global-batch {self.global_batch} must be a multiple of workers x micro-batch "
                             f"= {world_size} x {self.micro_batch}")
        if self.steps < 1 or self.eval_every < 1 or self.ckpt_every < 1:
            raise ValueError("--steps, --eval-every and --ckpt-every must be >= 1")
        if self.freeze_after_trust_peak and not self.auto_freeze:
            raise ValueError("--freeze-after-trust-peak delays the automatic freeze: it needs --auto-freeze")


def add_arguments(parser: argparse.ArgumentParser, optimizer_choice: bool = True) -> None:
    """Flags of ``onebitlamb pretrain`` (``compare`` reuses them without ``--optimizer``)."""
    p = parser
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo", help="base settings (default: demo)")
    if optimizer_choice:
        p.add_argument("--optimizer", choices=OPTIMIZERS, help="default: onebitlamb")
    p.add_argument("--out", required=True, help="output folder: metrics, checkpoints, plots")
    p.add_argument("--corpus", nargs="+", metavar="PATH",
                   help="text files or folders (default: this Python's standard library)")
    p.add_argument("--stdlib-tests", action="store_true", default=None,
                   help="default corpus: include the standard library's test suites (3x the text)")
    p.add_argument("--cache-dir", help="where the tokenized corpus is cached (default: OUT/cache)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT")
    p.add_argument("--stop-after-steps", type=int, default=0, metavar="N",
                   help="checkpoint and stop once N steps are done (to test --resume)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--threads", type=int, default=1, help="torch threads per local worker (default 1)")
    g = p.add_argument_group("overrides of the preset")
    typed = dict(seed=int, heldout_fraction=float, vocab_size=int, seq_len=int, hidden=int, layers=int,
                 heads=int, intermediate=int, dropout=float, workers=int, micro_batch=int, global_batch=int,
                 steps=int, lr=float, lr_lamb=float, lr_adam=float, warmup_frac=float, freeze_frac=float,
                 weight_decay=float, clip=float, beta1=float, beta2=float, eps=float, mask_prob=float,
                 eval_every=int, eval_samples=int, ckpt_every=int, min_freeze_frac=float, freeze_window=int,
                 freeze_tolerance=float, freeze_transient=float, freeze_transient_end=float, unfreeze_rise=float,
                 compression_space=str, update_guard=float)
    helps = dict(workers="local worker processes (ignored under torchrun)",
                 lr="learning rate (default: --lr-lamb for (1-bit) LAMB, --lr-adam for 1-bit Adam)",
                 clip="max norm of each worker's local gradient, 0 = off",
                 freeze_frac="1-bit optimizers: fraction of the steps in the warm-up stage (with "
                             "--auto-freeze: the latest the freeze may happen)",
                 min_freeze_frac="with --auto-freeze: the earliest the freeze may happen (default 0.3 for "
                                 "1-bit LAMB with --freeze-after-trust-peak, 0.05 otherwise; at most --freeze-frac)",
                 freeze_window="with --auto-freeze: steps over which the warm-up must have settled",
                 freeze_tolerance="with --auto-freeze: how far (log scale) every layer's variance may move "
                                  "over the window to count as settled",
                 freeze_transient="with --auto-freeze: a spread this large marks the plateau exit; the freeze "
                                  "comes once the spread is back to --freeze-transient-end (0 = off)",
                 freeze_transient_end="with --auto-freeze: the freeze after a transient comes once the spread "
                                      "is back to this (default 2.5; 0 = half its peak, the rule before)",
                 unfreeze_rise="with --auto-freeze: undo the freeze (back to full communication until the "
                               "criterion fires again) when a layer's local gradient variance rises this far "
                               "(log scale) within --freeze-window frozen steps, before --freeze-frac; e.g. 5, "
                               "as --freeze-transient (0 = off)",
                 compression_space="1-bit optimizers: 'momentum' (the paper's) or 'update' (preconditioned)",
                 update_guard="1-bit optimizers: bound stage-2 relative steps to this multiple of the "
                              "warm-up's (0 = off)",
                 warmup_frac="fraction of the steps with linear LR warm-up (then linear decay to 0)")
    for name, typ in typed.items():
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=helps.get(name))
    g.add_argument("--auto-freeze", action="store_true", default=None,
                   help="1-bit optimizers: freeze_step='auto', between --min-freeze-frac and --freeze-frac")
    g.add_argument("--freeze-after-trust-peak", action=argparse.BooleanOptionalAction, default=None,
                   help="1-bit LAMB with --auto-freeze (on by default there): once the variance criterion "
                        "holds, wait (up to --freeze-frac) until the median layer's trust ratio has stopped "
                        "rising; --no-freeze-after-trust-peak freezes when the criterion holds (1-bit Adam "
                        "has no trust ratio: it ignores this)")
    g.add_argument("--trust-peak-layers", choices=TRUST_PEAK_LAYERS, default=None,
                   help="with --freeze-after-trust-peak: the layers whose median trust ratio it reads (default "
                        "all; unclipped: leave out a layer whose ratio LAMB clipped at a step of the window)")
    g.add_argument("--trust-peak-measure", choices=TRUST_PEAK_MEASURES, default=None,
                   help="with --freeze-after-trust-peak: when the trust ratios have stopped rising (default "
                        "median_rise: the median of the layers' rises over the window is at most 0; "
                        "median_level: the median of the layers' ratios is no higher than a window before)")


def config_from_args(args: argparse.Namespace, optimizer: Optional[str] = None, out: Optional[str] = None) -> TrainConfig:
    values = dict(DEFAULTS)
    values.update(PRESETS[args.preset])
    for key in list(values) + ["optimizer"]:
        if getattr(args, key, None) is not None:
            values[key] = getattr(args, key)
    if optimizer is not None:
        values["optimizer"] = optimizer
    if not values["auto_freeze"] and getattr(args, "freeze_after_trust_peak", None) is None:
        values["freeze_after_trust_peak"] = False  # on by default only where there is a freeze to delay
    if values["min_freeze_frac"] is None:
        waits = values["optimizer"] == "onebitlamb" and values["auto_freeze"] and values["freeze_after_trust_peak"]
        values["min_freeze_frac"] = 0.3 if waits else 0.05
    lr_lamb, lr_adam = values.pop("lr_lamb"), values.pop("lr_adam")
    if values["lr"] is None:
        values["lr"] = lr_adam if values["optimizer"] == "onebitadam" else lr_lamb
    out = out or args.out
    return TrainConfig(**values, out=out, cache_dir=args.cache_dir or os.path.join(out, "cache"),
                       resume=args.resume, stop_after_steps=args.stop_after_steps, progress=args.progress,
                       threads=args.threads, preset=args.preset)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    result = train(cfg)
    return 0 if result["completed"] or not result["interrupted"] else 130


# ----------------------------------------------------------------------------------------------
# Launching


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _leave_together() -> None:
    """At exit under torchrun: wait for every rank, then tear the group down. Rank 0 writes the
    results after the last step while the others are done. (The command line leaves before this
    runs and skips the interpreter's teardown too: ``onebitlamb.cli``; this is for a script of the
    user's own that calls ``train`` under torchrun.)"""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train(cfg: TrainConfig) -> dict:
    """Run one pretraining job to its end (or to a stop); returns rank 0's summary."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        cfg.check(world)
        if rank == 0:
            data.prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.seq_len, cfg.heldout_fraction, cfg.cache_dir,
                                stdlib_tests=cfg.stdlib_tests)
        if not dist.is_initialized():  # once per process: `compare` trains three times in it
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
            atexit.register(_leave_together)
        dist.barrier()  # rank 0 has written the corpus cache (shared folder assumed)
        if cfg.resume:
            check_resumable(cfg)
        return train_rank(rank, world, cfg)

    from onebitlamb.comm.launch import spawn_local

    cfg.check(cfg.workers)
    if cfg.resume:
        check_resumable(cfg)  # fail here, before starting anything
    # the slow part of a first run, done once here instead of once per worker
    data.prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.seq_len, cfg.heldout_fraction, cfg.cache_dir,
                        stdlib_tests=cfg.stdlib_tests)
    with _forward_interrupts():
        results = spawn_local(_local_worker, cfg.workers, args=(cfg,), timeout_s=7 * 24 * 3600,
                              collective_timeout_s=1800, threads_per_worker=cfg.threads)
    return results[0]


def _local_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    return train_rank(rank, world_size, cfg)


class _forward_interrupts:
    """While local workers run, Ctrl-C asks them to checkpoint and stop at the end of the step
    instead of killing them; a second Ctrl-C kills them (the last periodic checkpoint remains)."""

    def __enter__(self):
        self.previous = signal.getsignal(signal.SIGINT)
        self.count = 0
        signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        import multiprocessing

        self.count += 1
        if self.count > 1:
            signal.signal(signal.SIGINT, self.previous)
            raise KeyboardInterrupt
        print("\ninterrupt: checkpointing at the end of this step (Ctrl-C again to kill)", file=sys.stderr)
        for child in multiprocessing.active_children():  # the workers may not share our terminal
            try:
                os.kill(child.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
        return False


# ----------------------------------------------------------------------------------------------
# One rank's run


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if dist.get_backend() == "nccl" else torch.device("cpu")
    master = rank == 0
    stop_requested = _install_stop_handler()

    # data: the cached corpus; every step's global batch is a function of (seed, step)
    corpus = data.prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.seq_len, cfg.heldout_fraction, cfg.cache_dir,
                                 log=lambda *a: None, stdlib_tests=cfg.stdlib_tests)
    accum = cfg.global_batch // (world * cfg.micro_batch)
    eval_inputs, eval_labels = data.eval_batch(corpus, cfg.eval_samples, cfg.seed, cfg.mask_prob)
    eval_inputs, eval_labels = eval_inputs[rank::world].to(device), eval_labels[rank::world].to(device)

    # model (same seed on every rank, so the same initial weights) and optimizer
    model = build_model(cfg.model, cfg.seed).to(device)
    model.train()
    groups, names = param_groups(model, cfg.weight_decay)
    optimizer = make_optimizer(cfg, groups)
    warm, total = cfg.warmup_steps, cfg.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))

    # state of the run: what the metrics file reports, saved in every checkpoint
    history = {"eval": [], "train_loss": [], "bytes": [], "stage": [], "lr": [], "diagnostics": [],
               "freeze_spread": [], "freeze_levels": [], "variance_rise": [], "trust_rise": [],
               "freeze_ready_step": None, "trust_peak_step": None, "train_time_s": 0.0, "wall_time_s": 0.0}
    start_step = 0
    if cfg.resume:
        start_step, history = load_checkpoint(cfg, rank, world, model, optimizer, scheduler, history, device)
        for key in ("freeze_levels", "variance_rise", "trust_rise"):  # a checkpoint from before they were recorded
            history.setdefault(key, [None] * start_step)
        history.setdefault("freeze_ready_step", None)
        history.setdefault("trust_peak_step", None)
    elif master:
        _fresh_out_dir(cfg)
    if master:
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
        print(f"[{cfg.optimizer}] {world} workers, {cfg.steps} steps of {cfg.global_batch} samples "
              f"({accum} micro-batches of {cfg.micro_batch} per worker), lr {cfg.lr:g}, warm-up {warm} steps"
              + ("" if cfg.optimizer == "lamb" else f", freeze automatically by step {cfg.freeze_step}"
                 if cfg.auto_freeze else f", freeze at step {cfg.freeze_step}")
              + (f", resuming at step {start_step}" if start_step else ""), file=sys.stderr, flush=True)

    def evaluate(step: int) -> float:
        loss = evaluate_mlm(model, eval_inputs, eval_labels, 2 * cfg.micro_batch, device)
        history["eval"].append([step * cfg.global_batch, loss])
        if master:
            line = f"[{cfg.optimizer}] step {step}: held-out loss {loss:.4f}"
            if bar is not None:
                bar.write(line, file=sys.stderr)  # above the bar
            else:
                print(line, file=sys.stderr, flush=True)
        return loss

    bar = _progress_bar(cfg, start_step) if master and cfg.progress else None
    if start_step == 0:
        evaluate(0)

    done, t_wall0, stopped_by = start_step, time.perf_counter(), None
    wall_before, train_time = history["wall_time_s"], history["train_time_s"]
    train_time_before = train_time
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        # ---- one global batch: this rank's shard, in micro-batches, gradients accumulated locally
        inputs, labels = data.rank_batch(corpus, step, rank, world, cfg.global_batch, cfg.seed, cfg.mask_prob)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i in range(accum):
            sl = slice(i * cfg.micro_batch, (i + 1) * cfg.micro_batch)
            loss = mlm_loss(model, inputs[sl].to(device), labels[sl].to(device)) / accum
            loss.backward()
            loss_sum += loss.item()
        if cfg.clip > 0:  # this worker's local gradient, before step() communicates anything
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)

        # ---- the optimizer step (all communication happens in here)
        diagnose = master and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps)
        before = [p.detach().clone() for p in names.values()] if diagnose else None
        stage = optimizer.stage
        optimizer.step()
        scheduler.step()
        train_time += time.perf_counter() - t0

        history["train_loss"].append(loss_sum)
        history["bytes"].append(optimizer.comm_stats.bytes_sent)
        history["stage"].append(stage)
        history["freeze_spread"].append(optimizer.freeze_spread)  # --auto-freeze: how settled, per step
        history["freeze_levels"].append(_finite_or_none(optimizer.freeze_levels))
        history["variance_rise"].append(_finite_or_none(optimizer.variance_rise))
        history["trust_rise"].append(getattr(optimizer, "trust_rise", None))  # the wait for the trust peak (1-bit LAMB)
        if getattr(optimizer, "freeze_ready_step", None) is not None:
            history["freeze_ready_step"] = optimizer.freeze_ready_step
        if getattr(optimizer, "trust_peak_step", None) is not None:
            history["trust_peak_step"] = optimizer.trust_peak_step
        history["lr"].append(scheduler.get_last_lr()[0])
        if diagnose:
            history["diagnostics"].append(layer_report(step + 1, stage, names, before, optimizer))
        if bar is not None:
            bar.update(1)
            sps = (step + 1 - start_step) * cfg.global_batch / max(train_time - train_time_before, 1e-9)
            bar.set_postfix(loss=f"{loss_sum:.3f}", sps=f"{sps:.0f}", stage=stage,
                            MB=f"{optimizer.comm_stats.bytes_sent / 1e6:.1f}", refresh=False)

        # ---- evaluation, checkpoint, stop
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            evaluate(done)
        history["train_time_s"] = train_time
        history["wall_time_s"] = wall_before + time.perf_counter() - t_wall0
        stop = _agree_to_stop(stop_requested(), device)
        if cfg.stop_after_steps and done >= cfg.stop_after_steps and done < cfg.steps:
            stop, stopped_by = True, stopped_by or "stop-after-steps"
        elif stop:
            stopped_by = "interrupt"
        if done % cfg.ckpt_every == 0 or stop or done == cfg.steps:
            save_checkpoint(cfg, rank, done, model, optimizer, scheduler, history)
        if stop:
            break
    if bar is not None:
        bar.close()

    completed = stopped_by is None
    summary = {"completed": completed, "interrupted": stopped_by == "interrupt", "step": done}
    ranks_bytes = _gather_bytes(optimizer.comm_stats.bytes_sent, world, device)
    if completed and master:
        summary.update(write_metrics(cfg, world, history, ranks_bytes, names, model))
    elif master:
        print(f"[{cfg.optimizer}] stopped ({stopped_by}) after step {done}; continue with --resume",
              file=sys.stderr, flush=True)
    return summary


def _last_freeze(stages: List[str]) -> int:
    """The step at whose end the last freeze happened: the last warm-up step."""
    return max((i + 1 for i, stage in enumerate(stages) if stage == "warmup"), default=0)


def param_groups(model: torch.nn.Module, weight_decay: float):
    """BERT's two groups: weight decay on the weight matrices, none on biases and LayerNorm.
    Also returns ``{name: parameter}`` in the optimizer's (flat) order, for the diagnostics."""
    decay, no_decay = {}, {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.numel() > 0:
            (no_decay if name.endswith("bias") or "LayerNorm" in name else decay)[name] = p
    groups = [{"params": list(decay.values()), "weight_decay": weight_decay},
              {"params": list(no_decay.values()), "weight_decay": 0.0}]
    return groups, {**decay, **no_decay}


def make_optimizer(cfg: TrainConfig, groups) -> torch.optim.Optimizer:
    import onebitlamb

    common = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lamb":
        return onebitlamb.Lamb(groups, **common)
    onebit = dict(compression_space=cfg.compression_space, update_guard=cfg.update_guard or None)
    if cfg.auto_freeze:
        onebit.update(freeze_step="auto", max_freeze_step=cfg.freeze_step,
                      min_freeze_step=min(cfg.freeze_step, max(1, round(cfg.min_freeze_frac * cfg.steps))),
                      freeze_window=cfg.freeze_window, freeze_tolerance=cfg.freeze_tolerance,
                      freeze_transient=cfg.freeze_transient or None,
                      freeze_transient_end=cfg.freeze_transient_end or None,
                      unfreeze_rise=cfg.unfreeze_rise or None)
    else:
        onebit.update(freeze_step=cfg.freeze_step)
    if cfg.optimizer == "onebitlamb":
        return onebitlamb.OneBitLamb(groups, **common, **onebit, freeze_after_trust_peak=cfg.freeze_after_trust_peak,
                                     trust_peak_layers=cfg.trust_peak_layers,
                                     trust_peak_measure=cfg.trust_peak_measure)
    return onebitlamb.OneBitAdam(groups, **common, **onebit)


@torch.no_grad()
def evaluate_mlm(model, inputs, labels, batch: int, device) -> float:
    """Held-out MLM loss: mean cross-entropy over all masked tokens of the whole evaluation set,
    each rank doing its share (two scalars all-reduced, outside the optimizer's byte counts)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(inputs), batch):
        lab = labels[i:i + batch]
        total[0] += mlm_loss(model, inputs[i:i + batch], lab, reduction="sum").double()
        total[1] += (lab != data.IGNORE_INDEX).sum()
    model.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


def layer_report(step: int, stage: str, names: dict, before: List[torch.Tensor], optimizer) -> dict:
    """Per layer at this step: the coefficient the optimizer applied (LAMB's live trust ratio; in
    1-bit LAMB's compression stage, frozen coefficient x factor) and the relative step size
    ``|x_after - x_before| / |x_before|`` measured on the parameters themselves. ``stage`` is the
    stage the step ran in: at a freeze's own step the optimizer is already frozen after it."""
    diag = optimizer.layer_diagnostics()
    layers = []
    for i, ((name, p), x0) in enumerate(zip(names.items(), before)):
        d = diag[i] if i < len(diag) else {}
        x0n = float(x0.float().norm())
        layers.append({"name": name, "trust_ratio": d.get("trust_ratio"), "frozen_coeff": d.get("frozen_coeff"),
                       "factor": d.get("factor"),
                       "rel_step": float((p.detach().float() - x0.float()).norm()) / x0n if x0n > 0 else None})
    return {"step": step, "stage": stage, "layers": layers}


# ---- stopping on Ctrl-C / SIGTERM at a step boundary, all ranks together


def _install_stop_handler():
    flag = {"stop": False}

    def handle(signum, frame):
        flag["stop"] = True

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)  # torchrun forwards signals as SIGTERM
    return lambda: flag["stop"]


def _agree_to_stop(local: bool, device) -> bool:
    """Every rank must stop at the same step (a rank left alone would wait in a collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    t = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _finite_or_none(values: Optional[List[float]]) -> Optional[List[Optional[float]]]:
    """JSON has no infinities: a layer with no gradient yet (log 0) is written as null."""
    return None if values is None else [v if math.isfinite(v) else None for v in values]


def _gather_bytes(nbytes: int, world: int, device) -> List[int]:
    if world == 1:
        return [nbytes]
    t = torch.zeros(world, dtype=torch.int64, device=device)
    t[dist.get_rank()] = nbytes
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def _progress_bar(cfg: TrainConfig, start: int):
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc=cfg.optimizer, unit="step", dynamic_ncols=True,
                file=sys.stderr, mininterval=0.5)


# ----------------------------------------------------------------------------------------------
# Checkpoints: OUT/ckpt-<step>/{model.pt, trainer.pt, rank<r>.pt}, OUT/checkpoint.json names the last
#
# Every file is written to a temporary name and renamed; checkpoint.json is switched to a new folder
# only after every rank has written its file, so a crash at any point leaves the previous complete
# checkpoint in place. (Multi-node runs need OUT on a shared file system.)


def _fresh_out_dir(cfg: TrainConfig) -> None:
    os.makedirs(cfg.out, exist_ok=True)
    pointer = os.path.join(cfg.out, "checkpoint.json")
    if os.path.exists(pointer):
        os.remove(pointer)  # a new run: the old checkpoints must not be resumed by mistake
    for name in ("metrics.json", "model_final.pt"):
        if os.path.exists(os.path.join(cfg.out, name)):
            os.remove(os.path.join(cfg.out, name))
    for name in os.listdir(cfg.out):  # checkpoints of an earlier run
        folder = os.path.join(cfg.out, name)
        if name.startswith("ckpt-") and os.path.isdir(folder):
            for fname in os.listdir(folder):
                os.remove(os.path.join(folder, fname))
            os.rmdir(folder)


def save_checkpoint(cfg, rank, step, model, optimizer, scheduler, history) -> None:
    folder = os.path.join(cfg.out, f"ckpt-{step:07d}")
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
    _barrier()
    atomic_save({"optimizer": optimizer.state_dict(), "comm_stats": optimizer.comm_stats.state_dict(),
                 "rng": _rng_state()}, os.path.join(folder, f"rank{rank}.pt"))
    if rank == 0:
        atomic_save(model.state_dict(), os.path.join(folder, "model.pt"))
        atomic_save({"step": step, "scheduler": scheduler.state_dict(), "history": history,
                     "config": dataclasses.asdict(cfg)}, os.path.join(folder, "trainer.pt"))
    _barrier()
    if rank == 0:
        pointer = os.path.join(cfg.out, "checkpoint.json")
        previous = _read_pointer(cfg.out)
        tmp = pointer + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"folder": os.path.basename(folder), "step": step}, f)
        os.replace(tmp, pointer)
        if previous and previous != os.path.basename(folder):  # keep only the latest
            old = os.path.join(cfg.out, previous)
            for fname in os.listdir(old):
                os.remove(os.path.join(old, fname))
            os.rmdir(old)
    _barrier()


def load_checkpoint(cfg, rank, world, model, optimizer, scheduler, history, device):
    folder = _read_pointer(cfg.out)
    if folder is None:
        if rank == 0:
            print(f"[{cfg.optimizer}] --resume: no checkpoint in {cfg.out}, starting from scratch", file=sys.stderr)
            _fresh_out_dir(cfg)
        return 0, history
    folder = os.path.join(cfg.out, folder)
    trainer = torch.load(os.path.join(folder, "trainer.pt"), map_location="cpu", weights_only=False)
    check_resumable(cfg, trainer["config"])
    own = torch.load(os.path.join(folder, f"rank{rank}.pt"), map_location=device, weights_only=False)
    model.load_state_dict(torch.load(os.path.join(folder, "model.pt"), map_location=device, weights_only=True))
    optimizer.load_state_dict(own["optimizer"])
    optimizer.comm_stats.load_state_dict(own["comm_stats"])
    scheduler.load_state_dict(trainer["scheduler"])
    _set_rng_state(own["rng"])
    return trainer["step"], trainer["history"]


def check_resumable(cfg: TrainConfig, saved: Optional[dict] = None) -> None:
    """Refuse to resume a checkpoint with settings that change the numbers (only output folders,
    progress display and the stop request may differ)."""
    if saved is None:
        folder = _read_pointer(cfg.out)
        if folder is None:
            return
        saved = torch.load(os.path.join(cfg.out, folder, "trainer.pt"), map_location="cpu", weights_only=False)["config"]
    changed = changed_settings(cfg, saved)
    if changed:
        raise ValueError(f"--resume with different settings than the checkpoint in {cfg.out} (saved, now): {changed}")


# Settings only the 1-bit optimizers read, and of those, the ones only the automatic freeze reads
ONEBIT_SETTINGS = {"freeze_frac", "compression_space", "update_guard"}
AUTO_FREEZE_SETTINGS = {"min_freeze_frac", "freeze_window", "freeze_tolerance", "freeze_transient",
                        "freeze_transient_end", "unfreeze_rise", "freeze_after_trust_peak", "trust_peak_layers",
                        "trust_peak_measure"}
# Settings added after runs were saved, and the value those runs had in effect
ADDED_SETTINGS = {"freeze_transient_end": 0.0, "unfreeze_rise": 0.0, "freeze_after_trust_peak": False,
                  "trust_peak_layers": "all", "trust_peak_measure": "median_rise"}


def changed_settings(cfg: TrainConfig, saved: dict) -> dict:
    """The settings (name: (saved, now)) in which ``cfg`` differs from a saved run's config, other
    than those that cannot change its numbers: RESUMABLE_CHANGES, and the settings its optimizer
    or freeze mode does not read (so a LAMB run stays valid when a 1-bit default moves)."""
    ignored = set(RESUMABLE_CHANGES)
    if cfg.optimizer == "lamb":
        ignored |= ONEBIT_SETTINGS | AUTO_FREEZE_SETTINGS | {"auto_freeze"}
    elif not cfg.auto_freeze:
        ignored |= AUTO_FREEZE_SETTINGS
    elif cfg.optimizer == "onebitadam":
        ignored |= {"freeze_after_trust_peak", "trust_peak_layers", "trust_peak_measure"}  # no trust ratio
    elif not cfg.freeze_after_trust_peak:
        ignored |= {"trust_peak_layers", "trust_peak_measure"}  # read only by the wait
    now = dataclasses.asdict(cfg)
    saved = {**ADDED_SETTINGS, **saved}
    return {k: (saved.get(k), v) for k, v in now.items() if k not in ignored and saved.get(k) != v}


def _read_pointer(out: str) -> Optional[str]:
    try:
        with open(os.path.join(out, "checkpoint.json")) as f:
            return json.load(f)["folder"]
    except FileNotFoundError:
        return None


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------------
# The run's results: OUT/metrics.json, OUT/model_final.pt, OUT/diagnostics.png


def write_metrics(cfg: TrainConfig, world: int, history: dict, ranks_bytes: List[int], names, model) -> dict:
    samples = cfg.steps * cfg.global_batch
    metrics = {
        "optimizer": cfg.optimizer,
        "world_size": world,
        "final_eval_loss": history["eval"][-1][1],
        "samples": samples,
        "steps": cfg.steps,
        # the step the (last) freeze happened at (with --auto-freeze, the optimizer decided it)
        "freeze_step": _last_freeze(history["stage"]) if cfg.optimizer != "lamb" else None,
        # --unfreeze-rise: the steps at whose end a freeze was undone, and all full-communication steps
        "unfrozen_at": [i + 1 for i in range(1, len(history["stage"]))
                        if history["stage"][i - 1] == "compression" and history["stage"][i] == "warmup"],
        "warmup_steps": history["stage"].count("warmup"),
        "bytes_sent_per_rank": sum(ranks_bytes) / len(ranks_bytes),
        "bytes_sent_by_rank": ranks_bytes,
        "wall_time_s": history["wall_time_s"],
        "train_time_s": history["train_time_s"],
        "samples_per_s": samples / max(history["train_time_s"], 1e-9),
        "eval_curve": history["eval"],
        "bytes_curve": [[i + 1, b] for i, b in enumerate(history["bytes"])],
        "train_loss": history["train_loss"],
        "freeze_spread": history["freeze_spread"],
        # --auto-freeze, per warm-up step: each layer's log ||v_hat|| (None: no gradient yet)
        "freeze_levels": ({"layers": list(names), "per_step": history["freeze_levels"]}
                          if any(row is not None for row in history["freeze_levels"]) else None),
        # --unfreeze-rise, per stage-2 step: each layer's rise of its local gradient variance since the freeze
        "variance_rise": ({"layers": list(names), "per_step": history["variance_rise"]}
                           if any(row is not None for row in history["variance_rise"]) else None),
        # the wait for the trust peak: per warm-up step, the median layer's trust-ratio rise over the
        # window; the step the variance criterion first held, from which the freeze waited; and the
        # step the wait ended (the freeze came there, or at the floor when that was later)
        "trust_rise": history["trust_rise"] if any(v is not None for v in history["trust_rise"]) else None,
        "freeze_ready_step": history["freeze_ready_step"],
        "trust_peak_step": history["trust_peak_step"],
        "stage": history["stage"],
        "lr": history["lr"],
        "diagnostics": history["diagnostics"],
        "config": dataclasses.asdict(cfg),
    }
    atomic_save(model.state_dict(), os.path.join(cfg.out, "model_final.pt"))
    tmp = os.path.join(cfg.out, "metrics.json.tmp")
    with open(tmp, "w") as f:
        json.dump(metrics, f)
    os.replace(tmp, os.path.join(cfg.out, "metrics.json"))
    try:  # after the metrics are safe, and a figure that fails to draw must not fail the run
        from onebitlamb.train.plots import plot_freeze

        if plot_freeze(metrics, os.path.join(cfg.out, "freeze.png")):
            print(f"[{cfg.optimizer}] how the automatic freeze decided: {cfg.out}/freeze.png", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 (matplotlib's errors have no common type)
        print(f"[{cfg.optimizer}] freeze.png not drawn: {exc!r}", file=sys.stderr)
    print(f"[{cfg.optimizer}] done: held-out loss {metrics['final_eval_loss']:.4f} after {samples} samples, "
          f"{metrics['bytes_sent_per_rank'] / 1e6:.1f} MB sent per worker, {metrics['wall_time_s']:.0f} s "
          f"({metrics['samples_per_s']:.0f} samples/s)", file=sys.stderr, flush=True)
    return {k: metrics[k] for k in ("final_eval_loss", "samples", "bytes_sent_per_rank", "wall_time_s")}
