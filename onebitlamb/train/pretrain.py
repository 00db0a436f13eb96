"""Masked-language-model pretraining of a small BERT with LAMB, 1-bit LAMB or 1-bit Adam.

    onebitlamb pretrain --optimizer onebitlamb --preset demo --out runs/onebitlamb
    torchrun --nnodes 2 --nproc-per-node 8 ... -m onebitlamb pretrain --optimizer onebitlamb ...

Read top to bottom: configuration, launching, then one rank's run (data, model, optimizer, the
loop, evaluation, checkpoint), then the helpers it calls.

Launching: without torchrun this process prepares the corpus, then starts ``--workers`` local
processes joined by a gloo group on loopback. Under torchrun (``RANK``/``WORLD_SIZE`` set) every
process is one rank and the group comes from the environment: nccl with a GPU per rank, gloo over
CUDA tensors where the ranks of a node outnumber its GPUs (NCCL refuses two ranks on one device),
gloo on the CPU without CUDA.

The model is not wrapped in DDP: gradients of the micro-batches accumulate locally, with no
communication, and ``optimizer.step()`` does all of it (averages the gradients in LAMB and in the
warm-up stage, sends the 1-bit compressed momentum after the freeze). Gradient clipping therefore
acts on each worker's *local* accumulated gradient right before ``step()``, identically for the
three optimizers.
"""
from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import datetime
import hashlib
import io
import json
import math
import os
import random
import re
import signal
import sys
import time
import typing
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

import onebitlamb
from onebitlamb.train import data, plots, runlog
from onebitlamb.train.data import atomic_save
from onebitlamb.train.model import ModelConfig, build_model, mlm_loss

# ----------------------------------------------------------------------------------------------
# Configuration: defaults (TrainConfig), then the preset's values, then the flags given

OPTIMIZERS = ("lamb", "onebitlamb", "onebitadam")
# the learning rate of each optimizer unless --lr is given
DEFAULT_LR = {"lamb": 2e-2, "onebitlamb": 2e-2, "onebitadam": 2e-3}

PRESETS = {
    # for the tests: a few seconds on 2 workers
    "tiny": dict(vocab_size=512, seq_len=32, hidden=32, layers=1, heads=2, intermediate=64, workers=2,
                 micro_batch=4, global_batch=16, steps=8, eval_every=4, eval_samples=32, ckpt_every=2),
    # `make demo`: the TrainConfig defaults
    "demo": dict(),
    # demo at larger global batches (the convergence benchmark's)
    "b512": dict(global_batch=512, steps=128, eval_every=16),
    "b1024": dict(global_batch=1024, steps=400, eval_every=50),
    "b4096": dict(global_batch=4096, steps=100, eval_every=20),
    # a larger model and corpus, meant for GPUs under torchrun
    "large": dict(stdlib_tests=True, vocab_size=8192, seq_len=128, hidden=256, layers=4, heads=4,
                  intermediate=1024, workers=8, micro_batch=32, global_batch=2048, steps=1000, eval_every=50,
                  eval_samples=2048, ckpt_every=50),
}

# Settings that may change between a run and its resumption: they do not change the numbers, or
# only in the last bits: threads (the order of float sums), workers (each step's global batch is
# the same, split over other ranks, and the compression errors are re-sharded).
RESUMABLE_CHANGES = {"out", "cache_dir", "resume", "overwrite", "stop_after_steps", "progress", "threads", "workers",
                     "timeout"}


class SetupError(ValueError):
    """A run refused at its start, before any worker starts: a bad setting, an earlier run in the
    way, a checkpoint that cannot be trusted. The command line prints the message alone."""


def parse_freeze(value: Union[str, float]) -> Union[str, float]:
    """``"auto"``, or the fraction of the steps after which the 1-bit optimizers freeze, in (0, 1]."""
    if value == "auto":
        return value
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = math.nan
    if not 0 < fraction <= 1:  # NaN fails too
        raise ValueError(f"expected 'auto' or a fraction in (0, 1], got {value!r}")
    return fraction


