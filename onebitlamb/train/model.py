"""The model the pretraining example trains: a small BERT for masked-language modelling.

Built from a ``transformers.BertConfig`` with random weights (no hub download). The defaults are
the demo's size: 4096-token vocabulary, 64-token sequences, 2 layers of width 128.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    seq_len: int = 64
    hidden: int = 128
    layers: int = 2
    heads: int = 2
    intermediate: int = 512
    dropout: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def build_model(cfg: ModelConfig, seed: int):
    """A ``BertForMaskedLM`` initialised from ``seed`` (same seed -> bit-identical weights)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        intermediate_size=cfg.intermediate,
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        max_position_embeddings=cfg.seq_len,
        type_vocab_size=1,
        pad_token_id=0,
    )
    # the eager kernel: identical numbers on every machine and no fused-kernel surprises on CPU
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return BertForMaskedLM(config)


def mlm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``masked_lm_loss``, through the model's own ``masked_lm_loss`` method where it has one: a
    model sharded with FSDP2 (``train/sharding.py``) has it registered as a forward method, so that
    FSDP gathers the parameters around it as around ``forward``."""
    method = getattr(model, "masked_lm_loss", None)
    if method is not None:
        return method(input_ids, labels, reduction=reduction)
    return masked_lm_loss(model, input_ids, labels, reduction)


def masked_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The masked-LM cross-entropy of ``BertForMaskedLM``, with its prediction head applied only
    to the predicted (labelled) positions.

    The same number as ``model(input_ids=..., labels=...).loss`` (positions labelled -100 add
    nothing to it), about twice as fast on CPU for this model size: with 15% masking the
    vocabulary projection, the largest matrix product, shrinks 6-7x."""
    hidden = model.bert(input_ids=input_ids).last_hidden_state
    selected = labels != -100
    logits = model.cls(hidden[selected])
    if reduction == "mean" and logits.shape[0] == 0:  # nothing masked: no loss, but keep the graph
        return logits.sum() * 0.0
    return torch.nn.functional.cross_entropy(logits.float(), labels[selected], reduction=reduction)
