"""Models the project was never tuned on, each small enough for a test on 2 gloo ranks.

Every entry builds a model (seeded, alike on every rank) and draws a rank's batch for a step; the
data is synthetic but learnable (a Markov chain of tokens, a fixed teacher for images), so the
loss falls under a working optimizer. ``run_case`` trains one model with one optimizer and
returns what the zoo's claims are about: each step's largest element move, where the freeze came,
the losses, and whether the ranks' parameters agree at the end.

Used by ``tests/test_zoo.py`` (every optimizer bounded after its freeze on every model) and by
``benchmarks/families.py``.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

import onebitlamb

VOCAB, SEQ, BATCH = 64, 16, 8


def _markov_tokens(g: torch.Generator, batch: int, seq: int, vocab: int = VOCAB) -> torch.Tensor:
    """Tokens from a fixed sparse Markov chain (each token has 4 likely successors), so that a
    language model has something to learn; the chain is the same on every rank and call."""
    table = torch.Generator().manual_seed(7)
    successors = torch.randint(0, vocab, (vocab, 4), generator=table)
    tokens = torch.empty(batch, seq, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, 4, (batch,), generator=g)
        tokens[:, t] = successors[tokens[:, t - 1], pick]
    return tokens


class TokenLM(nn.Module):
    """A causal language model around a body that maps embeddings to features."""

    def __init__(self, body: nn.Module, d: int, vocab: int = VOCAB, causal: bool = False) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(vocab, d), body, nn.Linear(d, vocab)
        self.causal = causal

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        if self.causal:
            mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1])
            h = self.body(h, mask=mask, is_causal=True)
        else:
            h = self.body(h)
        if isinstance(h, tuple):  # a recurrent body returns (output, state)
            h = h[0]
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _torch_transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return TokenLM(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), 16, causal=True)


def _lstm() -> nn.Module:
    return TokenLM(nn.LSTM(16, 24, batch_first=True, proj_size=16), 16)


def _gru() -> nn.Module:
    return TokenLM(nn.GRU(16, 16, batch_first=True), 16)


class _HFLoss(nn.Module):
    """A transformers model whose forward returns its own loss."""

    def __init__(self, model: nn.Module, masked: bool) -> None:
        super().__init__()
        self.model, self.masked = model, masked

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.masked:
            return self.model(input_ids=tokens, labels=tokens).loss
        # mask every fourth position (fixed, so the loss is comparable step to step)
        labels = torch.full_like(tokens, -100)
        labels[:, 1::4] = tokens[:, 1::4]
        inputs = tokens.clone()
        inputs[:, 1::4] = 0  # token 0 stands for [MASK]
        return self.model(input_ids=inputs, labels=labels).loss


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return _HFLoss(GPT2LMHeadModel(cfg), masked=False)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return _HFLoss(BertForMaskedLM(cfg), masked=True)


class SmallCNN(nn.Module):
    """Two convolutions with BatchNorm and a linear head on 12x12 single-channel images."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(64, 4)

    def forward(self, batch) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.head(self.features(images).flatten(1)), labels)


def _image_batch(g: torch.Generator, progress: float, batch: int = 32):
    """Images of four classes: a class's fixed pattern plus noise, so a classifier can reach a
    loss near zero (the regime where a CNN with BatchNorm once diverged)."""
    patterns = torch.randn(4, 1, 12, 12, generator=torch.Generator().manual_seed(11))
    labels = torch.randint(0, 4, (batch,), generator=g)
    return patterns[labels] + 0.8 * torch.randn(batch, 1, 12, 12, generator=g), labels