@dataclass
class TrainConfig:
    """One run of the main job. The fields with a help are the command line's flags (the parser is
    built from them, in this order); the others are set by the presets alone."""

    preset: str = field(default="demo", metadata={
        "help": "base settings; the defaults below are demo's. tiny: the tests' few seconds, b512/b1024/b4096: "
                "demo at larger global batches, large: a larger model and corpus for GPUs",
        "choices": list(PRESETS)})
    optimizer: str = field(default="onebitlamb", metadata={"help": "what trains the model", "choices": OPTIMIZERS})
    out: str = field(default="", metadata={"help": "output folder: metrics, checkpoints, plots", "required": True})
    resume: bool = field(default=False, metadata={"help": "continue from the last checkpoint in OUT"})
    overwrite: bool = field(default=False, metadata={
        "help": "start over in an OUT that holds a run: remove that run's own files first (nothing else)"})
    seed: int = field(default=1234, metadata={"help": "seed of the initial model, the data order and the masks"})
    steps: int = field(default=512, metadata={"help": "optimizer steps"})
    global_batch: int = field(default=256, metadata={"help": "samples per step over all workers"})
    micro_batch: int = field(default=16, metadata={
        "help": "samples per forward pass; each worker accumulates global/(workers x micro) of them"})
    workers: int = field(default=4, metadata={"help": "local worker processes; torchrun sets its own"})
    lr: Optional[float] = field(default=None, metadata={
        "help": "peak learning rate (default: 2e-2 for LAMB and 1-bit LAMB, 2e-3 for 1-bit Adam)"})
    warmup_frac: float = field(default=0.1, metadata={
        "help": "fraction of the steps with a linear learning-rate warm-up, then a linear decay to 0",
        "metavar": "FRACTION"})
    weight_decay: float = field(default=0.01, metadata={"help": "on weight matrices; none on biases and LayerNorm"})
    clip: float = field(default=1.0, metadata={"help": "max norm of each worker's local gradient, 0 = off"})
    freeze: Union[str, float] = field(default="auto", metadata={
        "help": "1-bit optimizers: when to freeze the variance and start compressing. auto: onebitlamb.AutoFreeze "
                "with its defaults; a fraction in (0, 1]: after that fraction of the steps", "type": parse_freeze,
        "metavar": "auto|FRACTION"})
    warmup_dtype: str = field(default="float32", metadata={
        "help": "1-bit optimizers: the wire dtype of the warm-up's gradient average (bfloat16: half the bytes)",
        "choices": ["float32", "bfloat16"]})
    bucket_cap_mb: Optional[float] = field(default=None, metadata={
        "help": "send the exchange in buckets of at most this many MiB, each behind the backward as soon as its "
                "gradients are ready (default: one bucket, sent in the step)", "metavar": "MIB"})
    local_size: Optional[int] = field(default=None, metadata={
        "help": "ranks per node: the exchange runs over onebitlamb.comm.node_groups(N), exact inside a node and "
                "1-bit across nodes (default: one flat group)"})
    eval_every: int = field(default=32, metadata={"help": "steps between held-out evaluations and diagnostics"})
    eval_samples: int = field(default=512, metadata={"help": "held-out samples per evaluation"})
    ckpt_every: int = field(default=64, metadata={"help": "steps between checkpoints"})
    corpus: Optional[List[str]] = field(default=None, metadata={
        "help": "text files or folders (default: this Python's standard library)", "metavar": "PATH"})
    stdlib_tests: bool = field(default=False, metadata={
        "help": "default corpus: include the standard library's test suites (3x the text)"})
    cache_dir: str = field(default="", metadata={
        "help": "where the tokenized corpus is cached (default: OUT/cache)", "metavar": "DIR"})
    threads: int = field(default=1, metadata={"help": "torch threads per local worker"})
    progress: bool = field(default=True, metadata={
        "help": "one plain line per report instead of a progress bar (as when the output is not a terminal)"})
    stop_after_steps: int = field(default=0, metadata={
        "help": "checkpoint and stop once N steps are done (0: run to the end)", "metavar": "N"})
    timeout: float = field(default=600.0, metadata={
        "help": "seconds a rank waits for the others in a collective before the run ends with an error that "
                "says where it waited (a rank that died, hung or was paused)", "metavar": "SECONDS"})

    # preset-only; the model's defaults are ModelConfig's
    heldout_fraction: float = 0.05
    vocab_size: int = ModelConfig.vocab_size
    seq_len: int = ModelConfig.seq_len
    hidden: int = ModelConfig.hidden
    layers: int = ModelConfig.layers
    heads: int = ModelConfig.heads
    intermediate: int = ModelConfig.intermediate
    dropout: float = ModelConfig.dropout
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    mask_prob: float = 0.15

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise SetupError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        try:
            self.freeze = parse_freeze(self.freeze)
        except ValueError as exc:
            raise SetupError(f"--freeze: {exc}") from None
        if self.lr is None:
            self.lr = DEFAULT_LR[self.optimizer]
        self._check_values()
        if not self.cache_dir and self.out:
            self.cache_dir = os.path.join(self.out, "cache")

    def _check_values(self) -> None:
        """Every bad value is refused here, at the start, by its flag's name (or the preset
        setting's) and the value given."""
        flags = {f.name for f in dataclasses.fields(self) if "help" in f.metadata}

        def refuse(name: str, rule: str) -> None:
            what = "--" + name.replace("_", "-") if name in flags else f"the preset setting {name}"
            raise SetupError(f"{what} must be {rule}, got {getattr(self, name)!r}")

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                refuse(f.name, "a finite number")
        for name in ("steps", "global_batch", "micro_batch", "workers", "eval_every", "eval_samples", "ckpt_every",
                     "threads", "vocab_size", "seq_len", "hidden", "layers", "heads", "intermediate"):
            if getattr(self, name) < 1:
                refuse(name, ">= 1")
        if not self.timeout > 0:
            refuse("timeout", "> 0")
        for name in ("stop_after_steps", "lr", "weight_decay", "clip"):
            if getattr(self, name) < 0:
                refuse(name, ">= 0")
        for name in ("warmup_frac", "dropout", "beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                refuse(name, "in [0, 1)")
        if not 0 < self.heldout_fraction < 1:
            refuse("heldout_fraction", "in (0, 1)")
        if not 0 < self.mask_prob <= 1:
            refuse("mask_prob", "in (0, 1]")
        if not self.eps > 0:
            refuse("eps", "> 0")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            refuse("bucket_cap_mb", "> 0")
        if self.local_size is not None and self.local_size < 1:
            refuse("local_size", ">= 1")
        if self.resume and self.overwrite:
            raise SetupError("--resume continues the run in OUT and --overwrite removes it: give one of them")

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(self.vocab_size, self.seq_len, self.hidden, self.layers, self.heads,
                           self.intermediate, self.dropout)

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_frac * self.steps))

    def freeze_step(self) -> Union[int, onebitlamb.AutoFreeze]:
        """The 1-bit optimizers' ``freeze_step``: the automatic policy, or a fixed step."""
        if self.freeze == "auto":
            return onebitlamb.AutoFreeze(total_steps=self.steps)
        return max(1, round(self.freeze * self.steps))

    def check(self, world_size: int) -> None:
        """What depends on the number of ranks (the values themselves are checked on creation)."""
        if not self.out:
            raise SetupError("--out is required")
        if self.global_batch % (world_size * self.micro_batch):
            raise SetupError(f"--global-batch {self.global_batch} must be a multiple of workers x micro-batch "
                             f"= {world_size} x {self.micro_batch}")


def _flag_type(hint):
    """``Optional[X]`` -> (X, None); ``List[X]`` -> (X, "+"); ``X`` -> (X, None)."""
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], "+"
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    return _flag_type(inner[0]) if inner else (hint, None)


