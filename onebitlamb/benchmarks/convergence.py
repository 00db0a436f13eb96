"""Convergence at every scale: 1-bit LAMB against LAMB (and 1-bit Adam) with the main job.

    python -m onebitlamb.benchmarks.convergence                    # the default study (~1 h on 2 cores)
    python -m onebitlamb.benchmarks.convergence --presets b512     # one preset
    python -m onebitlamb.benchmarks.convergence --sweep b512       # add the learning-rate sweep
    python -m onebitlamb.benchmarks.convergence --presets b4096 --sweep b4096:lamb   # LAMB's only
    python -m onebitlamb.benchmarks.convergence --presets b512 --seeds b512:2 --sweep b512@2
                                                        # the sweeps at the first 2 seeds
    python -m onebitlamb.benchmarks.convergence --presets b1024 --seeds b1024:3      # 3 seeds
    python -m onebitlamb.benchmarks.convergence --presets b1024 --freeze-steps b1024:72,76   # fixed freezes
    python -m onebitlamb.benchmarks.convergence --presets b1024 --seeds b1024:3 --freeze-steps b1024:72,76@2
                                                        # 3 seeds, the fixed freezes at the first 2
    python -m onebitlamb.benchmarks.convergence --list             # every run: finished, to run or from step N

Every run is ``onebitlamb pretrain`` with the flags shown in the table (so any row can be rerun
by hand), on 4 local workers, the same seed, data order and model (BERT hidden 128, 2 layers,
sequence 64, vocab 4096), except the rows ``--seeds`` adds at other seeds. The presets are the
configurations of the convergence issue: the paper's 15-25% freeze fails at laptop scale, a
later one (or the automatic freeze) does not.
Results go to ``--out`` (one folder per run, reused when it already holds a finished run, so an
interrupted study continues) and to the "convergence" section of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from onebitlamb.benchmarks.report import command_line, heading, table_row, write_section
from onebitlamb.comm.launch import WorkerError

# name -> flags over the demo preset
PRESETS: Dict[str, List[str]] = {
    "b512": ["--global-batch", "512", "--steps", "128", "--eval-every", "16"],
    "b1024": ["--global-batch", "1024", "--steps", "400", "--eval-every", "50"],
    # the paper's regime: a global batch of 4K sequences, as many samples as b1024
    "b4096": ["--global-batch", "4096", "--steps", "100", "--eval-every", "20"],
    "demo": [],
}
# the automatic freeze with the default rule, and with the rule before (see VARIANTS), both freezing
# as soon as the rule holds: the default until 1-bit LAMB's freeze waited for its trust ratios' peak
_AUTO, _AUTO_BEFORE = "1bit-lamb auto (cap 75%), transient end 2.5", "1bit-lamb auto (cap 75%)"
# the default rule, then wait for the median layer's trust ratio to stop rising, with the early
# floor (5%) that every default had until the floor under the wait (this row and the two below keep it;
# the tables before it call this row "default")
_AUTO_TRUST_PEAK = "1bit-lamb auto (cap 75%), transient end 2.5, after trust peak"
# the same, its median trust ratio over the layers LAMB did not clip (--trust-peak-layers unclipped)
AUTO_TRUST_PEAK_UNCLIPPED = "1bit-lamb auto (cap 75%), transient end 2.5, after unclipped trust peak"
# the same, judging the peak by the median layer's level instead of the median of the layers' rises
AUTO_TRUST_PEAK_LEVEL = "1bit-lamb auto (cap 75%), transient end 2.5, after trust peak, median level"
# the same, never frozen before 30% of the steps: every default (docs/convergence.md, "A floor under
# the wait"). Where the wait ends after the floor (b1024 at every seed measured, the cap-frozen b512
# and b4096) it is the run above, step for step
AUTO_FLOOR = "1bit-lamb auto (cap 75%), transient end 2.5, after trust peak, floor 30%"
DEFAULT_AUTO = AUTO_FLOOR  # 1-bit LAMB's automatic freeze with every default
# The rule before with the two options against a blow-up (b512; demo at every seed): can they make
# its earlier freeze safe where it froze in the middle of the plateau exit (demo seed 1236)?
_AUTO_BEFORE_GUARDED = "1bit-lamb auto (cap 75%), update space + guard"
# 1-bit Adam's automatic freeze with the default rule, at the main job's rate for it
_ADAM_AUTO = "1bit-adam auto (cap 75%), transient end 2.5, lr 2e-3"
# Uncompressed Adam at 1-bit Adam's rate: 1-bit Adam whose warm-up lasts the whole run (it freezes
# at the end of the last step, so every step ran Adam with an fp32 all-reduce). On b4096 it splits
# the 1-bit LAMB against 1-bit Adam order into LAMB against Adam and what each compression costs
_ADAM = "adam (1-bit adam never frozen), lr 2e-3"
# variant name -> (optimizer, flags)
VARIANTS: Dict[str, Tuple[str, List[str]]] = {
    "lamb": ("lamb", []),
    "1bit-lamb freeze 20%": ("onebitlamb", ["--freeze-frac", "0.2"]),
    "1bit-lamb freeze 25%": ("onebitlamb", ["--freeze-frac", "0.25"]),
    "1bit-lamb freeze 35%": ("onebitlamb", ["--freeze-frac", "0.35"]),
    # b1024: the step the automatic freeze chose there (79), by hand: how much of the difference
    # to the 20% row (step 80) is the criterion, and how much the run's sensitivity to one step
    "1bit-lamb freeze 19.75%": ("onebitlamb", ["--freeze-frac", "0.1975"]),
    "1bit-lamb freeze 20%, update space + guard": ("onebitlamb", ["--freeze-frac", "0.2", "--compression-space",
                                                                 "update", "--update-guard", "4"]),
    # The plain "auto" rows end the transient at half the spread's peak (`--freeze-transient-end 0`),
    # the rule before the default moved to an absolute end of 2.5 (docs/convergence.md, "A spike on
    # the plateau"); their sweeps and seeds ran with it, and a row's meaning must not move
    # (and they, like every 1-bit LAMB row before the wait for the trust ratios' peak became the
    # default, freeze when the rule holds: --no-freeze-after-trust-peak)
    _AUTO_BEFORE: ("onebitlamb", ["--auto-freeze", "--freeze-frac", "0.75", "--freeze-transient-end", "0",
                                  "--no-freeze-after-trust-peak"]),
    _AUTO: ("onebitlamb", ["--auto-freeze", "--freeze-frac", "0.75", "--freeze-transient-end", "2.5",
                           "--no-freeze-after-trust-peak"]),
    _AUTO_TRUST_PEAK: ("onebitlamb", ["--auto-freeze", "--freeze-frac", "0.75", "--freeze-transient-end", "2.5",
                                      "--freeze-after-trust-peak", "--min-freeze-frac", "0.05"]),
    AUTO_TRUST_PEAK_UNCLIPPED: ("onebitlamb", ["--auto-freeze", "--freeze-frac", "0.75", "--freeze-transient-end",
                                               "2.5", "--freeze-after-trust-peak", "--trust-peak-layers",
                                               "unclipped", "--min-freeze-frac", "0.05"]),
    AUTO_TRUST_PEAK_LEVEL: ("onebitlamb", ["--auto-freeze", "--freeze-frac", "0.75", "--freeze-transient-end",
                                           "2.5", "--freeze-after-trust-peak", "--trust-peak-measure",
                                           "median_level", "--min-freeze-frac", "0.05"]),
    AUTO_FLOOR: ("onebitlamb", ["--auto-freeze", "--freeze-frac", "0.75", "--freeze-transient-end", "2.5",
                                "--freeze-after-trust-peak", "--min-freeze-frac", "0.3"]),
    _AUTO_BEFORE_GUARDED: ("onebitlamb", ["--auto-freeze", "--freeze-frac", "0.75", "--freeze-transient-end", "0",
                                          "--compression-space", "update", "--update-guard", "4",
                                          "--no-freeze-after-trust-peak"]),
    # 1-bit Adam's rows name their rate: the main job's default moved from 1e-3 to 2e-3 (its best in
    # the sweeps), and a row's meaning must not move with it
    "1bit-adam freeze 20%, lr 1e-3": ("onebitadam", ["--freeze-frac", "0.2", "--lr", "1e-3"]),
    "1bit-adam freeze 35%, lr 2e-3": ("onebitadam", ["--freeze-frac", "0.35", "--lr", "2e-3"]),
    "1bit-adam auto (cap 75%), lr 1e-3": ("onebitadam", ["--auto-freeze", "--freeze-frac", "0.75",
                                                         "--freeze-transient-end", "0", "--lr", "1e-3"]),
    "1bit-adam auto (cap 75%), lr 2e-3": ("onebitadam", ["--auto-freeze", "--freeze-frac", "0.75",
                                                         "--freeze-transient-end", "0", "--lr", "2e-3"]),
    _ADAM_AUTO: ("onebitadam", ["--auto-freeze", "--freeze-frac", "0.75", "--freeze-transient-end", "2.5",
                                "--lr", "2e-3"]),
    _ADAM: ("onebitadam", ["--freeze-frac", "1.0", "--lr", "2e-3"]),
}
# The cap is generous because the criterion, not the cap, should decide: on short runs the plateau
# exit can sit past half of the run (b4096: steps 45-70 of 100). What runs by default on each preset
# (the full cross product is hours on 2 cores):
DEFAULT_PLAN: Dict[str, List[str]] = {
    "b512": ["lamb", "1bit-lamb freeze 20%", "1bit-lamb freeze 25%", "1bit-lamb freeze 20%, update space + guard",
             "1bit-lamb auto (cap 75%)", _AUTO_BEFORE_GUARDED,
             "1bit-adam freeze 20%, lr 1e-3", "1bit-adam auto (cap 75%), lr 1e-3",
             _AUTO, _ADAM_AUTO, DEFAULT_AUTO],
    "b1024": ["lamb", "1bit-lamb auto (cap 75%)", "1bit-adam auto (cap 75%), lr 2e-3", "1bit-lamb freeze 20%",
              "1bit-lamb freeze 35%", "1bit-lamb freeze 19.75%", _AUTO, _ADAM_AUTO, DEFAULT_AUTO],
    "b4096": ["lamb", "1bit-lamb auto (cap 75%)", "1bit-adam auto (cap 75%), lr 2e-3", "1bit-lamb freeze 20%",
              "1bit-lamb freeze 35%", _AUTO, _ADAM_AUTO, _ADAM, DEFAULT_AUTO],
    # with the 35% rows: `make demo` (onebitlamb compare --preset demo) at the main job's defaults
    "demo": ["lamb", "1bit-lamb freeze 35%", "1bit-lamb auto (cap 75%)", "1bit-adam auto (cap 75%), lr 1e-3",
             "1bit-adam freeze 35%, lr 2e-3", _AUTO, _ADAM_AUTO, _AUTO_BEFORE_GUARDED, DEFAULT_AUTO],
}
# The rows repeated at more seeds with --seeds: the automatic freeze with the default rule, the best
# hand-picked freeze of the default plan (one seed cannot tell them apart: on b1024 one step of
# freeze, 79 or 80, moved the loss by 2.8%), LAMB, and the automatic freeze with the rule before
# (the first two answer "is auto as good as the best hand-picked freeze" without LAMB), and 1-bit
# Adam with the default rule; and 1-bit LAMB with every default (the rule, then the trust ratios' peak)
SEEDED: Dict[str, List[str]] = {
    "b512": [_AUTO, "1bit-lamb freeze 20%", "lamb", _AUTO_BEFORE, _ADAM_AUTO, DEFAULT_AUTO],
    "b1024": [_AUTO, "1bit-lamb freeze 20%", "lamb", _AUTO_BEFORE, _ADAM_AUTO, DEFAULT_AUTO],
    "b4096": [_AUTO, "1bit-lamb freeze 20%", "lamb", _AUTO_BEFORE, _ADAM_AUTO, _ADAM, DEFAULT_AUTO],
    "demo": [_AUTO, "1bit-lamb freeze 35%", "lamb", _AUTO_BEFORE, _ADAM_AUTO, _AUTO_BEFORE_GUARDED, DEFAULT_AUTO],
}
# The rule before ran at these many seeds while it was the default; its seeded rows stop there, so
# that more seeds of the default's rows do not also rerun a rule no longer in use (10 minutes a run).
# On b1024 it runs at all seven: no spike made a peak there, so a rule that distrusted only a peak
# made by a spike would freeze at its steps (docs/convergence.md, "Other signals")
SEEDS_OF_THE_RULE_BEFORE: Dict[str, int] = {"b1024": 7, "demo": 4}
DEFAULT_SEED = 1234  # the main job's (pretrain.DEFAULTS["seed"]), so the default plan is seed 1234

# The learning-rate sweep of a variant starts at half and twice its own rate (its --lr, or the main
# job's default) and goes one more factor of 2 outwards while the best rate is at an edge, so that
# the best ends between two worse ones (or at the limit).
SWEEP_FACTOR = 2.0
SWEEP_MAX_RATES = 5
# the variants swept for each optimizer (those the headline comparisons use)
SWEPT = {"lamb": ("lamb",), "onebitlamb": (_AUTO_BEFORE, _AUTO),
         "onebitadam": ("1bit-adam auto (cap 75%), lr 1e-3", "1bit-adam auto (cap 75%), lr 2e-3", _ADAM_AUTO)}


def format_rate(rate: float) -> str:
    """0.02 -> "2e-2" (the form of the --lr flags and run folders)."""
    mantissa, exponent = f"{rate:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def sweep_rates(base: float, loss_at: Callable[[float], float]) -> List[float]:
    """The rates swept around ``base``, lowest first; ``loss_at(rate)`` runs one (NaN: diverged,
    counts as the worst). Half and twice ``base`` first, then one more factor outwards while the best
    is the lowest or the highest rate tried, up to ``SWEEP_MAX_RATES`` rates."""
    rates = [base / SWEEP_FACTOR, base, base * SWEEP_FACTOR]
    while True:
        losses = [loss_at(rate) for rate in rates]
        best = min(range(len(rates)), key=lambda i: losses[i] if losses[i] == losses[i] else math.inf)
        if len(rates) >= SWEEP_MAX_RATES or 0 < best < len(rates) - 1:
            return rates
        if best == 0:
            rates.insert(0, rates[0] / SWEEP_FACTOR)
        else:
            rates.append(rates[-1] * SWEEP_FACTOR)


def pretrain_config(optimizer: str, flags: Sequence[str], out_dir: str = "", cache_dir: str = ""):
    """The main job's configuration for ``onebitlamb pretrain --preset demo --optimizer OPTIMIZER FLAGS``."""
    from onebitlamb.train import pretrain

    parser = argparse.ArgumentParser()
    pretrain.add_arguments(parser)
    return pretrain.config_from_args(parser.parse_args(["--preset", "demo", "--optimizer", optimizer, "--out", out_dir,
                                                        "--cache-dir", cache_dir, "--no-progress", *flags]))