class RareRows(nn.Module):
    """An embedding-heavy classifier: 512 rows drawn Zipf-like, so most rows see a gradient rarely
    (their variance is tiny, not zero) and a few never."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(512, 16, mode="mean")
        self.head = nn.Linear(16, 2)

    def forward(self, batch) -> torch.Tensor:
        tokens, labels = batch
        return nn.functional.cross_entropy(self.head(self.embed(tokens)), labels)


def _rare_batch(g: torch.Generator, progress: float, batch: int = 32):
    ranks = torch.arange(1, 481, dtype=torch.float)  # rows 480-511 are never drawn
    tokens = torch.multinomial(1.0 / ranks ** 1.2, batch * 6, replacement=True, generator=g).view(batch, 6)
    labels = (tokens % 2).sum(dim=1) % 2  # a function of the rows, so the embedding must learn them
    return tokens, labels


# the late-rows family: rows LATE_ROWS first drawn once LATE_FROM of the run has passed (after any
# freeze the zoo's runs make), as new ids reach a recommender; rows 480-511 never
LATE_ROWS, LATE_FROM = slice(384, 480), 0.8


def _late_batch(g: torch.Generator, progress: float, batch: int = 32):
    tokens, _ = _rare_batch(g, progress, batch)
    tokens = tokens % LATE_ROWS.start  # the early ids only
    if progress >= LATE_FROM:  # from then on a third of each sample's ids are new ones
        late = torch.randint(LATE_ROWS.start, LATE_ROWS.stop, (batch, 2), generator=g)
        tokens = torch.cat([tokens[:, :4], late], dim=1)
    return tokens, (tokens % 2).sum(dim=1) % 2


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, float], object]  # a rank's batch at a point of the run (0..1)
    late_rows: Optional[slice] = None  # rows of the first parameter (an embedding) first met late


def _tokens(g: torch.Generator, progress: float):
    return _markov_tokens(g, BATCH, SEQ)


ZOO: Dict[str, Family] = {
    "torch-transformer": Family(_torch_transformer, _tokens),
    "gpt2": Family(_gpt2, _tokens),
    "bert": Family(_bert, _tokens),
    "cnn-batchnorm": Family(SmallCNN, _image_batch),
    "lstm": Family(_lstm, _tokens),
    "gru": Family(_gru, _tokens),
    "rare-rows": Family(RareRows, _rare_batch),
    "late-rows": Family(RareRows, _late_batch, late_rows=LATE_ROWS),
}


def param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    """Decay on matrices, none on biases and norms: the usual two groups."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(name: str, groups: List[dict], lr: float, steps: int, freeze: Optional[int] = None,
                   bound: bool = True):
    """The optimizers the zoo compares, by name; ``freeze`` a fixed step, else the automatic one;
    ``bound`` the 1-bit optimizers' ``bound_direction``."""
    auto = onebitlamb.AutoFreeze(total_steps=steps) if freeze is None else freeze
    if name not in ("lamb", "adamw"):
        return _one_bit(name, groups, lr, steps, freeze, auto, bound)
    if name == "lamb":
        return onebitlamb.Lamb(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr)  # 1-bit Adam's and 0/1 Adam's rule never frozen