def add_arguments(parser: argparse.ArgumentParser, skip: tuple = ()) -> None:
    """The flags of ``onebitlamb pretrain``, one per TrainConfig field with a help. Every flag
    defaults to None here, so that ``config_from_args`` can tell a flag given from the preset's value."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        meta = dict(f.metadata)
        if "help" not in meta or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:  # a switch that turns the default around
            if f.default:
                flag = "--no-" + flag[2:]
            parser.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true",
                                default=None, help=meta["help"])
            continue
        typ, nargs = _flag_type(hints[f.name])
        if typ is int:
            meta.setdefault("metavar", "N")
        shown = f.default not in (None, "", 0) and not meta.get("required") and "(default" not in meta["help"]
        parse = _with_message(meta.pop("type")) if "type" in meta else typ
        parser.add_argument(flag, dest=f.name, type=parse, nargs=nargs, default=None,
                            help=meta.pop("help") + (f" (default: {f.default})" if shown else ""), **meta)


def _with_message(parse):
    """argparse drops the message of a type's ValueError; this keeps it."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def config_from_args(args: argparse.Namespace, optimizer: Optional[str] = None,
                     out: Optional[str] = None) -> TrainConfig:
    """The run the command line asks for: TrainConfig's defaults, the preset's values, the flags given."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values = {**PRESETS[given.get("preset", TrainConfig.preset)], **given}
    if optimizer is not None:
        values["optimizer"] = optimizer
    if out is not None:
        values["out"] = out
    return TrainConfig(**values)


def changed_settings(cfg: TrainConfig, saved: dict) -> dict:
    """The settings (name: (saved, now)) in which ``cfg`` differs from a saved run's config, other
    than those that cannot change its numbers (RESUMABLE_CHANGES; LAMB never reads --freeze)."""
    ignored = RESUMABLE_CHANGES | ({"freeze"} if cfg.optimizer == "lamb" else set())
    return {k: (saved.get(k), v) for k, v in dataclasses.asdict(cfg).items()
            if k not in ignored and saved.get(k) != v}


def run(args: argparse.Namespace) -> int:
    """0: done (or stopped by --stop-after-steps), 130: interrupted, 1: stopped by a non-finite
    loss, 2: refused at the start (the message says why)."""
    from onebitlamb.comm.launch import WorkerError

    try:
        result = train(config_from_args(args))
    except SetupError as exc:
        print(f"onebitlamb pretrain: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (RankTimeout, WorkerError) as exc:
        return report_timeout(exc, "onebitlamb pretrain")
    return exit_code(result)


def report_timeout(exc: Exception, prog: str) -> int:
    """A rank that gave up waiting: its message alone, exit status 1 (anything else is raised again)."""
    # a local worker's error carries the worker's traceback, whose last line says it
    gave_up = [line.split("RankTimeout: ", 1)[1] for line in str(exc).splitlines() if "RankTimeout: " in line]
    if not isinstance(exc, RankTimeout) and not gave_up:
        raise exc
    print(f"{prog}: error: {gave_up[0] if gave_up else exc}", file=sys.stderr, flush=True)
    return 1


def exit_code(result: dict) -> int:
    if result.get("error"):
        return 1
    return 0 if result["completed"] or not result["interrupted"] else 130


# ----------------------------------------------------------------------------------------------
# Launching


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def train(cfg: TrainConfig) -> dict:
    """Run one pretraining job to its end (or to a stop); returns rank 0's summary: ``completed``,
    ``interrupted``, ``step`` and, when a non-finite loss stopped it, ``error`` (the message).
    Raises SetupError before anything starts when the run is refused."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        cfg.check(world)
        if cfg.resume:
            check_resumable(cfg)
        else:
            prepare_out_dir(cfg, remove=rank == 0)  # every rank refuses alike; rank 0 alone removes
        if rank == 0:
            data.prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.seq_len, cfg.heldout_fraction, cfg.cache_dir,
                                stdlib_tests=cfg.stdlib_tests)
        if not dist.is_initialized():  # once per process: `compare` trains three times in it
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            backend = "gloo" if _gpus_shared() or not torch.cuda.is_available() else "nccl"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
            atexit.register(_leave_together)
        check_shared_out(cfg.out, rank, world)
        dist.barrier()  # rank 0 has written the corpus cache (shared folder assumed)
        return train_rank(rank, world, cfg)

    from onebitlamb.comm.launch import spawn_local

    cfg.check(cfg.workers)
    # fail here, before starting anything
    if cfg.resume:
        check_resumable(cfg)
    else:
        prepare_out_dir(cfg)
    # the slow part of a first run, done once here instead of once per worker
    data.prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.seq_len, cfg.heldout_fraction, cfg.cache_dir,
                        stdlib_tests=cfg.stdlib_tests)
    with _forward_interrupts():
        results = spawn_local(_local_worker, cfg.workers, args=(cfg,), timeout_s=7 * 24 * 3600,
                              collective_timeout_s=cfg.timeout, threads_per_worker=cfg.threads)
    return results[0]