def _saved_run(out_dir: str, cfg) -> Optional[dict]:
    """The finished run ``out_dir`` holds (its metrics, or the record of its divergence), None when it
    holds none. Raises ValueError when that run had settings other than ``cfg``'s."""
    from onebitlamb.train import pretrain

    for name in ("diverged.json", "metrics.json"):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            changed = pretrain.changed_settings(cfg, saved["config"])
            if changed:
                # a default of the main job or the study's flags moved since: never show that run as this one
                raise ValueError(f"{out_dir} holds a run with other settings (saved, now): {changed}; move it "
                                 f"away to rerun")
            return saved
    return None


def _checkpoint_step(out_dir: str) -> Optional[int]:
    """The step of the last checkpoint in ``out_dir`` (None when there is none)."""
    try:
        with open(os.path.join(out_dir, "checkpoint.json")) as f:
            return int(json.load(f)["step"])
    except FileNotFoundError:
        return None


def run_one(out_dir: str, optimizer: str, flags: Sequence[str], cache_dir: str) -> dict:
    """One ``onebitlamb pretrain`` run (skipped when ``out_dir`` already holds its metrics, or the
    record of its divergence, from a run with the same settings). A run stopped or killed before its
    end goes on from its last checkpoint: resuming is exact, so it ends as it would have without the
    stop, and a benchmark of hours loses at most the steps since that checkpoint."""
    from onebitlamb.train import pretrain

    cfg = pretrain_config(optimizer, flags, out_dir, cache_dir)
    saved = _saved_run(out_dir, cfg)
    if saved is not None:
        return saved
    step = _checkpoint_step(out_dir)
    if step is not None:  # --resume refuses a checkpoint of other settings
        print(f"    going on from step {step} of the interrupted run in {out_dir}", file=sys.stderr, flush=True)
        cfg = dataclasses.replace(cfg, resume=True)
    try:
        result = pretrain.train(cfg)
    except WorkerError as exc:
        if "FloatingPointError" not in str(exc):
            raise
        # the 1-bit all-reduce refuses a NaN/inf momentum on every rank: the run diverged (kept, so
        # that rendering the table again does not rerun it)
        diverged = {"final_eval_loss": float("nan"), "freeze_step": None, "bytes_sent_per_rank": 0,
                    "diverged": str(exc).strip().splitlines()[-1], "config": dataclasses.asdict(cfg)}
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "diverged.json"), "w") as f:
            json.dump(diverged, f)
        return diverged
    if not result["completed"]:
        raise RuntimeError(f"the run in {out_dir} stopped before its end; the same command goes on from its "
                           f"last checkpoint")
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)


