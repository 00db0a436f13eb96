"""The main job's configuration: ``TrainConfig`` (one field a setting, with its default), the
presets, the command line's flags built from the fields, and what ``--resume`` accepts.

The order in which a run's settings are made: TrainConfig's defaults, then the preset's values,
then the flags given. Every value is checked here, when the configuration is made, before
anything starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import onebitlamb
from onebitlamb.compression import codec_for, codec_names
from onebitlamb.docs import pointer
from onebitlamb.train import data
from onebitlamb.train.model import ModelConfig

OPTIMIZERS = ("lamb", "onebitlamb", "onebitadam", "zerooneadam")
# what `onebitlamb compare` runs unless --optimizers is given (`make demo`, BENCHMARKS.md's tables)
COMPARED_BY_DEFAULT = ("lamb", "onebitlamb", "onebitadam")
# the learning rate of each optimizer unless --lr is given (0/1 Adam: 1-bit Adam's, not measured for it)
DEFAULT_LR = {"lamb": 2e-2, "onebitlamb": 2e-2, "onebitadam": 2e-3, "zerooneadam": 2e-3}
# the warm-up's average of each optimizer unless --warmup-dtype is given: int8 where it held against
# float32 paired by seed on the demo and b1024 (BENCHMARKS.md, "The warm-up's average quantised"),
# float32 where it did not hold (1-bit Adam: 0.70% behind over 5 demo seeds), where it is not measured
# (0/1 Adam) and where the quantised average cannot run (QUANTISED_CANNOT_RUN)
DEFAULT_WARMUP_DTYPE = {"lamb": "float32", "onebitlamb": "int8", "onebitadam": "float32", "zerooneadam": "float32"}
# the flags with which the quantised average cannot run: it needs the whole gradient before it
# sends (no --bucket-cap-mb, which overlaps) and a flat group (no --local-size)
QUANTISED_CANNOT_RUN = ("bucket_cap_mb", "local_size")
# the flags only one optimizer reads: a resume of another ignores them, as LAMB ignores --freeze
READ_ONLY_BY = {"freeze": ("onebitlamb", "onebitadam"), "var_freeze": ("zerooneadam",),
                "var_update_scaler": ("zerooneadam",), "local_step_scaler": ("zerooneadam",),
                "bound_direction": ("onebitlamb", "onebitadam", "zerooneadam"),
                "warmup_dtype": ("onebitlamb", "onebitadam", "zerooneadam"),  # LAMB's average stays float32
                "compression_space": ("onebitlamb", "zerooneadam"), "trust_ratio_after_freeze": ("onebitlamb",)}
# settings added after runs were saved without them, at the value those runs had
SAVED_BEFORE = {"bound_direction": False, "warmup_dtype": "float32", "shard": 1}
# settings runs were saved under another name and values: old name: (today's name, {old value: today's})
RENAMED = {"stage2_bound": ("bound_direction", {"adam": True, "none": False})}

PRESETS = {
    # for the tests: about a minute on 2 workers (most of it starting them and the corpus)
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
                     "timeout", "agree_every"}


class SetupError(ValueError):
    """A run refused at its start, before any worker starts: a bad setting, an earlier run in the
    way, a checkpoint that cannot be trusted. The command line prints the message alone."""


class RunError(RuntimeError):
    """A run stopped partway for a reason its message states, the same on every rank (a link where
    a checkpoint goes, ranks whose parameters drifted apart, a diverging optimizer): the command
    prints the message alone and exits with status 1."""


def parse_fraction(value: Union[str, float]) -> float:
    """A fraction of the steps, in (0, 1]."""
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = math.nan
    if not 0 < fraction <= 1:  # NaN fails too
        raise ValueError(f"expected a fraction in (0, 1], got {value!r}")
    return fraction


def parse_freeze(value: Union[str, float]) -> Union[str, float]:
    """``"auto"``, or the fraction of the steps after which the 1-bit optimizers freeze, in (0, 1]."""
    if value == "auto":
        return value
    try:
        return parse_fraction(value)
    except ValueError:
        raise ValueError(f"expected 'auto' or a fraction in (0, 1], got {value!r}") from None


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
        "help": "peak learning rate (default: 2e-2 for LAMB and 1-bit LAMB, 2e-3 for 1-bit Adam and 0/1 Adam)"})
    warmup_frac: float = field(default=0.1, metadata={
        "help": "fraction of the steps with a linear learning-rate warm-up, then a linear decay to 0",
        "metavar": "FRACTION"})
    weight_decay: float = field(default=0.01, metadata={"help": "on weight matrices; none on biases and LayerNorm"})
    clip: float = field(default=1.0, metadata={"help": "max norm of each worker's local gradient, 0 = off"})
    freeze: Union[str, float] = field(default="auto", metadata={
        "help": "1-bit optimizers: when to freeze the variance and start compressing. auto: onebitlamb.AutoFreeze "
                "with its defaults; a fraction in (0, 1]: after that fraction of the steps", "type": parse_freeze,
        "metavar": "auto|FRACTION"})
    var_freeze: float = field(default=0.25, metadata={
        "help": "0/1 Adam: its var_freeze_step, the end of the variance phase, as a fraction of the steps (a guess, "
                "not yet measured)", "type": parse_fraction, "metavar": "FRACTION"})
    var_update_scaler: int = field(default=16, metadata={
        "help": "0/1 Adam: its var_update_scaler, the variance updates between two doublings of the variance "
                "interval (DeepSpeed's default)", "metavar": "UPDATES"})
    local_step_scaler: float = field(default=0.1, metadata={
        "help": "0/1 Adam: its local_step_scaler, the steps between two doublings of the local-step interval, as a "
                "fraction of the steps (a guess, not yet measured)", "type": parse_fraction, "metavar": "FRACTION"})
    warmup_dtype: Optional[str] = field(default=None, metadata={
        "help": "1-bit optimizers: the wire format of the warm-up's gradient average (bfloat16: half the bytes, "
                "rounded; int8, int4, int2: blockwise codes with error feedback, 3.9x, 7.8x, 15x fewer bytes; "
                "default: int8 for 1-bit LAMB, float32 for 1-bit Adam and 0/1 Adam and with --bucket-cap-mb or "
                "--local-size, where the quantised average cannot run)",
        "choices": list(codec_names())})  # the registered codecs (compression.codec), a test's or plug-in's too
    compression_space: str = field(default="update", metadata={
        "help": "1-bit LAMB and 0/1 Adam: what the 1-bit all-reduce compresses: the update (Adam's direction, the "
                "momentum over the variance's root) or the momentum (the papers' and DeepSpeed's)",
        "choices": ["update", "momentum"]})
    bound_direction: bool = field(default=True, metadata={
        "help": "1-bit optimizers' bound_direction: after the freeze, clip each element's direction to the largest "
                "Adam's own can take at that step (true, the default: --bound-direction) or not (false, "
                "--no-bound-direction: the papers' and DeepSpeed's rule)"})
    trust_ratio_after_freeze: str = field(default="frozen", metadata={
        "help": "1-bit LAMB: the layer-wise coefficient after the freeze: frozen (the paper's: the trust ratio of "
                "the freeze times a per-layer factor) or live (LAMB's ratio, every step)", "choices": ["frozen", "live"]})
    bucket_cap_mb: Optional[float] = field(default=None, metadata={
        "help": "send the exchange in buckets of at most this many MiB, each behind the backward as soon as its "
                "gradients are ready (default: one bucket, sent in the step)", "metavar": "MIB"})
    local_size: Optional[int] = field(default=None, metadata={
        "help": "ranks per node: the exchange runs over onebitlamb.comm.node_groups(N), exact inside a node and "
                "1-bit across nodes (default: one flat group)"})
    shard: int = field(default=1, metadata={
        "help": "ranks per replica: the model, its gradients and the optimizer's state sharded with FSDP2 over "
                "each N consecutive ranks (a node), the optimizer's exchange across the replicas (HSDP; "
                f"{pointer('integrations', 'Sharded models')}). 1: every rank holds the whole model"})
    agree_every: int = field(default=1000, metadata={
        "help": "steps between the ranks' checks that they still train alike (hyper-parameters, a checksum of "
                "every parameter); 0 = at the first step only"})
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
        "help": "a progress bar on a terminal (the default), or with --no-progress one plain line per report (as "
                "when the output is not a terminal)"})
    stop_after_steps: int = field(default=0, metadata={
        "help": "checkpoint and stop once N steps are done (0: run to the end)", "metavar": "N"})
    timeout: float = field(default=600.0, metadata={
        "help": "seconds a rank waits for the others in a collective before the run ends with an error that "
                "says where it waited (a rank that died, hung or was paused)", "metavar": "SECONDS"})

    # the model's shape (its defaults are ModelConfig's, demo's), then the study's fixed settings,
    # which only a preset sets; the fields keep this order, that of every saved config
    heldout_fraction: float = 0.05
    vocab_size: int = field(default=ModelConfig.vocab_size, metadata={
        "help": "the model: tokens of the WordPiece vocabulary trained on the corpus"})
    seq_len: int = field(default=ModelConfig.seq_len, metadata={
        "help": "the model: tokens per sequence, [CLS] and [SEP] included (>= 8)"})
    hidden: int = field(default=ModelConfig.hidden, metadata={"help": "the model: width (a multiple of --heads)"})
    layers: int = field(default=ModelConfig.layers, metadata={"help": "the model: transformer layers"})
    heads: int = field(default=ModelConfig.heads, metadata={"help": "the model: attention heads per layer"})
    intermediate: int = field(default=ModelConfig.intermediate, metadata={
        "help": "the model: width of each layer's feed-forward block"})
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
        for name in ("var_freeze", "local_step_scaler"):
            try:
                setattr(self, name, parse_fraction(getattr(self, name)))
            except ValueError as exc:
                raise SetupError(f"--{name.replace('_', '-')}: {exc}") from None
        if self.lr is None:
            self.lr = DEFAULT_LR[self.optimizer]
        if self.warmup_dtype is None:
            cannot = any(getattr(self, name) is not None for name in QUANTISED_CANNOT_RUN)
            self.warmup_dtype = "float32" if cannot else DEFAULT_WARMUP_DTYPE[self.optimizer]
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
                     "var_update_scaler", "threads", "vocab_size", "seq_len", "hidden", "layers", "heads", "intermediate"):
            if getattr(self, name) < 1:
                refuse(name, ">= 1")
        if self.seq_len < 8:  # [CLS], [SEP] and a few tokens (data.encode_blocks)
            refuse("seq_len", ">= 8")
        if self.vocab_size <= data.NUM_SPECIAL:
            refuse("vocab_size", f"> {data.NUM_SPECIAL} (its special tokens)")
        if self.hidden % self.heads:
            refuse("heads", f"a divisor of --hidden ({self.hidden})")
        if not self.timeout > 0:
            refuse("timeout", "> 0")
        for name in ("stop_after_steps", "lr", "weight_decay", "clip", "agree_every"):
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
        if self.shard < 1:
            refuse("shard", ">= 1")
        if self.shard > 1:
            for name in ("local_size", "bucket_cap_mb"):
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise SetupError(f"--shard {self.shard} cannot run with {flag}: under FSDP2 the ranks of a node "
                                     f"exchange shards through FSDP, and the optimizer exchanges each shard across "
                                     f"the replicas in step(); leave out {flag}")
            if self.optimizer == "zerooneadam":
                raise SetupError(f"--shard {self.shard} cannot run 0/1 Adam: its local steps leave each replica's "
                                 f"parameters its own between syncs, where FSDP2 keeps one copy of each shard for "
                                 f"every replica; use onebitlamb or onebitadam")
        if self.warmup_dtype not in codec_names():
            refuse("warmup_dtype", f"one of {', '.join(codec_names())}")
        if codec_for(self.warmup_dtype).carries_error and self.optimizer in READ_ONLY_BY["warmup_dtype"]:
            for name in QUANTISED_CANNOT_RUN:
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise SetupError(f"--warmup-dtype {self.warmup_dtype} cannot run with {flag}: the quantised "
                                     f"warm-up average needs the whole gradient and a flat group; use "
                                     f"--warmup-dtype float32 or bfloat16 with {flag}")
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
        if world_size % self.shard:
            raise SetupError(f"--shard {self.shard} must divide the number of workers, {world_size}: each replica "
                             f"holds the whole model on {self.shard} ranks")
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
        if hints[f.name] is bool:
            # a setting on by default takes both forms (--progress, --no-progress), each value
            # by its name; one off by default is a switch that turns it on (--resume)
            parser.add_argument(flag, dest=f.name, default=None, help=meta["help"],
                                action=argparse.BooleanOptionalAction if f.default else "store_true")
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


def config_from_flags(flags: Sequence[str]) -> TrainConfig:
    """The run ``onebitlamb pretrain FLAGS`` asks for, its flags parsed as the command parses them."""
    parser = argparse.ArgumentParser(prog="onebitlamb pretrain")
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(flags)))


def _switch(name: str) -> str:
    """The flag that turns setting ``name`` from its default (``--no-progress``, ``--resume``)."""
    default = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)
    return ("--no-" if default is True else "--") + name.replace("_", "-")


def _as_flags(name: str, value) -> str:
    """A setting as the command line gives it: ``--steps 8``, ``--no-progress``, ``--corpus a b``,
    ``no --bucket-cap-mb``; a setting only a preset sets, by its name."""
    fld = next((f for f in dataclasses.fields(TrainConfig) if f.name == name), None)
    if fld is None or "help" not in fld.metadata:
        return f"{name} {value!r} (set by --preset)"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        if value:
            return flag
        return _switch(name) if fld.default else f"no {flag}"  # --no-progress; no --resume
    if value is None:
        return f"no {flag}"
    if isinstance(value, (list, tuple)):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value}"


def resume_refusal(changed: dict, what: str) -> str:
    """The refusal of a --resume whose settings differ from the saved run's (``changed``: name:
    (saved, now)), ``what`` its first words: the differences, the settings a resume may change,
    and both ways on (the saved values, or a new run)."""
    may = sorted(_switch(k) for k in RESUMABLE_CHANGES - {"resume", "overwrite"})
    saved = ", ".join(_as_flags(k, old) for k, (old, _) in changed.items())
    return (f"{what} (saved, now): {changed}. A resume continues the same run, so only {', '.join(may)} may differ "
            f"(and the flags its optimizer does not read); the rest would change its numbers. To continue it, give "
            f"the saved values ({saved}); to train with the new ones, start a new run: another --out, or --overwrite "
            f"(which removes this run's own files, its checkpoints included)")


def changed_settings(cfg: TrainConfig, saved: dict) -> dict:
    """The settings (name: (saved, now)) in which ``cfg`` differs from a saved run's config, other
    than those that cannot change its numbers (RESUMABLE_CHANGES; the flags this optimizer does not
    read: READ_ONLY_BY)."""
    ignored = RESUMABLE_CHANGES | {k for k, readers in READ_ONLY_BY.items() if cfg.optimizer not in readers}
    saved = saved_settings(saved)
    return {k: (saved.get(k), v) for k, v in dataclasses.asdict(cfg).items()
            if k not in ignored and saved.get(k) != v}


def saved_settings(saved: dict) -> dict:
    """A saved run's settings (its config.json, the config in its checkpoint or its metrics.json, a
    measured entry's) in today's names and values: a setting saved under an earlier name renamed
    (RENAMED: ``stage2_bound`` "adam" is ``bound_direction`` True, "none" False), one added since
    at the value the run had (SAVED_BEFORE). What reads a saved config reads it through here."""
    today = dict(saved)
    for old, (name, values) in RENAMED.items():
        if old in today:
            value = today.pop(old)  # a value of no mapping stays as it was: a resume names it and refuses
            today.setdefault(name, values.get(value, value) if isinstance(value, str) else value)
    return {**SAVED_BEFORE, **today}