def _gpus_shared() -> bool:
    """Under torchrun with CUDA: whether this node's ranks outnumber its GPUs, so that several
    share one (round robin by local rank). NCCL refuses that; gloo takes CUDA tensors."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return under_torchrun() and torch.cuda.is_available() and local_world > torch.cuda.device_count()


def rank_device() -> torch.device:
    """Where this rank trains: its GPU under torchrun with CUDA (NCCL, or gloo when ranks share
    GPUs), else the CPU (local workers always: they are joined by gloo on loopback)."""
    if dist.get_backend() == "nccl" or (dist.get_backend() == "gloo" and _gpus_shared()):
        return torch.device(f"cuda:{torch.cuda.current_device()}")
    return torch.device("cpu")


def check_shared_out(out: str, rank: int, world: int) -> None:
    """Under torchrun, at the start: every rank must write OUT and see what rank 0 writes there
    (checkpoints are written by all ranks into one folder; several machines need a shared file
    system). Without it a multi-node run crashed at its first checkpoint."""
    if world == 1:
        return
    name = [f".shared-check-{os.getpid()}-{time.time_ns()}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    mine = os.path.join(out, f"{name[0]}.rank{rank}")
    problem = None
    try:
        with open(mine, "w") as f:
            f.write(str(rank))
    except OSError as exc:
        problem = f"cannot write {out} ({exc.strerror or exc})"
    dist.barrier()
    if problem is None and not os.path.exists(os.path.join(out, f"{name[0]}.rank0")):
        problem = f"does not see the files rank 0 writes into {out}"
    problems: List[Optional[str]] = [None] * world
    dist.all_gather_object(problems, problem)
    if os.path.exists(mine):
        os.remove(mine)
    dist.barrier()  # every probe is gone before any rank goes on
    bad = [f"rank {r} {p}" for r, p in enumerate(problems) if p]
    if bad:
        raise SetupError(f"{'; '.join(bad)}: --out must be a folder every rank can write and see alike (on "
                         f"several machines, a shared file system), or the first checkpoint would fail")


def _local_worker(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    return train_rank(rank, world_size, cfg)


def _leave_together() -> None:
    """At exit under torchrun: wait for every rank, then tear the group down (rank 0 writes the
    results while the others are done). For a user's own script that calls ``train``; the command
    line leaves earlier, ``onebitlamb.cli``."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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


class _Phase:
    """Where this rank is, for the message when a collective times out."""
    now = "the start (the checkpoint, the first evaluation)"


class RankTimeout(RuntimeError):
    """A collective timed out: another rank died, hung or was paused."""


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict:
    """One rank's run. A collective that times out (another rank died, hung or was paused) ends
    it with an error that says where this rank waited."""
    phase = _Phase()
    try:
        return _train_rank(rank, world, cfg, phase)
    except RuntimeError as exc:  # torch.distributed's DistBackendError is one
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        raise RankTimeout(f"rank {rank} waited {cfg.timeout:g} s for the other ranks in {phase.now} and gave up: "
                           f"another rank has died, hung or been paused. The last checkpoint in {cfg.out} is "
                           f"complete: continue with --resume (--timeout sets the wait)") from exc


def _train_rank(rank: int, world: int, cfg: TrainConfig, phase: _Phase) -> dict:
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = rank_device()
    master = rank == 0
    stop_requested = _install_stop_handler()

    # data: the cached corpus; every step's global batch is a function of (seed, step)
    corpus = data.prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.seq_len, cfg.heldout_fraction, cfg.cache_dir,
                                 log=lambda *a: None, stdlib_tests=cfg.stdlib_tests)
    accum = cfg.global_batch // (world * cfg.micro_batch)
    eval_inputs, eval_labels = data.eval_batch(corpus, cfg.eval_samples, cfg.seed, cfg.mask_prob)
    eval_inputs, eval_labels = eval_inputs[rank::world].to(device), eval_labels[rank::world].to(device)

    # model: the same seed on every rank, so the same initial weights
    model = build_model(cfg.model, cfg.seed).to(device)
    model.train()

    # optimizer, and the schedule: linear warm-up, then linear decay to 0
    groups, names = param_groups(model, cfg.weight_decay)
    optimizer = make_optimizer(cfg, groups)
    warm, total = cfg.warmup_steps, cfg.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))

    # the run's record (saved in every checkpoint): one entry per step, the evaluations, the diagnostics
    history = {"steps": [], "eval": [], "diagnostics": [], "train_time_s": 0.0, "wall_time_s": 0.0}
    start_step = 0
    if cfg.resume:
        start_step, history = load_checkpoint(cfg, rank, world, model, optimizer, scheduler, history, device)
    last_saved = start_step or None  # the step of the last checkpoint written (kept when a loss goes non-finite)
    if master:
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
        print(f"[{cfg.optimizer}] {world} workers on {device}, {cfg.steps} steps of {cfg.global_batch} samples "
              f"({accum} micro-batches of {cfg.micro_batch} per worker), lr {cfg.lr:g}, warm-up {warm} steps"
              f"{_freeze_banner(optimizer)}" + (f", resuming at step {start_step}" if start_step else ""),
              file=sys.stderr, flush=True)

    log = runlog.RunLog(cfg, start_step, history) if master else None  # console, log.csv, TensorBoard

    def evaluate(step: int) -> Optional[str]:
        """The held-out loss (the same number on every rank); a message when it is not finite."""
        loss = evaluate_mlm(model, eval_inputs, eval_labels, 2 * cfg.micro_batch, device)
        if not math.isfinite(loss):
            return f"the held-out loss is {loss} after step {step}"
        history["eval"].append([step * cfg.global_batch, loss])
        return None

    # the loop; a non-finite loss or parameter stops it on every rank alike (`error`), before
    # anything of that step is applied or saved
    error = evaluate(0) if start_step == 0 else None
    if start_step == 0 and error is None and log is not None:
        log.report(0, history)
    done, stopped_by, t_wall0 = start_step, None, time.perf_counter()
    wall_before = history["wall_time_s"]
    for step in range(start_step, cfg.steps if error is None else start_step):
        phase.now = f"step {step + 1} (its agreement on a finite loss, or the optimizer's collectives)"
        t0 = time.perf_counter()
        # one global batch: this rank's shard, in micro-batches, gradients accumulated locally
        inputs, labels = data.rank_batch(corpus, step, rank, world, cfg.global_batch, cfg.seed, cfg.mask_prob)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i in range(accum):
            sl = slice(i * cfg.micro_batch, (i + 1) * cfg.micro_batch)
            loss = mlm_loss(model, inputs[sl].to(device), labels[sl].to(device)) / accum
            with optimizer.no_sync() if i < accum - 1 else contextlib.nullcontext():  # the last one exchanges
                loss.backward()
            loss_sum += loss.item()
        grad_norm = None
        if cfg.clip > 0:  # this worker's local gradient, before step() communicates anything
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip))
        bad = _ranks_flagged(not math.isfinite(loss_sum) or not math.isfinite(grad_norm or 0.0), rank, world, device)
        if bad:
            error = (f"the training loss or gradient of step {step + 1} is not finite on rank(s) {bad} (rank {rank}: "
                     f"loss {loss_sum}, gradient norm {grad_norm}); the step was not applied")
            break

        # the optimizer step: all communication happens in here
        diagnose = master and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps)
        before = [p.detach().clone() for p in names.values()] if diagnose else None
        stage = optimizer.stage  # the stage this step runs in (a freeze happens at the end of a step)
        lr = scheduler.get_last_lr()[0]  # this step's (the scheduler's step below sets the next one's)
        optimizer.step()
        scheduler.step()
        history["train_time_s"] += time.perf_counter() - t0

        history["steps"].append({"loss": loss_sum, "bytes": optimizer.comm_stats.bytes_sent,
                                 "collectives": optimizer.comm_stats.calls, "stage": stage,
                                 "lr": lr, "freeze": _freeze_stats(optimizer)})
        if diagnose:
            history["diagnostics"].append(layer_report(step + 1, stage, names, before, optimizer))

        # evaluation, checkpoint, stop
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            phase.now = f"the evaluation after step {done}"
            error = evaluate(done)
            if error is not None:
                break
        if log is not None:
            log.report(done, history)
        history["wall_time_s"] = wall_before + time.perf_counter() - t_wall0
        phase.now = f"the agreement to go on after step {done}"
        stop, nonfinite = _agree_any([stop_requested(), not _all_finite(names.values())], device)
        if nonfinite:  # a checkpoint never holds a non-finite parameter
            error = f"the parameters are not finite after step {done}"
            break
        if cfg.stop_after_steps and cfg.stop_after_steps <= done < cfg.steps:
            stop, stopped_by = True, stopped_by or "stop-after-steps"
        elif stop:
            stopped_by = "interrupt"
        if done % cfg.ckpt_every == 0 or stop or done == cfg.steps:
            phase.now = f"the checkpoint of step {done}"
            save_checkpoint(cfg, rank, world, done, model, optimizer, scheduler, history, device)
            last_saved = done
        if stop:
            break
    if log is not None:
        log.close()
    phase.now = "the end of the run (byte counts, metrics)"

    if error is not None:
        kept = (f"the last checkpoint ({_checkpoint_folder(last_saved)}, step {last_saved}) is kept"
                if last_saved else "no checkpoint was written")
        error = (f"[{cfg.optimizer}] stopped: {error}. Nothing non-finite was saved and no metrics were written; "
                 f"{kept}. A smaller --lr (or a longer --warmup-frac) usually helps; start over with --overwrite")
        if master:
            print(error, file=sys.stderr, flush=True)
        return {"completed": False, "interrupted": False, "step": done, "error": error}
    completed = stopped_by is None
    summary = {"completed": completed, "interrupted": stopped_by == "interrupt", "step": done}
    ranks_bytes = _gather_bytes(optimizer.comm_stats.bytes_sent, world, device)
    if completed and master:
        summary.update(write_metrics(cfg, world, history, ranks_bytes, list(names), model))
    elif master:
        print(f"[{cfg.optimizer}] stopped ({stopped_by}) after step {done}; continue with --resume",
              file=sys.stderr, flush=True)
    return summary


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
    common = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                  process_group=None if cfg.local_size is None else onebitlamb.comm.node_groups(cfg.local_size),
                  bucket_cap_mb=cfg.bucket_cap_mb, overlap_with_backward=cfg.bucket_cap_mb is not None)
    if cfg.optimizer == "lamb":  # the exact baseline: its average stays float32
        return onebitlamb.Lamb(groups, **common)
    cls = onebitlamb.OneBitLamb if cfg.optimizer == "onebitlamb" else onebitlamb.OneBitAdam
    return cls(groups, **common, freeze_step=cfg.freeze_step(), warmup_dtype=getattr(torch, cfg.warmup_dtype))