def _status_and_run(out_dir: str, optimizer: str, flags: Sequence[str]) -> Tuple[str, Optional[dict]]:
    """``run_status`` and the finished run it found (None unless finished or diverged)."""
    try:
        saved = _saved_run(out_dir, pretrain_config(optimizer, flags, out_dir))
    except ValueError:
        return "other settings", None
    if saved is not None:
        return ("diverged" if "diverged" in saved else "finished"), saved
    step = _checkpoint_step(out_dir)
    return ("to run" if step is None else f"from step {step}"), None


def run_status(out_dir: str, optimizer: str, flags: Sequence[str]) -> str:
    """What ``run_one`` would find in ``out_dir``: "finished", "diverged", "from step N" (an
    interrupted run it goes on with), "to run", or "other settings" (a run it refuses to reuse)."""
    return _status_and_run(out_dir, optimizer, flags)[0]


class Row(NamedTuple):
    """One run of the study: ``onebitlamb pretrain --preset demo --optimizer OPTIMIZER FLAGS``."""
    preset: str
    label: str                  # the table's row name, also the run folder's
    optimizer: str
    flags: List[str]
    variant: str                # the VARIANTS entry it runs (at another rate or seed for sweeps and repeats)
    seed: int = DEFAULT_SEED
    swept: bool = False         # sweep its learning rate too


