"""Convergence on models the project was never tuned on: every optimizer, five families, paired seeds.

    python -m benchmarks.families                          # the table in BENCHMARKS.md (about 75 minutes on 2 cores)
    python -m benchmarks.families --families gpt-prose --seeds 1 --steps 40    # a quick look

Families (each with its own data, all of it on every machine offline; only the clicks are generated):

- ``gpt-prose``: a causal transformer LM (the transformers library's GPT-2, 2 layers of width 64)
  on bytes of English prose: the running Python's documentation topics (``pydoc_data``), with the
  indented blocks (code samples) dropped.
- ``lstm-prose``: a recurrent LM (an LSTM of width 128) on the same bytes.
- ``cnn-digits``: a convolutional classifier with BatchNorm on scikit-learn's handwritten digits
  (1,797 images of 8x8, shipped inside the package), trained toward zero loss at a large batch.
- ``demo-bert``: the main job's demo BERT (its model and corpus, ``onebitlamb pretrain``'s
  defaults) at a quarter of the demo's batch, at the main job's rates (tuned on it once before) instead of a grid.
- ``dlrm``: a click-through model in the DLRM style on generated clicks (a fixed teacher of the
  same form): Zipf-like id popularity, a fifth of the ids first seen at 80% of the run, after
  every freeze; besides the held-out loss, its AUC and the loss on held-out samples that hold a
  late id (``python -m benchmarks.families --families dlrm``, about 10 minutes).

How the comparison is made. Each optimizer's learning rate is chosen once, on a short grid at
seed 0, by held-out loss at the end; 1-bit LAMB (both compression spaces) takes LAMB's choice,
since it is meant to replace LAMB without retuning. The chosen rates then run at seeds 1..S (the model's initial
weights and the data order); each 1-bit optimizer's held-out loss is paired with LAMB's at the
same seed. A linear warm-up over the first 10% of the steps, then a linear decay to 0, and each
worker's gradient clipped to norm 1, as in the main job; 1-bit LAMB and 1-bit Adam freeze with
``AutoFreeze``, 0/1 Adam takes the main job's schedules.

Each finished run is a line of ``OUT/runs.jsonl`` (default OUT: ``.families``), reused by the
next start: an interrupted benchmark loses at most the run in progress.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.report import mean_interval
from benchmarks.zoo import param_groups
import onebitlamb

TITLE = "Convergence on models we never tuned"
OPTIMIZERS = ("lamb", "onebitlamb", "onebitlamb-momentum", "onebitadam", "zerooneadam")
NAMES = {"lamb": "LAMB", "onebitlamb": "1-bit LAMB (update space, default)",
         "onebitlamb-momentum": "1-bit LAMB (momentum space)", "onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam"}
LAMB_GRID = (1e-2, 2e-2, 4e-2, 8e-2)
ADAM_GRID = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2)
TAKES_LAMBS_RATE = ("onebitlamb", "onebitlamb-momentum")
GRID_SEED = 0


# ---- data and models

def prose_bytes() -> torch.Tensor:
    """English prose as bytes: Python's documentation topics without their indented (code) blocks."""
    from pydoc_data.topics import topics
    lines = [line for key in sorted(topics) for line in topics[key].splitlines() if line and not line[0].isspace()]
    return torch.frombuffer(bytearray("\n".join(lines).encode("utf-8")), dtype=torch.uint8).long()