def _freeze_stats(optimizer) -> Optional[dict]:
    """The 1-bit optimizers' freeze record of this step; LAMB has none."""
    stats = getattr(optimizer, "freeze_stats", None)
    return stats() if stats is not None else None


def _freeze_banner(optimizer) -> str:
    stats = _freeze_stats(optimizer)
    if stats is None:
        return ""
    if stats["floor_step"] == stats["cap_step"]:
        return f", freeze at step {stats['cap_step']}"
    return f", freeze automatically between steps {stats['floor_step']} and {stats['cap_step']}"


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
    ``|x_after - x_before| / |x_before|`` measured on the parameters themselves."""
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


def _agree_any(flags: List[bool], device) -> List[bool]:
    """Each flag set on any rank, the same answer on every rank (one small all-reduce). Every rank
    must stop at the same step: a rank left alone would wait in a collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(flags)
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _ranks_flagged(flag: bool, rank: int, world: int, device) -> List[int]:
    """The ranks whose ``flag`` is set, the same list on every rank (one small all-reduce)."""
    if world == 1 or not dist.is_initialized():
        return [rank] if flag else []
    t = torch.zeros(world, dtype=torch.int32, device=device)
    t[rank] = 1 if flag else 0
    dist.all_reduce(t)
    return [r for r, v in enumerate(t.tolist()) if v]


def _all_finite(tensors) -> bool:
    tensors = list(tensors)
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def _gather_bytes(nbytes: int, world: int, device) -> List[int]:
    if world == 1:
        return [nbytes]
    t = torch.zeros(world, dtype=torch.int64, device=device)
    t[dist.get_rank()] = nbytes
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


# ----------------------------------------------------------------------------------------------
# Checkpoints: OUT/ckpt-<step>/{model.pt, trainer.pt, rank<r>.pt}, OUT/checkpoint.json names the last
#
# Every file is written to a temporary name, flushed and renamed; checkpoint.json is switched to a
# new folder only after every rank has written its file and rank 0 has checked each file on disk
# against the sha256 its writer computed, and the previous folder is removed only after that switch:
# a crash at any point leaves the previous complete checkpoint in place. checkpoint.json holds those
# sha256 (the manifest), checked again on --resume. Every file is plain data (tensors, numbers,
# strings, lists, dicts), loaded with ``weights_only=True``: a planted pickle runs no code.
# (Multi-node runs need OUT on a shared file system.)