def parse_sweep(items: Sequence[str]) -> Dict[str, Dict[str, int]]:
    """``["b512", "b4096:lamb", "b1024:onebitadam@2"]`` -> which optimizers to sweep on which preset
    (all by default), and at how many seeds (the first; ``@N``: the first N of the preset's --seeds).
    Items for the same preset add up: ``b1024 b1024:onebitadam@2`` sweeps every optimizer at the
    first seed and 1-bit Adam at the first two."""
    out: Dict[str, Dict[str, int]] = {}
    for item in items:
        head, at, seed_count = item.partition("@")
        preset, _, names = head.partition(":")
        optimizers = names.split(",") if names else list(SWEPT)
        if (preset not in PRESETS or not all(o in SWEPT for o in optimizers)
                or (at and not (seed_count.isdigit() and int(seed_count) >= 1))):
            raise ValueError(f"invalid sweep {item!r}: PRESET[:OPTIMIZER,...][@N] with PRESET in {sorted(PRESETS)}, "
                             f"OPTIMIZER in {sorted(SWEPT)} and N >= 1")
        for optimizer in optimizers:
            out.setdefault(preset, {})[optimizer] = int(seed_count) if at else 1
    return out


def parse_seeds(items: Sequence[str]) -> Dict[str, int]:
    """``["b1024:3"]`` -> how many seeds to run the preset's SEEDED rows with (the default's included)."""
    out: Dict[str, int] = {}
    for item in items:
        preset, _, count = item.partition(":")
        if preset not in PRESETS or not count.isdigit() or int(count) < 1:
            raise ValueError(f"invalid seeds {item!r}: PRESET:N with PRESET in {sorted(PRESETS)} and N >= 1")
        out[preset] = int(count)
    return out


def parse_freeze_steps(items: Sequence[str]) -> Dict[str, Tuple[List[int], Optional[int]]]:
    """``["b1024:72,76"]`` -> the fixed freeze steps to run 1-bit LAMB with on the preset, at every
    seed (None); ``"b1024:72,76@2"``: at the first 2 seeds only (a scan need not follow --seeds up)."""
    out: Dict[str, Tuple[List[int], Optional[int]]] = {}
    for item in items:
        preset, _, rest = item.partition(":")
        steps, at, seed_count = rest.partition("@")
        numbers = steps.split(",")
        if (preset not in PRESETS or not all(n.isdigit() and int(n) >= 1 for n in numbers)
                or (at and not (seed_count.isdigit() and int(seed_count) >= 1))):
            raise ValueError(f"invalid freeze steps {item!r}: PRESET:STEP,...[@N] with PRESET in {sorted(PRESETS)}, "
                             f"every STEP >= 1 and N >= 1")
        total = pretrain_config("onebitlamb", PRESETS[preset]).steps
        late = [int(n) for n in numbers if int(n) >= total]
        if late:
            raise ValueError(f"invalid freeze steps {item!r}: {late} not before the last step of {preset} ({total})")
        out[preset] = sorted({int(n) for n in numbers}), int(seed_count) if at else None
    return out


FREEZE_STEP_VARIANT = "1bit-lamb freeze step "