class ByteLM(nn.Module):
    """A next-byte model around a recurrent or transformer body."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "gpt":
            from transformers import GPT2Config, GPT2LMHeadModel
            cfg = GPT2Config(vocab_size=256, n_positions=65, bos_token_id=0, eos_token_id=0, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0)
            cfg._attn_implementation = "eager"  # the same numbers on every machine
            self.gpt = GPT2LMHeadModel(cfg)
        else:
            self.embed, self.lstm, self.head = nn.Embedding(256, 64), nn.LSTM(64, 128, batch_first=True), nn.Linear(128, 256)
        self.kind = kind

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.kind == "gpt":
            return self.gpt(input_ids=tokens, labels=tokens).loss
        logits = self.head(self.lstm(self.embed(tokens[:, :-1]))[0])
        return nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, 10)

    def forward(self, batch) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.head(self.features(images).flatten(1)), labels)


class DemoBert(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        from onebitlamb.train.model import ModelConfig, build_model
        self.bert = build_model(ModelConfig(), seed)

    def forward(self, batch) -> torch.Tensor:
        from onebitlamb.train.model import mlm_loss
        return mlm_loss(self.bert, *batch)


class ClickModel(nn.Module):
    """A click-through model in the DLRM style: the dense features through an MLP, each categorical
    feature through its own embedding table, every pair of the resulting vectors' dot products,
    and an MLP over those and the dense vector to one logit (binary cross-entropy)."""

    def __init__(self, rows: int, tables: int, dim: int = 16, dense: int = 8) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 32), nn.ReLU(), nn.Linear(32, dim), nn.ReLU())
        self.tables = nn.ModuleList(nn.Embedding(rows, dim) for _ in range(tables))
        pairs = (tables + 1) * tables // 2
        self.top = nn.Sequential(nn.Linear(pairs + dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        vectors = torch.stack([self.bottom(dense)] + [t(ids[:, k]) for k, t in enumerate(self.tables)], dim=1)
        dots = vectors @ vectors.transpose(1, 2)
        i, j = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1)
        return self.top(torch.cat([dots[:, i, j], vectors[:, 0]], dim=1)).squeeze(1)

    def forward(self, batch) -> torch.Tensor:
        dense, ids, clicks = batch
        return nn.functional.binary_cross_entropy_with_logits(self.logits(dense, ids), clicks)


# the click data: ids of each table drawn with Zipf-like popularity; a fifth of them, spread over the
# popularity ranks, first appear once LATE_FROM of the run has passed (after AutoFreeze's cap, so
# after the freeze); clicks from a fixed teacher of the same form, so the rows must be learnt, the
# late ones too
CLICK_ROWS, CLICK_TABLES, LATE_SHARE, LATE_FROM = 2000, 4, 0.2, 0.8


def _click_teacher() -> dict:
    g = torch.Generator().manual_seed(11)
    popularity = 1.0 / torch.arange(1, CLICK_ROWS + 1, dtype=torch.float64) ** 1.05
    order = torch.randperm(CLICK_ROWS, generator=g)  # id of each popularity rank
    late = torch.zeros(CLICK_ROWS, dtype=torch.bool)
    late[order[torch.arange(CLICK_ROWS) % round(1 / LATE_SHARE) == 2]] = True
    weights = torch.zeros(CLICK_ROWS, dtype=torch.float64)
    weights[order] = popularity
    return {"weights": weights, "late": late, "emb": torch.randn(CLICK_TABLES, CLICK_ROWS, 4, generator=g),
            "dense": torch.randn(8, 4, generator=g)}


def _click_samples(t: dict, g: torch.Generator, count: int, late_allowed: bool):
    w = t["weights"] if late_allowed else t["weights"] * (~t["late"]).double()
    ids = torch.multinomial(w, count * CLICK_TABLES, replacement=True, generator=g).view(count, CLICK_TABLES)
    dense = torch.randn(count, 8, generator=g)
    vecs = [dense @ t["dense"]] + [t["emb"][k][ids[:, k]] for k in range(CLICK_TABLES)]
    score = sum((vecs[a] * vecs[b]).sum(1) for a in range(len(vecs)) for b in range(a + 1, len(vecs))) / 3.0
    clicks = torch.bernoulli(torch.sigmoid(score - 1.0), generator=g)
    return dense, ids, clicks


def _clicks(cache: str) -> dict:
    teacher = _click_teacher()
    held = _click_samples(teacher, torch.Generator().manual_seed(12), 8192, late_allowed=True)
    return {"teacher": teacher, "heldout": held}


def _click_batch(d: dict, step: int, rank: int, world: int, seed: int, steps: int, global_batch: int):
    per = global_batch // world
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    return _click_samples(d["teacher"], g, per, late_allowed=step >= LATE_FROM * steps)


def _click_metrics(model: nn.Module, d: dict) -> dict:
    """The held-out AUC, and the loss on the held-out samples that hold a late id."""
    dense, ids, clicks = d["heldout"]
    logits = model.logits(dense, ids)
    losses = nn.functional.binary_cross_entropy_with_logits(logits, clicks, reduction="none")
    with_late = d["teacher"]["late"][ids].any(dim=1)
    order = torch.argsort(logits)
    ranks = torch.empty_like(logits)
    ranks[order] = torch.arange(1, len(logits) + 1, dtype=logits.dtype)
    positives = clicks.sum()
    auc = (ranks[clicks == 1].sum() - positives * (positives + 1) / 2) / (positives * (len(clicks) - positives))
    return {"auc": float(auc), "late_loss": float(losses[with_late].mean())}


def _global_rows(seed: int, step: int, count: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n, (count,), generator=g)


@dataclass
class Family:
    """A model and its data. ``load(cache)`` returns the data (on every rank); ``batch(data, step,
    rank, world, seed)`` this rank's share of the step's global batch; ``heldout(data)`` the fixed
    held-out batches."""
    title: str
    build: Callable[[int], nn.Module]
    load: Callable[[str], dict]
    batch: Callable[[dict, int, int, int, int], object]
    heldout: Callable[[dict], List[object]]
    steps: int
    global_batch: int
    grids: Optional[Dict[str, Sequence[float]]] = None  # instead of LAMB_GRID / ADAM_GRID
    metrics: Optional[Callable[[nn.Module, dict], Dict[str, float]]] = None  # more held-out figures


def _prose(cache: str, seq: int = 64) -> dict:
    data = prose_bytes()
    cut = int(0.9 * len(data))
    train, held = data[:cut], data[cut:]
    starts = torch.arange(0, len(held) - seq - 1, seq + 1)[:256]  # 256 disjoint held-out windows
    return {"train": train, "heldout": torch.stack([held[s:s + seq + 1] for s in starts]), "seq": seq}


def _prose_batch(d: dict, step: int, rank: int, world: int, seed: int, global_batch: int) -> torch.Tensor:
    starts = _global_rows(seed, step, global_batch, len(d["train"]) - d["seq"] - 1)
    per = global_batch // world
    mine = starts[rank * per:(rank + 1) * per]
    return torch.stack([d["train"][s:s + d["seq"] + 1] for s in mine.tolist()])


# the domain shift: from SHIFT_FROM of the run on, half of each batch is the same prose written in
# Greek letters (UTF-8: two bytes a letter, most of them never in the English), so the byte
# embedding's rows of those bytes are first met after the freeze
SHIFT_FROM = 0.8
GREEK = str.maketrans("abcdefghijklmnopqrstuvwxyz", "αβψδεφγηιξκλμνοπ;ρστθωςχυζ")


def _greek(data: torch.Tensor) -> torch.Tensor:
    text = bytes(data.to(torch.uint8).tolist()).decode("utf-8", errors="replace").translate(GREEK)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def _prose_shift(cache: str, seq: int = 64) -> dict:
    d = _prose(cache, seq)
    shifted = {"train": _greek(d["train"]), "seq": seq}
    held = _greek(prose_bytes()[int(0.9 * len(prose_bytes())):])
    starts = torch.arange(0, len(held) - seq - 1, seq + 1)[:256]
    return {**d, "shifted": shifted, "shifted_heldout": torch.stack([held[s:s + seq + 1] for s in starts])}


def _prose_shift_batch(d: dict, step: int, rank: int, world: int, seed: int, global_batch: int) -> torch.Tensor:
    batch = _prose_batch(d, step, rank, world, seed, global_batch)
    if step >= SHIFT_FROM * d["steps"]:
        batch[len(batch) // 2:] = _prose_batch(d["shifted"], step, rank, world, seed + 7, global_batch)[len(batch) // 2:]
    return batch


def _shift_metrics(model: nn.Module, d: dict) -> dict:
    """The held-out loss on the Greek-lettered prose: bytes first met after the freeze."""
    parts = d["shifted_heldout"].split(64)
    return {"late_loss": sum(float(model(b)) for b in parts) / len(parts)}


def _digits(cache: str) -> dict:
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    held, train = order[:360], order[360:]
    return {"train": (images[train], labels[train]), "heldout": (images[held], labels[held])}


def _digits_batch(d: dict, step: int, rank: int, world: int, seed: int, global_batch: int):
    rows = _global_rows(seed, step, global_batch, len(d["train"][1]))
    per = global_batch // world
    mine = rows[rank * per:(rank + 1) * per]
    return d["train"][0][mine], d["train"][1][mine]


def _demo_corpus(cache: str) -> dict:
    from onebitlamb.train.data import load_cache, prepare_corpus
    from onebitlamb.train.model import ModelConfig
    cfg = ModelConfig()
    corpus = prepare_corpus(None, cfg.vocab_size, cfg.seq_len, 0.05, os.path.join(cache, "demo-corpus"), log=lambda *_: None)
    return {"corpus": corpus}


def _demo_batch(d: dict, step: int, rank: int, world: int, seed: int, global_batch: int):
    from onebitlamb.train.data import rank_batch
    return rank_batch(d["corpus"], step, rank, world, global_batch, seed)


def _demo_heldout(d: dict):
    from onebitlamb.train.data import eval_batch
    inputs, labels = eval_batch(d["corpus"], 512, seed=0)
    return [(inputs[i:i + 64], labels[i:i + 64]) for i in range(0, len(inputs), 64)]


FAMILIES: Dict[str, Family] = {
    "gpt-prose": Family("GPT-2 (2 layers, width 64), bytes of English prose, 64 per sequence",
                        lambda seed: ByteLM("gpt"), _prose,
                        lambda d, s, r, w, seed: _prose_batch(d, s, r, w, seed, 64),
                        lambda d: list(d["heldout"].split(64)), steps=200, global_batch=64),
    "lstm-prose": Family("LSTM (width 128), bytes of English prose, 64 per sequence",
                         lambda seed: ByteLM("lstm"), _prose,
                         lambda d, s, r, w, seed: _prose_batch(d, s, r, w, seed, 64),
                         lambda d: list(d["heldout"].split(64)), steps=200, global_batch=64),
    "lstm-shift": Family(f"LSTM (width 128), bytes of English prose; from {SHIFT_FROM:.0%} of the run half of each "
                         f"batch in Greek letters (bytes the English never has)",
                         lambda seed: ByteLM("lstm"), _prose_shift,
                         lambda d, s, r, w, seed: _prose_shift_batch(d, s, r, w, seed, 64),
                         lambda d: list(d["heldout"].split(64)), steps=200, global_batch=64,
                         # lstm-prose's rates, chosen on its grid (BENCHMARKS.md, "families")
                         grids={"lamb": (4e-2,), "onebitadam": (3.2e-2,), "zerooneadam": (1.6e-2,)},
                         metrics=_shift_metrics),
    "cnn-digits": Family("CNN with BatchNorm (3 convolutions), scikit-learn's 8x8 digits, 1,437 training images",
                         lambda seed: DigitsCNN(), _digits,
                         lambda d, s, r, w, seed: _digits_batch(d, s, r, w, seed, 512),
                         lambda d: [d["heldout"]], steps=150, global_batch=512),
    "demo-bert": Family("the demo BERT (2 layers, width 128, vocabulary 4096), the demo corpus, batch 64",
                        DemoBert, _demo_corpus,
                        lambda d, s, r, w, seed: _demo_batch(d, s, r, w, seed, 64),
                        _demo_heldout, steps=120, global_batch=64,
                        # the main job's rates, tuned on this model once before (onebitlamb.train.config.DEFAULT_LR)
                        grids={"lamb": (2e-2,), "onebitadam": (2e-3,), "zerooneadam": (2e-3,)}),
    "dlrm": Family(f"DLRM-style click-through model ({CLICK_TABLES} tables of {CLICK_ROWS:,} rows, width 16), "
                   f"Zipf-like ids, {LATE_SHARE:.0%} of them first seen at {LATE_FROM:.0%} of the run",
                   lambda seed: ClickModel(CLICK_ROWS, CLICK_TABLES), _clicks,
                   lambda d, s, r, w, seed: _click_batch(d, s, r, w, seed, d["steps"], 256),
                   lambda d: [(d["heldout"][0][i:i + 2048], d["heldout"][1][i:i + 2048], d["heldout"][2][i:i + 2048])
                              for i in range(0, 8192, 2048)],
                   steps=240, global_batch=256, metrics=_click_metrics),
}


# ---- one run

def make_optimizer(name: str, groups: List[dict], lr: float, steps: int) -> torch.optim.Optimizer:
    """Each optimizer as a user gets it; 0/1 Adam with the main job's schedules."""
    if name == "lamb":
        return onebitlamb.Lamb(groups, lr=lr)
    freeze = onebitlamb.AutoFreeze(total_steps=steps)
    if name == "onebitlamb":
        return onebitlamb.OneBitLamb(groups, lr=lr, freeze_step=freeze)
    if name == "onebitlamb-momentum":
        return onebitlamb.OneBitLamb(groups, lr=lr, freeze_step=freeze, compression_space="momentum")
    if name == "onebitadam":
        return onebitlamb.OneBitAdam(groups, lr=lr, freeze_step=freeze)
    if name == "zerooneadam":
        return onebitlamb.ZeroOneAdam(groups, lr=lr, total_steps=steps, var_freeze_step=0.25, var_update_scaler=16,
                                      local_step_scaler=0.1)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def train_one(rank: int, world: int, family: Family, data: dict, heldout: List[object], optimizer: str, lr: float,
              seed: int, steps: int) -> dict:
    """One run; returns the held-out loss at the end (mean over the ranks' evaluations: their
    BatchNorm statistics differ), the training losses, where the freeze came, and a divergence."""
    torch.manual_seed(seed)
    model = family.build(seed)
    opt = make_optimizer(optimizer, param_groups(model, weight_decay=0.01), lr, steps)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / (steps - warm)))
    params = [p for p in model.parameters() if p.requires_grad]
    losses, first_compressed, diverged = [], None, None
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        if first_compressed is None and getattr(opt, "stage", "warmup") != "warmup":
            first_compressed = step + 1
        opt.zero_grad()
        loss = model(family.batch(data, step, rank, world, seed))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        try:
            opt.step()
        except FloatingPointError as e:  # agreed on every rank: every rank stops here
            diverged = f"step {step + 1}: {str(e).splitlines()[0]}"
            break
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        held = sum(float(model(b)) for b in heldout) / len(heldout) if diverged is None else math.inf
        extra = family.metrics(model, data) if family.metrics is not None and diverged is None else {}
    names = sorted(extra)
    result = torch.tensor([held, *[extra[k] for k in names], *_window_means(losses, steps)], dtype=torch.float64)
    dist.all_reduce(result)
    result /= world
    held = float(result[0])
    if diverged is None and not math.isfinite(held):
        diverged = "held-out loss not finite"
    born = opt.stats().get("elements_born_after_freeze") if isinstance(opt, onebitlamb.optim.StagedOptimizer) else None
    return {"heldout": held, "train_curve": result[1 + len(names):].tolist(), "freeze": first_compressed,
            "diverged": diverged, "seconds": round(time.perf_counter() - start, 1), "born_after_freeze": born,
            **{k: float(result[1 + i]) for i, k in enumerate(names)}}