POINTER = "checkpoint.json"
CKPT_FOLDER = re.compile(r"ckpt-[0-9]{7,}")
# what a run writes into OUT (with the temporary names it writes them under first) and into a
# checkpoint folder: --overwrite removes these and nothing else
RUN_FILE = re.compile(r"(checkpoint|metrics)\.json(\.tmp)?|config\.json|(freeze|curves)\.png|log\.csv"
                      r"|model_final\.pt(\.tmp\.[0-9]+)?")
CKPT_FILE = re.compile(r"(model|trainer|rank[0-9]+)\.pt(\.tmp\.[0-9]+)?")
EVENTS_FILE = re.compile(r"events\.out\.tfevents\..+")  # in OUT/tensorboard (runlog.py)
RANK_FILE = re.compile(r"rank([0-9]+)\.pt")


def _checkpoint_folder(step: int) -> str:
    return f"ckpt-{step:07d}"


def existing_run(out: str) -> List[str]:
    """What shows an earlier run in ``out``: its pointer, its results, its checkpoint folders."""
    if not os.path.isdir(out):
        return []
    return sorted(name for name in os.listdir(out)
                  if name in (POINTER, "metrics.json", "model_final.pt")
                  or (CKPT_FOLDER.fullmatch(name) and os.path.isdir(os.path.join(out, name))))


def refuse_existing_run(cfg: TrainConfig, out: Optional[str] = None) -> List[str]:
    """Without --resume or --overwrite, an earlier run in OUT is an error that says how to go on.
    Returns what shows that run (empty when there is none)."""
    out = cfg.out if out is None else out
    found = [] if cfg.resume else existing_run(out)
    if found and not cfg.overwrite:
        raise SetupError(f"{out} holds an earlier run ({', '.join(found)}): continue it with --resume, or start "
                         f"over with --overwrite (which removes that run's own files only), or choose another --out")
    return found


def prepare_out_dir(cfg: TrainConfig, remove: bool = True) -> None:
    """A new run (no --resume): refuse an earlier run in OUT, or with --overwrite remove its files."""
    refuse_existing_run(cfg)
    if remove:
        os.makedirs(cfg.out, exist_ok=True)
        if cfg.overwrite:
            removed, left = remove_run_files(cfg.out, keep=(cfg.cache_dir,))
            if removed:
                note = f"; left in place (not written by a run): {', '.join(left)}" if left else ""
                print(f"[{cfg.optimizer}] --overwrite: removed the earlier run's {', '.join(removed)}{note}",
                      file=sys.stderr, flush=True)


def remove_run_files(out: str, keep=()) -> Tuple[List[str], List[str]]:
    """Remove the files a run writes into ``out``: its pointer, results, and every checkpoint folder
    (and its TensorBoard folder) that holds nothing else. Returns (removed, left in place); links
    are never followed."""
    keep = {os.path.abspath(k) for k in keep if k}
    removed, left = [], []
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if os.path.abspath(path) in keep:
            continue
        if os.path.islink(path):
            left.append(name)
        elif os.path.isfile(path) and RUN_FILE.fullmatch(name):
            os.remove(path)
            removed.append(name)
        elif os.path.isdir(path) and (CKPT_FOLDER.fullmatch(name) or name == runlog.TENSORBOARD_DIR):
            others = _remove_checkpoint_folder(path, CKPT_FILE if CKPT_FOLDER.fullmatch(name) else EVENTS_FILE)
            if others:
                left.append(f"{name}/ (also holds {', '.join(others)})")
            else:
                removed.append(name + "/")
        else:
            left.append(name + ("/" if os.path.isdir(path) else ""))
    return removed, left


def _remove_checkpoint_folder(folder: str, files: re.Pattern = CKPT_FILE) -> List[str]:
    """Remove a checkpoint folder (or another folder of a run's ``files``) if it holds only the
    files a run writes there; otherwise remove nothing and return the other entries."""
    names = os.listdir(folder)
    others = sorted(n for n in names
                    if not files.fullmatch(n) or os.path.islink(os.path.join(folder, n))
                    or not os.path.isfile(os.path.join(folder, n)))
    if others:
        return others
    for name in names:
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    return []