def _one_bit(name, groups, lr, steps, freeze, auto, bound):
    if name == "onebitlamb":
        return onebitlamb.OneBitLamb(groups, lr=lr, freeze_step=auto, bound_direction=bound)
    if name == "onebitlamb-momentum":
        return onebitlamb.OneBitLamb(groups, lr=lr, freeze_step=auto, compression_space="momentum",
                                     bound_direction=bound)
    if name == "onebitadam":
        return onebitlamb.OneBitAdam(groups, lr=lr, freeze_step=auto, bound_direction=bound)
    if name == "zerooneadam":
        var_freeze = max(2, round(0.3 * steps)) if freeze is None else freeze
        return onebitlamb.ZeroOneAdam(groups, lr=lr, var_freeze_step=var_freeze, var_update_scaler=4,
                                      local_step_scaler=max(1, steps // 8), local_step_clipper=4,
                                      bound_direction=bound)
    raise ValueError(f"unknown optimizer {name!r}")


OPTIMIZERS = ("lamb", "adamw", "onebitlamb", "onebitlamb-momentum", "onebitadam", "zerooneadam")


def run_case(rank: int, world: int, family: str, optimizer: str, lr: float, steps: int, seed: int = 0,
             freeze: Optional[int] = None, weight_decay: float = 0.01, bound: bool = True) -> dict:
    """Train ``family`` with ``optimizer`` for ``steps`` steps on this rank's batches; inside a
    process group of ``world`` ranks. Returns per step the training loss (this rank's batch, then
    averaged over the ranks) and the largest absolute change of any parameter element."""
    torch.manual_seed(seed)
    fam = ZOO[family]
    model = fam.build()
    opt = make_optimizer(optimizer, param_groups(model, weight_decay), lr, steps, freeze, bound)
    params = [p for p in model.parameters() if p.requires_grad]
    start = params[0].detach().clone()
    losses, moves, stages = [], [], []
    diverged = None
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(seed * 100_003 + 1009 * step + rank)
        before = torch.cat([p.detach().flatten() for p in params]).clone()
        stages.append(getattr(opt, "stage", "warmup"))  # what this step runs
        opt.zero_grad()
        loss = model(fam.batch(g, (step - 1) / steps))
        loss.backward()
        if not isinstance(opt, onebitlamb.optim.StagedOptimizer) and world > 1:  # a torch optimizer: average here
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= world
        try:
            opt.step()
        except FloatingPointError as e:  # raised alike on every rank (the skip is agreed)
            diverged = f"step {step}: {e}"
            losses.append(float(loss.detach()))
            moves.append(math.inf)
            break
        after = torch.cat([p.detach().flatten() for p in params])
        moves.append(float((after - before).abs().max()))
        losses.append(float(loss.detach()))
    mean_losses = torch.tensor(losses + [math.nan] * (steps - len(losses)))
    if world > 1:
        dist.all_reduce(mean_losses)
        mean_losses /= world
    flat = torch.cat([p.detach().flatten() for p in params])
    checksum = zlib.crc32(flat.numpy().tobytes())
    sums = [None] * world
    if world > 1:
        dist.all_gather_object(sums, checksum)
    else:
        sums = [checksum]
    return {"family": family, "optimizer": optimizer, "steps": steps, "bound": bound, "losses": mean_losses.tolist(), "moves": moves,
            "stages": stages, "ranks_identical": len(set(sums)) == 1, "diverged": diverged,
            # how far the rows first met late moved, in all (their own norm: they start where the rest did)
            "late_rows_moved": (None if fam.late_rows is None else
                                float((params[0].detach()[fam.late_rows] - start[fam.late_rows]).norm())),
            "finite": bool(torch.isfinite(flat).all()) and all(math.isfinite(x) for x in mean_losses.tolist())}


def run_cases(rank: int, world: int, cases: List[dict]) -> List[dict]:
    """Several ``run_case`` calls in one start of the ranks (starting them is most of a test's time)."""
    return [run_case(rank, world, **case) for case in cases]


# Each 1-bit optimizer against its uncompressed counterpart on the same data
COUNTERPART = {"onebitlamb": "lamb", "onebitlamb-momentum": "lamb", "onebitadam": "adamw", "zerooneadam": "adamw"}


def largest_move_after_freeze(run: dict, counterpart: dict) -> float:
    """The largest one-step move of any element after the freeze (0/1 Adam: from its first 1-bit
    step), over the counterpart's largest one-step move over its whole run."""
    after = [m for m, stage in zip(run["moves"], run["stages"]) if stage != "warmup"]
    return max(after) / max(counterpart["moves"]) if after else math.nan


def main(argv: Optional[List[str]] = None) -> None:
    import argparse

    from benchmarks.report import command_line, heading, table_row, write_section
    from onebitlamb.comm.launch import spawn_local

    ap = argparse.ArgumentParser(description="Every optimizer on the zoo's models, with the bounded stage 2 "
                                             "and with the paper's (bound_direction=False), into BENCHMARKS.md")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    cases = [dict(family=f, optimizer=o, lr=args.lr, steps=args.steps, bound=b)
             for f in ZOO for b in (True, False) for o in OPTIMIZERS if b or o in COUNTERPART]
    out = spawn_local(run_cases, args.ranks, (cases,), timeout_s=3600, collective_timeout_s=300)[0]
    runs = {(r["family"], r["optimizer"], r["bound"]): r for r in out}
    lines = heading("Models we never tuned: the largest element step after the freeze",
                    command_line(argv), f", {args.ranks} gloo ranks")
    lines += [f"`benchmarks/zoo.py`'s models, {args.steps} steps at lr {args.lr}, `AutoFreeze`. Each 1-bit "
              f"optimizer's largest one-step move of any element after its freeze (0/1 Adam: from its first 1-bit "
              f"step) over its counterpart's largest move on the same data (LAMB for 1-bit LAMB, AdamW for 1-bit "
              f"and 0/1 Adam), with the default bound and with `bound_direction=False`; final training losses "
              f"(mean over the ranks' batches).", "",
              table_row(["model", "optimizer", "move / counterpart's, bounded", "with bound_direction=False",
                         "final loss, bounded", "with bound_direction=False", "counterpart's final loss"]),
              table_row(["---"] * 2 + ["---:"] * 5)]
    for family in ZOO:
        for opt, base in COUNTERPART.items():
            ref = runs[family, base, True]
            cells = [family, opt]
            for b in (True, False):
                cells.append(f"{largest_move_after_freeze(runs[family, opt, b], ref):.3g}x")
            cells += [f"{runs[family, opt, b]['losses'][-1]:.4g}" for b in (True, False)]
            lines.append(table_row(cells + [f"{ref['losses'][-1]:.4g}"]))
    write_section("zoo", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