def _window_means(losses: List[float], steps: int, windows: int = 10) -> List[float]:
    """The training loss averaged over ``windows`` equal stretches of the run (nan where it stopped)."""
    width = max(1, steps // windows)
    out = []
    for w in range(windows):
        part = losses[w * width:(w + 1) * width]
        out.append(sum(part) / len(part) if len(part) == width else math.nan)
    return out


def run_family(rank: int, world: int, family_name: str, cases: List[dict], log_path: str, cache: str) -> None:
    """Every case of one family in one start of the ranks; rank 0 appends each finished run to
    ``log_path`` and prints a line."""
    family = FAMILIES[family_name]
    data = family.load(cache)
    heldout = family.heldout(data)
    for i, case in enumerate(cases, 1):
        data["steps"] = case["steps"]  # the run's length, for data that changes part way (dlrm)
        result = train_one(rank, world, family, data, heldout, case["optimizer"], case["lr"], case["seed"], case["steps"])
        if rank == 0:
            record = {**case, "family": family_name, "world": world, **result}
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            verdict = result["diverged"] or f"held-out {result['heldout']:.4f}"
            print(f"[{family_name} {i}/{len(cases)}] {case['optimizer']} lr {case['lr']:g} seed {case['seed']}: "
                  f"{verdict} ({result['seconds']:.0f} s)", flush=True)


# ---- the plan and the table

def key(r: dict) -> Tuple:
    return (r["family"], r["optimizer"], r["lr"], r["seed"], r["steps"], r["world"])


def load_runs(log_path: str) -> Dict[Tuple, dict]:
    runs = {}
    if os.path.exists(log_path):
        with open(log_path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    runs[key(r)] = r
    return runs


FIXED_RATES: Dict[str, float] = {}  # --rates: every family's rates, instead of its grid


def grid_of(optimizer: str, family: str) -> Sequence[float]:
    if FIXED_RATES:
        return (FIXED_RATES[optimizer],)
    grids = FAMILIES[family].grids
    if grids is not None:
        return grids[optimizer]
    return ADAM_GRID if optimizer in ("onebitadam", "zerooneadam") else LAMB_GRID


def choose_rates(runs: Dict[Tuple, dict], family: str, steps: int, world: int) -> Dict[str, float]:
    """Each optimizer's rate: the grid's lowest held-out loss at seed 0 (1-bit LAMB: LAMB's)."""
    chosen = {}
    for opt in OPTIMIZERS:
        if opt in TAKES_LAMBS_RATE:
            continue
        tried = [(runs[(family, opt, lr, GRID_SEED, steps, world)]["heldout"], lr) for lr in grid_of(opt, family)]
        chosen[opt] = min(tried)[1]
    for opt in TAKES_LAMBS_RATE:
        chosen[opt] = chosen["lamb"]
    return chosen


def run_missing(cases: List[dict], family: str, runs: Dict[Tuple, dict], world: int, log_path: str, cache: str) -> None:
    from onebitlamb.comm.launch import spawn_local
    todo = [c for c in cases if (family, c["optimizer"], c["lr"], c["seed"], c["steps"], world) not in runs]
    if todo:
        print(f"{family}: {len(todo)} runs to go ({len(cases) - len(todo)} reused)", flush=True)
        spawn_local(run_family, world, (family, todo, log_path, cache), timeout_s=6 * 3600, collective_timeout_s=600)
        runs.update(load_runs(log_path))


def summarize(runs: Dict[Tuple, dict], family: str, chosen: Dict[str, float], seeds: Sequence[int], steps: int,
              world: int) -> List[dict]:
    """Per optimizer: the mean held-out loss, the paired gaps to LAMB (%), their mean and 95%
    interval, divergences, freeze steps."""
    lamb = [runs[(family, "lamb", chosen["lamb"], s, steps, world)]["heldout"] for s in seeds]
    rows = []
    for opt in OPTIMIZERS:
        rs = [runs[(family, opt, chosen[opt], s, steps, world)] for s in seeds]
        losses = [r["heldout"] for r in rs]
        gaps = [100.0 * (x - b) / b for x, b in zip(losses, lamb)]
        finite = all(math.isfinite(g) for g in gaps)
        mean, half = mean_interval(gaps) if finite else (math.inf, None)
        rows.append({"optimizer": opt, "lr": chosen[opt], "losses": losses, "gaps": gaps, "mean_gap": mean,
                     "half_width": math.nan if half is None else half, "diverged": [r["diverged"] for r in rs if r["diverged"]],
                     "freeze": [r["freeze"] for r in rs]})
    return rows


def lamb_spread(runs, family, chosen, seeds, steps, world) -> float:
    """LAMB's own seed spread: (max - min) / mean of its held-out losses, in %."""
    xs = [runs[(family, "lamb", chosen["lamb"], s, steps, world)]["heldout"] for s in seeds]
    return 100.0 * (max(xs) - min(xs)) / statistics.fmean(xs)


def _fmt(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}" if math.isfinite(x) else "diverged"


def report(runs, families: Sequence[str], steps_of: Dict[str, int], seeds: Sequence[int], world: int,
           argv: Optional[List[str]], section: str = "families") -> str:
    from benchmarks.report import command_line, heading, table_row

    title = TITLE if section == "families" else f"{TITLE}: {section}"
    lines = heading(title, command_line(argv), f", {world} gloo ranks")
    lines += [f"`benchmarks/families.py`: model families none of our settings were tuned on, each optimizer as "
              f"a user gets it (`AutoFreeze`; 0/1 Adam with the main job's schedules). Learning rates chosen once on a "
              f"grid at seed {GRID_SEED} (LAMB: {', '.join(f'{x:g}' for x in LAMB_GRID)}; 1-bit and 0/1 Adam: "
              f"{', '.join(f'{x:g}' for x in ADAM_GRID)}); 1-bit LAMB takes LAMB's rate untuned, as a user replacing "
              f"LAMB would. Then seeds "
              f"{', '.join(map(str, seeds))}: held-out loss at the end, and each optimizer's gap to LAMB at the same "
              f"seed (negative: lower than LAMB), mean with its 95% interval (Student's t).", ""]
    for family in families:
        steps = steps_of[family]
        chosen = choose_rates(runs, family, steps, world)
        rows = summarize(runs, family, chosen, seeds, steps, world)
        spread = lamb_spread(runs, family, chosen, seeds, steps, world)
        fam = FAMILIES[family]
        edges = [NAMES[o] for o in OPTIMIZERS if o not in TAKES_LAMBS_RATE and len(grid_of(o, family)) > 1
                 and chosen[o] in (min(grid_of(o, family)), max(grid_of(o, family)))]
        rates = ("Rates: fixed by --rates (no grid). " if FIXED_RATES else
                 "Rates: fixed for this family, not chosen on a grid (`benchmarks/families.py` says where they "
                 "come from). " if fam.grids is not None else
                 ("Chosen at the grid's edge: " + ", ".join(edges) + ". ") if edges else "")
        lines += [f"### {family}: {fam.title}; {steps} steps, global batch {fam.global_batch}", "",
                  f"{rates}LAMB's own seed spread (max - min over mean): {spread:.2f}%.", "",
                  table_row(["optimizer", "lr", "held-out loss (mean)", "gap to LAMB, mean ± 95%",
                             "gaps per seed", "first compressed step", "diverged"]),
                  table_row(["---", "---:", "---:", "---:", "---:", "---:", "---"])]
        for r in rows:
            finite = [x for x in r["losses"] if math.isfinite(x)]
            gap = "-" if r["optimizer"] == "lamb" else (
                f"{r['mean_gap']:+.2f}%" + (f" ± {r['half_width']:.2f}" if math.isfinite(r["half_width"]) else "")
                if math.isfinite(r["mean_gap"]) else "diverged")
            per = "-" if r["optimizer"] == "lamb" else ", ".join(f"{g:+.2f}%" if math.isfinite(g) else "inf" for g in r["gaps"])
            freeze = ", ".join("-" if f is None else str(f) for f in r["freeze"]) if r["optimizer"] != "lamb" else "-"
            lines.append(table_row([NAMES[r["optimizer"]], f"{r['lr']:g}",
                                    _fmt(statistics.fmean(finite)) if len(finite) == len(r["losses"]) else "diverged",
                                    gap, per, freeze, "; ".join(r["diverged"]) or "no"]))
        by = {r["optimizer"]: r for r in rows}
        spaces = [u - m for u, m in zip(by["onebitlamb"]["gaps"], by["onebitlamb-momentum"]["gaps"])]
        if all(math.isfinite(x) for x in spaces):
            mean, half = mean_interval(spaces)
            lines += ["", f"1-bit LAMB's two compression spaces, paired by seed (update's gap minus momentum's): "
                          f"{mean:+.2f} points" + (f" ± {half:.2f}" if half is not None else "") + "."]
        if fam.metrics is not None:
            lines += ["", *_metrics_table(runs, family, chosen, seeds, steps, world)]
        lines += ["", f"The grid (seed {GRID_SEED}, held-out loss; the chosen rate in bold):", "",
                  table_row(["optimizer"] + [f"lr {x:g}" for x in LAMB_GRID] + [f"lr {x:g}" for x in ADAM_GRID]),
                  table_row(["---"] + ["---:"] * (len(LAMB_GRID) + len(ADAM_GRID)))]
        for opt in (o for o in OPTIMIZERS if o not in TAKES_LAMBS_RATE):
            cells = [NAMES[opt]]
            for lr in (*LAMB_GRID, *ADAM_GRID):
                r = runs.get((family, opt, lr, GRID_SEED, steps, world))
                cell = "" if r is None else _fmt(r["heldout"])
                cells.append(f"**{cell}**" if r is not None and lr == chosen[opt] else cell)
            lines.append(table_row(cells))
        lines.append("")
    return "\n".join(lines)


def _metrics_table(runs, family, chosen, seeds, steps, world) -> List[str]:
    """A family's own figures: the held-out loss on what first comes late (samples holding a late
    id, the shifted domain) and, for clicks, the AUC; each optimizer's gap to LAMB's paired by seed."""
    from benchmarks.report import table_row
    of = lambda opt: [runs[(family, opt, chosen[opt], s, steps, world)] for s in seeds]  # noqa: E731
    lamb = of("lamb")
    auc = "auc" in lamb[0]
    lines = [table_row(["optimizer", *(["AUC (mean)"] if auc else []), "held-out loss on what comes late (mean)",
                        "its gap to LAMB, mean ± 95%", "gaps per seed"]),
             table_row(["---", *(["---:"] if auc else []), "---:", "---:", "---:"])]
    for opt in OPTIMIZERS:
        rs = of(opt)
        if any(r["diverged"] for r in rs):
            lines.append(table_row([NAMES[opt], *(["diverged"] if auc else []), "diverged", "-", "-"]))
            continue
        gaps = [100.0 * (r["late_loss"] - b["late_loss"]) / b["late_loss"] for r, b in zip(rs, lamb)]
        mean, half = mean_interval(gaps)
        gap = "-" if opt == "lamb" else f"{mean:+.2f}%" + (f" ± {half:.2f}" if half is not None else "")
        per = "-" if opt == "lamb" else ", ".join(f"{g:+.2f}%" for g in gaps)
        lines.append(table_row([NAMES[opt], *([f"{statistics.fmean(r['auc'] for r in rs):.4f}"] if auc else []),
                                _fmt(statistics.fmean(r["late_loss"] for r in rs)), gap, per]))
    return lines


def paired_with(runs, other, families: Sequence[str], steps_of: Dict[str, int], seeds: Sequence[int],
                world: int, label: str) -> List[str]:
    """Each 1-bit optimizer's runs here against the same runs (family, rate, seed, steps) in
    ``other``, from another commit: the paired change of each figure, in %, mean with its 95% interval
    (runs copied into both folders, of optimizers the commits do not differ in, are left out)."""
    from benchmarks.report import table_row
    lines = ["", f"### Against {label}, paired by seed", "",
             table_row(["family", "optimizer", "figure", "change per seed", "mean ± 95%"]),
             table_row(["---", "---", "---", "---:", "---:"])]
    for family in families:
        for opt in (o for o in OPTIMIZERS if o != "lamb"):
            here = [r for r in runs.values() if r["family"] == family and r["optimizer"] == opt and r["seed"] in seeds
                    and r["steps"] == steps_of[family] and r["world"] == world]
            pairs = [(r, other.get(key(r))) for r in sorted(here, key=key)]
            pairs = [(a, b) for a, b in pairs if b is not None and b != a]  # not a run reused in both
            if not pairs:
                continue
            for figure in ("heldout", "late_loss", "auc"):
                if figure not in pairs[0][0] or figure not in pairs[0][1]:
                    continue
                change = [100.0 * (a[figure] - b[figure]) / b[figure] for a, b in pairs]
                if not all(math.isfinite(c) for c in change):
                    continue
                mean, half = mean_interval(change)
                lines.append(table_row([family, NAMES[opt], figure, ", ".join(f"{c:+.2f}%" for c in change),
                                        f"{mean:+.2f}%" + (f" ± {half:.2f}" if half is not None else "")]))
    return lines + [""]


def grid_plan(family: str, steps: int) -> List[dict]:
    """The grid at seed 0, for the optimizers that choose their own rate."""
    return [dict(optimizer=o, lr=lr, seed=GRID_SEED, steps=steps) for o in OPTIMIZERS if o not in TAKES_LAMBS_RATE
            for lr in grid_of(o, family)]


def main(argv: Optional[List[str]] = None) -> None:
    from benchmarks.report import write_section
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--seeds", type=int, default=3, help="seeds 1..N after the grid's seed 0")
    ap.add_argument("--steps", type=int, default=None, help="every family's steps (default: each family's own)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--out", default=".families", help="where the runs are kept (reused by the next start)")
    ap.add_argument("--results", default="BENCHMARKS.md")
    ap.add_argument("--section", default="families", help="the section of --results to write")
    ap.add_argument("--rates", help="fixed rates instead of the grid, e.g. lamb=0.04,onebitadam=0.032,zerooneadam=0.016")
    ap.add_argument("--paired-with", metavar="DIR", help="the --out of the same runs at another commit: "
                    "adds each 1-bit optimizer's change against them, paired by seed")
    ap.add_argument("--paired-label", default="the other commit", help="what --paired-with holds, for the table")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.ranks < 1 or (args.steps is not None and args.steps < 10):
        raise SystemExit("--seeds and --ranks must be at least 1, --steps at least 10")
    if args.rates:
        try:
            rates = {k: float(v) for k, v in (item.split("=") for item in args.rates.split(","))}
        except ValueError:
            raise SystemExit(f"--rates {args.rates!r}: expected optimizer=rate,... such as lamb=0.04,onebitadam=0.032")
        if set(rates) != {o for o in OPTIMIZERS if o not in TAKES_LAMBS_RATE}:
            raise SystemExit(f"--rates {args.rates!r}: give exactly lamb, onebitadam and zerooneadam")
        FIXED_RATES.update(rates)
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "runs.jsonl")
    runs = load_runs(log_path)
    seeds = list(range(1, args.seeds + 1))
    steps_of = {f: args.steps or FAMILIES[f].steps for f in args.families}
    for family in args.families:
        steps = steps_of[family]
        run_missing(grid_plan(family, steps), family, runs, args.ranks, log_path, args.out)
        chosen = choose_rates(runs, family, steps, args.ranks)
        print(f"{family}: rates chosen at seed {GRID_SEED}: {chosen}", flush=True)
        run_missing([dict(optimizer=o, lr=chosen[o], seed=s, steps=steps) for s in seeds for o in OPTIMIZERS],
                    family, runs, args.ranks, log_path, args.out)
    text = report(runs, args.families, steps_of, seeds, args.ranks, argv, args.section)
    if args.paired_with:
        other = load_runs(os.path.join(args.paired_with, "runs.jsonl"))
        text += "\n".join(paired_with(runs, other, args.families, steps_of, seeds, args.ranks, args.paired_label))
    write_section(args.section, text + "\n", path=args.results)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