def check_ranks_agree(model: torch.nn.Module, rank: int, world: int, step: int, device) -> None:
    """Only rank 0's parameters are saved: before each checkpoint the ranks compare a CRC-32 of
    theirs (one all-gather of one integer each), so a rank that drifted apart is named, not lost."""
    if world == 1 or not dist.is_initialized():
        return
    from onebitlamb.optim.checks import parameter_checksum

    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(parameter_checksum(p).to_bytes(4, "little"), crc)
    mine = torch.tensor([crc], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    differ = [r for r, row in enumerate(rows) if int(row) != int(rows[0])]
    if differ:
        raise RuntimeError(f"rank {rank}: after step {step} the parameters of rank(s) {differ} differ from rank 0's; "
                           f"the optimizers keep every rank bit-identical, so something outside them changed a "
                           f"rank's model. Not saving; the last checkpoint is kept")


def save_checkpoint(cfg, rank, world, step, model, optimizer, scheduler, history, device) -> None:
    check_ranks_agree(model, rank, world, step, device)
    name = _checkpoint_folder(step)
    folder = os.path.join(cfg.out, name)
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
    _barrier()
    own = {"optimizer": optimizer.state_dict(), "comm_stats": optimizer.comm_stats.state_dict(),
           "rng": _rng_state()}
    _check_plain(own, f"rank{rank}.pt")
    digest = atomic_save(own, os.path.join(folder, f"rank{rank}.pt"))
    if rank == 0:
        trainer = {"step": step, "scheduler": scheduler.state_dict(), "history": history,
                   "config": dataclasses.asdict(cfg)}
        _check_plain(trainer, "trainer.pt")
        files = {"model.pt": atomic_save(model.state_dict(), os.path.join(folder, "model.pt")),
                 "trainer.pt": atomic_save(trainer, os.path.join(folder, "trainer.pt"))}
    digests = _gather_digests(digest, rank, world, device)  # every rank has written its file
    problem = None
    if rank == 0:
        files.update({f"rank{r}.pt": d for r, d in enumerate(digests)})
        # what is on disk is what each rank wrote: only then does checkpoint.json move to it
        problem = next((f for f, d in files.items() if _sha256(os.path.join(folder, f)) != d), None)
        if problem is None:
            previous = _previous_folder(cfg.out)
            _write_json(os.path.join(cfg.out, POINTER),
                        {"folder": name, "step": step, "world_size": world, "sha256": files})
            if previous and previous != name:  # keep only the latest, removed after the switch
                others = _remove_checkpoint_folder(os.path.join(cfg.out, previous))
                if others:
                    print(f"[{cfg.optimizer}] {previous} left in place: it also holds {', '.join(others)}",
                          file=sys.stderr, flush=True)
    if _agree_any([problem is not None], device)[0]:
        raise RuntimeError(f"checkpoint of step {step}: {os.path.join(folder, problem or 'a file')} differs on disk "
                           f"from what was written; {POINTER} still names the previous checkpoint")


def load_checkpoint(cfg, rank, world, model, optimizer, scheduler, history, device):
    pointer = read_pointer(cfg.out)
    if pointer is None:
        if rank == 0:
            print(f"[{cfg.optimizer}] --resume: no checkpoint in {cfg.out}, starting from scratch", file=sys.stderr)
        return 0, history
    trainer = _load_checkpoint_file(cfg.out, pointer, "trainer.pt", "cpu")
    _check_settings(cfg, trainer["config"])
    saved_ranks = len(_rank_files(cfg.out, pointer))
    if saved_ranks == world:
        own = _load_checkpoint_file(cfg.out, pointer, f"rank{rank}.pt", device)
        optimizer_state = own["optimizer"]
    else:  # another number of ranks: every rank's compression errors, re-sharded
        saved = [_load_checkpoint_file(cfg.out, pointer, f"rank{r}.pt", device) for r in range(saved_ranks)]
        own = saved[rank % saved_ranks]  # the byte counts and RNG state of a rank that was
        optimizer_state = onebitlamb.reshard_state_dicts([s["optimizer"] for s in saved], world)[rank]
        if rank == 0:
            print(f"[{cfg.optimizer}] resuming a checkpoint of {saved_ranks} ranks on {world}: the compression "
                  f"errors are re-sharded (onebitlamb.reshard_state_dicts)", file=sys.stderr)
    model.load_state_dict(_load_checkpoint_file(cfg.out, pointer, "model.pt", device))
    optimizer.load_state_dict(optimizer_state)
    optimizer.comm_stats.load_state_dict(own["comm_stats"])
    scheduler.load_state_dict(trainer["scheduler"])
    _set_rng_state(own["rng"])
    return trainer["step"], trainer["history"]


def check_resumable(cfg: TrainConfig) -> None:
    """Before any worker starts, refuse a checkpoint that cannot be resumed: checkpoint.json naming
    anything but a ``ckpt-<digits>`` folder inside OUT, a file missing, damaged (its sha256 is not
    the manifest's) or not plain data, or settings that change the numbers (changed_settings). A
    checkpoint of another number of ranks resumes, re-sharded (load_checkpoint)."""
    pointer = read_pointer(cfg.out)
    if pointer is None:
        return
    folder = os.path.join(cfg.out, pointer["folder"])
    ranks = _rank_files(cfg.out, pointer)
    if not ranks or ranks != list(range(pointer.get("world_size", len(ranks)))):
        raise SetupError(f"the checkpoint {folder} of {pointer.get('world_size', '?')} ranks holds the files of "
                         f"ranks {ranks}: some rank's file is missing")
    for name in ("trainer.pt", "model.pt", *(f"rank{r}.pt" for r in ranks)):
        loaded = _load_checkpoint_file(cfg.out, pointer, name, "cpu")
        if name == "trainer.pt":
            _check_settings(cfg, loaded["config"])


def _rank_files(out: str, pointer: dict) -> List[int]:
    """The ranks whose files the checkpoint holds (by its manifest, or its folder before manifests)."""
    names = list(pointer["sha256"]) if "sha256" in pointer else sorted(os.listdir(os.path.join(out, pointer["folder"])))
    return sorted(int(m.group(1)) for m in map(RANK_FILE.fullmatch, names) if m)


def _check_settings(cfg: TrainConfig, saved: dict) -> None:
    changed = changed_settings(cfg, saved)
    if changed:
        raise SetupError(f"--resume with different settings than the checkpoint in {cfg.out} (saved, now): {changed}")


def read_pointer(out: str) -> Optional[dict]:
    """checkpoint.json, or None when there is none. The folder it names must be a plain
    ``ckpt-<digits>`` folder inside ``out`` (no path, no link): anything else is refused, and
    nothing is then loaded from it or removed."""
    path = os.path.join(out, POINTER)
    try:
        with open(path) as f:
            pointer = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SetupError(f"{path} cannot be read ({exc}); the checkpoint it named cannot be found") from None
    folder = pointer.get("folder") if isinstance(pointer, dict) else None
    if not isinstance(folder, str) or not CKPT_FOLDER.fullmatch(folder):
        raise SetupError(f"{path} names the checkpoint folder {folder!r}: only a plain ckpt-<digits> folder inside "
                         f"{out} is accepted (no path, no '..'); nothing was loaded or removed")
    full = os.path.join(out, folder)
    if os.path.islink(full) or not os.path.isdir(full):
        raise SetupError(f"{path} names {folder!r}, which is not a folder inside {out} (missing, or a link); "
                         f"nothing was loaded or removed")
    if "sha256" in pointer and not isinstance(pointer["sha256"], dict):
        raise SetupError(f"{path} is damaged: its manifest is not a mapping of files to sha256")
    return pointer


def _previous_folder(out: str) -> Optional[str]:
    """The folder the current checkpoint.json names, or None (also when it names something that
    must not be touched)."""
    try:
        pointer = read_pointer(out)
    except SetupError:
        return None
    return None if pointer is None else pointer["folder"]


def _load_checkpoint_file(out: str, pointer: dict, name: str, map_location):
    """One file of the checkpoint ``pointer`` names: read once, checked against the manifest (a
    checkpoint written before the manifest existed is only loaded), loaded as plain data."""
    path = os.path.join(out, pointer["folder"], name)
    manifest = pointer.get("sha256")
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as exc:
        raise SetupError(f"{path} cannot be read ({exc.strerror or exc}): the checkpoint is incomplete") from None
    if manifest is not None:
        if name not in manifest:
            raise SetupError(f"{path} is not in the manifest of {os.path.join(out, POINTER)}: not loading it")
        if hashlib.sha256(blob).hexdigest() != manifest[name]:
            raise SetupError(f"{path} is damaged: its sha256 is not the one recorded when it was written "
                             f"({POINTER}); not resuming from it")
    try:
        return torch.load(io.BytesIO(blob), map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 (unpickling raises many types)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SetupError(f"{path} cannot be loaded as plain data with weights_only=True ({type(exc).__name__}: "
                         f"{first}); it was not written by this program as it is: not loading it") from None


def _check_plain(obj, where: str, at: str = "") -> None:
    """A checkpoint holds plain data only (what ``torch.load(weights_only=True)`` reads back):
    refuse anything else when saving, not when resuming."""
    if obj is None or type(obj) in (bool, int, float, str, torch.dtype, torch.device, torch.Size):
        return
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return
    if type(obj) in (dict, collections.OrderedDict):
        for k, v in obj.items():
            _check_plain(k, where, at)
            _check_plain(v, where, f"{at}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_plain(v, where, f"{at}[{i}]")
        return
    raise TypeError(f"{where}{at} is a {type(obj).__qualname__}: a checkpoint holds plain data only "
                    f"(tensors, numbers, strings, lists, dicts), loaded back with weights_only=True")


def _gather_digests(digest: str, rank: int, world: int, device) -> List[str]:
    """Every rank's sha256 (hex), on every rank."""
    if world == 1 or not dist.is_initialized():
        return [digest]
    t = torch.zeros(world, 32, dtype=torch.int32, device=device)
    t[rank] = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.int32)
    dist.all_reduce(t)
    return [bytes(row).hex() for row in t.cpu().tolist()]


def _sha256(path: str) -> Optional[str]:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
# The run's results: OUT/metrics.json, OUT/model_final.pt, OUT/curves.png, OUT/freeze.png


def write_metrics(cfg: TrainConfig, world: int, history: dict, ranks_bytes: List[int], layers: List[str],
                  model) -> dict:
    steps = history["steps"]
    samples = cfg.steps * cfg.global_batch
    losses = [loss for _, loss in history["eval"]] + [r["loss"] for r in steps]
    if not all(math.isfinite(v) for v in losses):  # the loop stops before; never report one as a result
        raise RuntimeError(f"[{cfg.optimizer}] a non-finite loss reached the results; no metrics written")
    freeze = None if cfg.optimizer == "lamb" else [_json_safe(r["freeze"]) for r in steps]
    metrics = {
        "optimizer": cfg.optimizer,
        "world_size": world,
        "final_eval_loss": history["eval"][-1][1],
        "samples": samples,
        "steps": cfg.steps,
        "freeze_step": None if freeze is None else freeze[-1]["frozen_at"],
        "warmup_steps": sum(r["stage"] == "warmup" for r in steps),
        "bytes_sent_per_rank": sum(ranks_bytes) / len(ranks_bytes),
        "bytes_sent_by_rank": ranks_bytes,
        "wall_time_s": history["wall_time_s"],
        "train_time_s": history["train_time_s"],
        "samples_per_s": samples / max(history["train_time_s"], 1e-9),
        "eval_curve": history["eval"],
        "bytes_curve": [[i + 1, r["bytes"]] for i, r in enumerate(steps)],
        "train_loss": [r["loss"] for r in steps],
        "stage": [r["stage"] for r in steps],
        "lr": [r["lr"] for r in steps],
        "diagnostics": history["diagnostics"],
        "config": dataclasses.asdict(cfg),
        "freeze": freeze,
        "layers": layers,
    }
    atomic_save(model.state_dict(), os.path.join(cfg.out, "model_final.pt"))
    tmp = os.path.join(cfg.out, "metrics.json.tmp")
    with open(tmp, "w") as f:
        json.dump(metrics, f)
    os.replace(tmp, os.path.join(cfg.out, "metrics.json"))
    for png, draw, what in (("curves.png", plots.plot_run, "loss and bytes"),
                            ("freeze.png", plots.plot_freeze, "how the automatic freeze decided")):
        try:  # after the metrics are safe: a figure that fails to draw must not fail the run
            if draw(metrics, os.path.join(cfg.out, png)):
                print(f"[{cfg.optimizer}] {what}: {cfg.out}/{png}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 (matplotlib's errors have no common type)
            print(f"[{cfg.optimizer}] {png} not drawn: {exc!r}", file=sys.stderr)
    print(f"[{cfg.optimizer}] done: held-out loss {metrics['final_eval_loss']:.4f} after {samples} samples, "
          f"{metrics['bytes_sent_per_rank'] / 1e6:.1f} MB sent per worker, {metrics['wall_time_s']:.0f} s "
          f"({metrics['samples_per_s']:.0f} samples/s)", file=sys.stderr, flush=True)
    return {k: metrics[k] for k in ("final_eval_loss", "samples", "bytes_sent_per_rank", "wall_time_s")}


def _json_safe(value):
    """JSON has no infinities: a layer without gradient yet (log 0) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