def freeze_step_variant(step: int, steps: int) -> Tuple[str, str, List[str]]:
    """1-bit LAMB frozen by hand at ``step`` of ``steps``: its variant name, optimizer and flags."""
    # step / steps is exact enough that the main job's round(frac * steps) gives the step back
    return f"{FREEZE_STEP_VARIANT}{step}", "onebitlamb", ["--freeze-frac", repr(step / steps)]


def row_at_seed(preset: str, variant: str, optimizer: str, flags: List[str], seed: int = DEFAULT_SEED,
                swept: bool = False) -> Row:
    """The study's row of ``variant`` on ``preset`` at ``seed``: its label, flags and so its run folder
    (other benchmarks that run the same configuration use this, so that they share the run)."""
    # the default seed's rows keep their plain label and flags: their run folders predate --seeds
    if seed == DEFAULT_SEED:
        return Row(preset, variant, optimizer, PRESETS[preset] + flags, variant, swept=swept)
    return Row(preset, f"{variant}, seed {seed}", optimizer, PRESETS[preset] + flags + ["--seed", str(seed)],
               variant, seed=seed, swept=swept)


def plan(presets: Sequence[str], sweep: Sequence[str] = (), seeds: Sequence[str] = (),
         freeze_steps: Sequence[str] = ()) -> List[Row]:
    """Every run of the default plan on ``presets``; ``sweep`` (see ``parse_sweep``) marks the rows
    whose learning rate to sweep, ``seeds`` (see ``parse_seeds``) repeats the SEEDED rows at more
    seeds (DEFAULT_SEED + 1, + 2, ...; the rule before's only up to SEEDS_OF_THE_RULE_BEFORE),
    ``freeze_steps`` (see ``parse_freeze_steps``) adds 1-bit LAMB frozen at those steps, at every seed
    the preset runs."""
    swept, seeded = parse_sweep(sweep), parse_seeds(seeds)
    scanned = parse_freeze_steps(freeze_steps)
    for preset, counts in swept.items():
        short = {o: n for o, n in counts.items() if n > seeded.get(preset, 1)}
        if short:
            raise ValueError(f"invalid sweep of {preset} at {short} seeds: more than the {seeded.get(preset, 1)} "
                             f"--seeds gives it")

    def is_swept(preset: str, variant: str, optimizer: str, seed: int) -> bool:
        # past the first seed only the default rule's rows: the rule before is no longer in use
        return (variant in SWEPT[optimizer] and seed < DEFAULT_SEED + swept.get(preset, {}).get(optimizer, 0)
                and (seed == DEFAULT_SEED or variant != _AUTO_BEFORE))

    def at_seed(preset: str, variant: str, optimizer: str, flags: List[str], seed: int) -> Row:
        return row_at_seed(preset, variant, optimizer, flags, seed, swept=is_swept(preset, variant, optimizer, seed))

    rows = []
    for preset in presets:
        for variant in DEFAULT_PLAN[preset]:
            rows.append(at_seed(preset, variant, *VARIANTS[variant], DEFAULT_SEED))
        for seed in range(DEFAULT_SEED + 1, DEFAULT_SEED + seeded.get(preset, 1)):
            for variant in SEEDED[preset]:
                if variant != _AUTO_BEFORE or seed < DEFAULT_SEED + SEEDS_OF_THE_RULE_BEFORE.get(preset, 1):
                    rows.append(at_seed(preset, variant, *VARIANTS[variant], seed))
        if preset in scanned:
            steps = pretrain_config("onebitlamb", PRESETS[preset]).steps
            scan_steps, scan_seeds = scanned[preset]
            for seed in range(DEFAULT_SEED, DEFAULT_SEED + min(seeded.get(preset, 1), scan_seeds or math.inf)):
                for step in scan_steps:
                    rows.append(at_seed(preset, *freeze_step_variant(step, steps), seed))
    return rows


def folder_name(label: str) -> str:
    """A row's run folder: "1bit-lamb auto (cap 75%), lr 1e-2" -> "1bit-lamb_auto_cap_75pct_lr_1e-2"."""
    return label.replace(" ", "_").replace(",", "").replace("%", "pct").replace("(", "").replace(")", "")


def row_folder(out: str, row: Row) -> str:
    return os.path.join(out, row.preset, folder_name(row.label))


def add_run_arguments(parser: argparse.ArgumentParser, out_help: str, section: str) -> None:
    """The options every benchmark made of convergence runs has: ``--out``, ``--results``, ``--section``,
    ``--list``. A section is rendered from the runs in ``--out`` alone, and those folders are not kept
    from one machine to the next, so ``--section`` lets further seeds run in a later session go into a
    section of their own instead of replacing a table whose runs that session does not have."""
    parser.add_argument("--out", default="runs/convergence", help=out_help)
    parser.add_argument("--results", default=None, help="results file (default: BENCHMARKS.md)")
    parser.add_argument("--section", default=section,
                        help=f"the section of the results file to write (default: {section!r}); another name "
                             "keeps the default section as it is")
    parser.add_argument("--list", action="store_true",
                        help="print every run with its state in --out (finished, to run, from step N) and the "
                             "time left, and exit")


def run_rows(rows: Sequence[Row], out: str) -> Dict[Tuple[str, str, int], dict]:
    """Every row's run in its folder under ``out`` (see ``run_one``), by (preset, variant, seed)."""
    results = {}
    for k, row in enumerate(rows, start=1):
        print(f"[{k}/{len(rows)}] {row.preset}: {row.label}", file=sys.stderr, flush=True)
        results[(row.preset, row.variant, row.seed)] = run_one(row_folder(out, row), row.optimizer, row.flags,
                                                               os.path.join(out, "cache"))
    return results


def command(row: Row) -> str:
    """The main job's command line for ``row``."""
    return f"onebitlamb pretrain --preset demo --optimizer {row.optimizer} {' '.join(row.flags)}".rstrip()


def print_plan(rows: Sequence[Row], out: str, describe: Callable[[Row], str] = command) -> None:
    """``--list``: every run with what ``run_one`` would find of it in ``out`` (see ``run_status``),
    then how many are left and about how long they take at the finished runs' mean wall time."""
    left, seconds = 0, []
    for row in rows:
        status, saved = _status_and_run(row_folder(out, row), row.optimizer, row.flags)
        print(f"{status:15s} {row.preset:6s} {describe(row)}")
        if status == "finished":
            seconds.append(saved["wall_time_s"])
        elif status != "diverged":
            left += 1
    summary = f"{len(rows)} runs, {len(rows) - left} finished, {left} to run"
    if left and seconds:
        mean = sum(seconds) / len(seconds)
        summary += f": about {left * mean / 3600:.1f} h at the finished runs' mean of {mean / 60:.0f} min"
    print(summary)


def rate_stem(label: str) -> str:
    """A row's label without its rate and seed: what its sweep is named by."""
    return label.split(", lr ")[0].split(", seed ")[0]


def with_rate(label: str, flags: Sequence[str], rate: float) -> Tuple[str, List[str]]:
    """A row's label and flags at another learning rate (replacing its own --lr, if any); a seed
    stays last in both, as in the rows ``--seeds`` adds."""
    _, seed_mark, seed = label.partition(", seed ")
    kept = [f for i, f in enumerate(flags) if f != "--lr" and (i == 0 or flags[i - 1] != "--lr")]
    seed_flags = kept[-2:] if seed_mark else []
    kept = kept[:len(kept) - len(seed_flags)]
    return (f"{rate_stem(label)}, lr {format_rate(rate)}{seed_mark}{seed}",
            kept + ["--lr", format_rate(rate)] + seed_flags)


def own_rate(optimizer: str, flags: Sequence[str]) -> float:
    """The learning rate a row runs at: its --lr, or the main job's default for the optimizer."""
    return pretrain_config(optimizer, flags).lr


def is_plain_freeze(row: Row) -> bool:
    """1-bit LAMB at its own rate and options, frozen by hand (the rows a freeze-step table compares)."""
    extra = list(row.flags[len(PRESETS[row.preset]):])
    if row.seed != DEFAULT_SEED:
        extra = extra[:-2]  # "--seed N"
    return row.optimizer == "onebitlamb" and len(extra) == 2 and extra[0] == "--freeze-frac"


def is_scan_result(result: dict) -> bool:
    """A result of a --freeze-steps row (1-bit LAMB frozen by hand at a scanned step)."""
    return result.get("variant", "").startswith(FREEZE_STEP_VARIANT)


def _gap(loss: float, ref: float) -> str:
    return f"{100 * (loss / ref - 1):+.1f}%"


def _loss(loss: float) -> str:
    return f"{loss:.3f}" if loss == loss else "NaN"


# Student's t at 97.5%, by degrees of freedom 1-30 (textbook values): the standard error of a mean
# over a few seeds is itself estimated from those seeds, so "two standard errors" overstates what
# four seeds know (at 3 degrees of freedom two errors is a two-sided p of about 0.14, not 0.05)
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
          2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
          2.045, 2.042)


def settling_factor(count: int) -> float:
    """How many standard errors from zero a mean over ``count`` paired values must lie for the seeds to
    settle its sign: the two-sided 95% quantile of Student's t with ``count - 1`` degrees of freedom
    (above 30 the value at 30, a little above the true one)."""
    if count < 2:
        raise ValueError(f"count must be at least 2 for a standard error, got {count}")
    return _T_975[min(count - 1, len(_T_975)) - 1]


def mean_and_standard_error(values: Sequence[float]) -> Tuple[float, float]:
    """The mean of per-seed values and its standard error: how far the seeds pin the mean down
    (at least two values)."""
    average = sum(values) / len(values)
    deviation = math.sqrt(sum((v - average) ** 2 for v in values) / (len(values) - 1))
    return average, deviation / math.sqrt(len(values))


def mean_and_margin(values: Sequence[float]) -> Tuple[float, float, float]:
    """The mean of per-seed values, its standard error, and the half-width of its 95% interval by
    Student's t (``settling_factor`` errors): the seeds settle the mean's sign when it lies further
    from zero than that."""
    mean, error = mean_and_standard_error(values)
    return mean, error, settling_factor(len(values)) * error


def _auto_against_hand_picked(repeats: Dict[Tuple[str, str], Dict[int, dict]]) -> List[str]:
    """The issue's question on each seeded preset, at the seeds both ran: is the automatic freeze at
    least as good as the best hand-picked one (SEEDED's first two rows)? With every default, with the
    rule alone, and with the rule before, where each ran at more than one seed. A diverged run counts as lost."""
    lines: List[str] = []
    for (preset, (_, picked, *_)), auto in itertools.product(SEEDED.items(), (DEFAULT_AUTO, _AUTO, _AUTO_BEFORE)):
        auto_runs, picked_runs = repeats.get((preset, auto), {}), repeats.get((preset, picked), {})
        seeds = sorted(set(auto_runs) & set(picked_runs))
        if len(seeds) < 2:
            continue
        cells, gaps, no_worse = [], [], 0
        for seed in seeds:
            ours, theirs = auto_runs[seed]["loss"], picked_runs[seed]["loss"]
            if ours != ours:
                cells.append(f"{seed}: auto diverged")
            elif theirs != theirs:
                cells.append(f"{seed}: hand-picked diverged")
                no_worse += 1
            else:
                gaps.append(100 * (ours / theirs - 1))
                cells.append(f"{seed}: {gaps[-1]:+.1f}%")
                no_worse += gaps[-1] <= 0
        mean = "-"
        if len(gaps) == len(seeds):
            average, error = mean_and_standard_error(gaps)
            mean = f"{average:+.1f}% ± {error:.1f}"
        lines.append(f"| {preset} | {auto} | {picked} | {', '.join(cells)} | {mean} | {no_worse} of {len(seeds)} |")
    if not lines:
        return []
    return ["", "The automatic freeze against the hand-picked one at the same seed (negative: auto ahead).", "",
            "| preset | automatic | hand-picked | auto vs it per seed | mean ± standard error | auto no worse at |",
            "|---|---|---|---|---:|---:|", *lines]


def render(results: List[dict], command: str) -> str:
    lines = [
        *heading("Convergence: held-out MLM loss at equal samples", command),
        "Each row is `onebitlamb pretrain --preset demo --optimizer OPT FLAGS` on 4 local workers; the gap "
        "is against LAMB on the same preset and seed. Volume is the whole run's bytes per worker against "
        "LAMB's (fp32 all-reduce every step). A model that knows only token frequencies scores about 6.07.",
        "",
        "| preset | run | flags | freeze step | held-out loss | vs LAMB | volume vs LAMB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]

    def key(r: dict) -> Tuple[str, int]:
        return r["preset"], r.get("seed", DEFAULT_SEED)

    # LAMB at its own rate (not a rate a sweep added), per preset and seed
    lamb = {key(r): r for r in results if r.get("variant", r["label"]) == "lamb" and not r.get("added_by_sweep")}
    for r in results:
        ref = lamb.get(key(r))
        gap = _gap(r["loss"], ref["loss"]) if ref and r is not ref and r["loss"] == r["loss"] else "-"
        volume = (f"{ref['bytes'] / r['bytes']:.2f}x less" if ref and r is not ref and r["bytes"]
                  and r["bytes"] != ref["bytes"] else "-")
        loss = f"{r['loss']:.3f}" if r["loss"] == r["loss"] else "diverged (NaN)"
        lines.append(f"| {r['preset']} | {r['label']} | `{' '.join(r['flags'])}` | {r['freeze'] or '-'} | {loss} "
                     f"| {gap} | {volume} |")

    sweeps: Dict[Tuple[str, str, int], List[dict]] = {}
    for r in results:
        if r.get("sweep"):
            sweeps.setdefault((r["preset"], r["sweep"], r.get("seed", DEFAULT_SEED)), []).append(r)
    if sweeps:
        lines += [
            "",
            "Learning-rate sweeps (half and twice each row's own rate, extended by factors of 2 while the best "
            "was at an edge); the gap is against LAMB at its own best rate on the same preset and seed, where "
            "swept.",
            "",
            "| preset | run | seed | held-out loss at each rate | best rate | best loss | vs best LAMB |",
            "|---|---|---:|---|---:|---:|---:|",
        ]
        best = {k: min(rows, key=lambda r: r["loss"] if r["loss"] == r["loss"] else math.inf)
                for k, rows in sweeps.items()}
        for (preset, stem, seed), rows in sweeps.items():
            tried = ", ".join(f"{format_rate(r['rate'])}: {_loss(r['loss'])}"
                              for r in sorted(rows, key=lambda r: r["rate"]))
            top, ref = best[(preset, stem, seed)], best.get((preset, "lamb", seed))
            gap = _gap(top["loss"], ref["loss"]) if ref and stem != "lamb" else "-"
            lines.append(f"| {preset} | {stem} | {seed} | {tried} | {format_rate(top['rate'])} | {_loss(top['loss'])} "
                         f"| {gap} |")

    repeats: Dict[Tuple[str, str], Dict[int, dict]] = {}
    for r in results:
        # (fixed freeze steps have a table of their own)
        if r.get("seed", DEFAULT_SEED) != DEFAULT_SEED and not is_scan_result(r):
            repeats.setdefault((r["preset"], r["variant"]), {})
    for r in results:
        if (r["preset"], r.get("variant")) in repeats and not r.get("added_by_sweep"):
            repeats[(r["preset"], r["variant"])][r.get("seed", DEFAULT_SEED)] = r
    if repeats:
        lines += [
            "",
            "Seeds (model initialisation, data order and held-out batch all follow `--seed`); the gaps are "
            "against LAMB at the same seed, then their mean.",
            "",
            "| preset | run | held-out loss per seed | mean | vs LAMB per seed | mean gap |",
            "|---|---|---|---:|---|---:|",
        ]
        for (preset, variant), by_seed in repeats.items():
            seeds = sorted(by_seed)
            losses = [by_seed[s]["loss"] for s in seeds]
            per_seed = ", ".join(f"{s}: {_loss(by_seed[s]['loss'])}" for s in seeds)
            gaps = [100 * (by_seed[s]["loss"] / lamb[(preset, s)]["loss"] - 1) for s in seeds
                    if (preset, s) in lamb and variant != "lamb"]
            gap_text = ", ".join(f"{g:+.1f}%" for g in gaps) if gaps else "-"
            mean_gap = f"{sum(gaps) / len(gaps):+.1f}%" if gaps else "-"
            lines.append(f"| {preset} | {variant} | {per_seed} | {_loss(sum(losses) / len(losses))} | {gap_text} "
                         f"| {mean_gap} |")
        lines += _auto_against_hand_picked(repeats)

    scanned = sorted({r["preset"] for r in results if is_scan_result(r)})
    if scanned:
        lines += ["", "1-bit LAMB frozen by hand at each step (every plain fixed freeze of the preset, whatever its "
                  "row) and the automatic freeze (the default rule, and the rule before), at the seeds the scan ran; "
                  "the gaps are against LAMB at the same seed, then their mean."]
    automatic = {_AUTO: "auto", _AUTO_BEFORE: "auto, rule before"}
    for preset in scanned:
        # more seeds of the seeded rows are the seed table's business; this one compares steps
        seeds = sorted({r.get("seed", DEFAULT_SEED) for r in results
                        if r["preset"] == preset and is_scan_result(r)})
        lines += ["", table_row(["preset", "freeze", *(f"seed {s}" for s in seeds), "mean gap"]),
                  "|---|---|" + "---|" * len(seeds) + "---:|"]
        by_step: Dict[object, Dict[int, dict]] = {}
        for r in results:
            if r["preset"] != preset or r.get("added_by_sweep"):
                continue
            if r.get("plain_freeze"):
                by_step.setdefault(r["freeze"], {})[r.get("seed", DEFAULT_SEED)] = r
            elif r.get("variant") in automatic:
                by_step.setdefault(automatic[r["variant"]], {})[r.get("seed", DEFAULT_SEED)] = r

        def cell(r: Optional[dict], seed: int, name_step: bool) -> str:
            if r is None:
                return "-"
            ref = lamb.get((preset, seed))
            text = (f"step {r['freeze']}: " if name_step else "") + _loss(r["loss"])
            return text + (f" ({_gap(r['loss'], ref['loss'])})" if ref and r["loss"] == r["loss"] else "")

        names = automatic.values()
        for step in (sorted((s for s in by_step if s not in names), key=int)
                     + [name for name in names if name in by_step]):
            runs = [(by_step[step][s], lamb.get((preset, s))) for s in seeds if s in by_step[step]]
            gaps = [100 * (r["loss"] / ref["loss"] - 1) for r, ref in runs if ref and r["loss"] == r["loss"]]
            mean_gap = f"{sum(gaps) / len(gaps):+.1f}%" if gaps and len(gaps) == len(seeds) else "-"
            lines.append(table_row([preset, step if step in names else f"step {step}",
                                    *(cell(by_step[step].get(s), s, step in names) for s in seeds), mean_gap]))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onebitlamb.benchmarks.convergence",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), default=["b512", "demo"])
    parser.add_argument("--sweep", nargs="+", default=[], metavar="PRESET[:OPT,...][@N]",
                        help="also sweep the learning rate on these presets, of every optimizer or of those "
                             "named (e.g. b4096:lamb; a sweep costs two to four runs per optimizer), at the "
                             "first seed or at the first N of --seeds (e.g. b512@2)")
    parser.add_argument("--seeds", nargs="+", default=[], metavar="PRESET:N",
                        help="also run LAMB, the automatic and the best hand-picked freeze of the preset at "
                             "N seeds in all (e.g. b1024:3; N-1 more runs of each)")
    parser.add_argument("--freeze-steps", nargs="+", default=[], metavar="PRESET:STEP,...[@N]",
                        help="also run 1-bit LAMB frozen at these steps, at every seed of the preset or at its "
                             "first N (e.g. b1024:72,76,82@2); a table sets them beside the automatic freeze")
    add_run_arguments(parser, "run folders (reused to continue)", "convergence")
    args = parser.parse_args(argv)
    try:
        rows = plan(args.presets, args.sweep, args.seeds, args.freeze_steps)
    except ValueError as exc:
        parser.error(str(exc))
    if args.list:
        def describe(row: Row) -> str:
            text = f"{row.label:50s} {command(row)}"
            if row.swept:  # the rates the sweep adds are not listed: they depend on the losses
                rate = own_rate(row.optimizer, row.flags)
                text += (f"\n{'':22s} + --lr {format_rate(rate / SWEEP_FACTOR)} and "
                         f"{format_rate(rate * SWEEP_FACTOR)}, and further out while the best rate is at an edge")
            return text

        print_plan(rows, args.out, describe)
        return 0
    cache = os.path.join(args.out, "cache")
    results: List[dict] = []

    def record(row: Row, sweep: Optional[str], added_by_sweep: bool = False) -> float:
        folder = row_folder(args.out, row)
        t0 = time.perf_counter()
        print(f"[{len(results) + 1}] {row.preset}: {row.label}", file=sys.stderr, flush=True)
        m = run_one(folder, row.optimizer, row.flags, cache)
        print(f"    held-out loss {m['final_eval_loss']:.4f}, freeze {m.get('freeze_step')}, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        results.append({"preset": row.preset, "label": row.label, "flags": row.flags, "loss": m["final_eval_loss"],
                        "freeze": m.get("freeze_step"), "bytes": m["bytes_sent_per_rank"], "sweep": sweep,
                        "rate": own_rate(row.optimizer, row.flags), "variant": row.variant, "seed": row.seed,
                        "added_by_sweep": added_by_sweep, "plain_freeze": is_plain_freeze(row)})
        return m["final_eval_loss"]

    for row in rows:
        stem = rate_stem(row.label) if row.swept else None
        base = own_rate(row.optimizer, row.flags)
        losses = {base: record(row, stem)}
        if row.swept:
            def loss_at(rate: float, row: Row = row) -> float:
                if rate not in losses:
                    label, flags = with_rate(row.label, row.flags, rate)
                    losses[rate] = record(row._replace(label=label, flags=flags), stem, added_by_sweep=True)
                return losses[rate]

            sweep_rates(base, loss_at)
    body = render(results, command_line(argv))
    print(body)
    write_section(args.section, body, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
