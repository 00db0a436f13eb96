"""What the optimizers refuse, and what the ranks must agree on, before anything moves.

Each check names what is wrong. The cheap ones run at every step (param groups are edited by
schedulers and by users between steps); the one that needs the other ranks runs once, at the first
step, as one small all-gather, so that ranks built differently fail there with a message instead
of pairing mismatched collectives, or drifting apart silently.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from onebitlamb.comm import CommStats, world_size_of
from onebitlamb.comm.stats import allreduce_bytes

# Hyper-parameters that may differ between param groups; the others are the optimizer's own.
PER_GROUP = ("lr", "weight_decay")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_finite_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number >= 0)")


def check_param_groups(owner: str, param_groups: Sequence[Dict[str, Any]], defaults: Dict[str, Any]) -> None:
    """Each group's ``lr`` and ``weight_decay`` finite and >= 0, every other hyper-parameter the
    optimizer's own (the update reads those from ``defaults``: an edit in a group, such as a
    scheduler cycling ``betas``, would otherwise be ignored), no parameter twice, supported dtypes."""
    seen = set()
    for index, group in enumerate(param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            if key in PER_GROUP:
                check_finite_nonneg(f"{key} in param group {index}", value)
            elif key in defaults and value != defaults[key]:
                raise ValueError(f"{key}={value!r} in param group {index}, the optimizer's is {defaults[key]!r}: "
                                 f"{owner} reads it once for all groups (only {', '.join(PER_GROUP)} may differ "
                                 f"between groups or change during training)")
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is given to {owner} twice (param group "
                                 f"{index}): it would move twice per step")
            seen.add(id(p))
            if _is_sharded(p):
                raise ValueError(f"{owner} got a sharded parameter ({type(p).__name__} of shape {tuple(p.shape)}, "
                                 f"as FSDP2's fully_shard makes): FSDP all-gathers the parameters twice a step and "
                                 f"reduce-scatters the gradients itself, so a 1-bit exchange could replace at most "
                                 f"a third of its traffic (BENCHMARKS.md, 'Sharded training'). Keep every "
                                 f"parameter whole on every rank and wrap the model in DistributedDataParallel "
                                 f"with onebitlamb.register_ddp")
            if p.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"{owner} supports float32, bfloat16 and float16 parameters, got {p.dtype} "
                                 f"(shape {tuple(p.shape)}); its state is float32")


def _is_sharded(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no FSDP2 either
        return False
    return isinstance(p, DTensor)


def trainable(param_groups: Sequence[Dict[str, Any]]) -> List[torch.Tensor]:
    """The parameters the flat layout holds, in its order."""
    return [p for g in param_groups for p in g["params"] if p.requires_grad and p.numel() > 0]


def check_layout_unchanged(owner: str, held: Sequence[torch.Tensor], param_groups: Sequence[Dict[str, Any]]) -> None:
    """The flat layout is fixed at the first step: every rank's buffers and the compression errors
    follow it. A parameter added, removed, resized or (un)frozen later is an error."""
    now = trainable(param_groups)
    if len(now) == len(held) and all(a is b and a.shape == b.shape for a, b in zip(now, held)):
        return
    raise ValueError(f"the trainable parameters changed after {owner}'s first step (now {len(now)} tensors, "
                     f"{sum(p.numel() for p in now)} elements; at the first step {len(held)}, "
                     f"{sum(p.numel() for p in held)}): parameters added with add_param_group, resized, or "
                     f"switched with requires_grad. Its flat state follows the first step's layout on every "
                     f"rank; build a new optimizer for the new set of parameters")


def _crc(value: Any) -> int:
    return zlib.crc32(repr(value).encode())


def parameter_checksum(p: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes: ranks that start from different parameters (per-rank seeds, a
    checkpoint loaded on one rank only) would train different models, silently."""
    return zlib.crc32(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy())


def agree_on_setup(setup: Dict[str, Any], group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """Every rank must have built the same optimizer: compare a fingerprint of ``setup`` (name:
    value) across the group with one all-gather of one int64 per entry; if any differs, gather the
    values themselves and raise on every rank, naming each entry that differs and each rank's value."""
    n = world_size_of(group)
    if n == 1:
        return
    names = sorted(setup)
    mine = torch.tensor([_crc(setup[k]) for k in names], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(rows, mine, group=group)
    differing = [k for i, k in enumerate(names) if len({int(r[i]) for r in rows}) > 1]
    if not differing:
        return
    values: List[Any] = [None] * n
    dist.all_gather_object(values, {k: setup[k] for k in differing}, group=group)
    details = "; ".join(f"{k}: " + ", ".join(f"rank {r} {_short(v[k])}" for r, v in enumerate(values))
                        for k in differing)
    hint = ("; under a ZeroRedundancyOptimizer, which gives each rank a share of the parameters: the "
            "optimizers need every parameter on every rank, use DistributedDataParallel with "
            "onebitlamb.register_ddp" if "parameter sizes" in differing else "")
    raise ValueError(f"the ranks built different optimizers: {details}. Every rank must pass the same "
                     f"parameters (in the same order and shapes, with the same values: seed every rank "
                     f"alike, or broadcast them from rank 0 before the first step), hyper-parameters and "
                     f"freeze_step{hint}")


def refuse_averaged_gradients(owner: str, grads: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """At the first step: gradients that are already the same on every rank were averaged before the
    optimizer saw them, almost always by DistributedDataParallel (wrapped by hand, or by the Trainer,
    accelerate or Lightning). The optimizer would average them again, and after the freeze DDP would
    go on sending full gradients beside the 1-bit momentum. One all-gather of one CRC-32."""
    n = world_size_of(group)
    if n == 1 or not bool(grads.any()):
        return
    mine = torch.tensor([parameter_checksum(grads)], dtype=torch.int64, device=grads.device)
    rows = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(rows, mine, group=group)
    if len({int(r) for r in rows}) == 1:
        raise ValueError(f"the gradients at {owner}'s first step are identical on all {n} ranks: they were "
                         f"averaged before the optimizer saw them, by DistributedDataParallel (yours, or the "
                         f"one the Trainer, accelerate or Lightning wraps the model in), and every step would "
                         f"send them twice. Call onebitlamb.register_ddp(ddp_model, optimizer) once before the "
                         f"first backward, or use the integration for your framework (docs/integrations.md). "
                         f"If instead every rank was given the same batch, give each rank its own share of "
                         f"the data")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def agreed_finite(values: torch.Tensor, group: Optional[dist.ProcessGroup], stats: CommStats,
                  averaged: bool) -> bool:
    """Whether ``values`` is finite on every rank (a sum that overflows float32 counts as not).
    ``averaged``: the values are already the same on every rank (an averaged gradient, where a
    NaN of any rank shows), so no communication is needed; otherwise one 1-element all-reduce."""
    finite = locally_finite(values)
    if averaged:
        return finite
    return not any_rank([not finite], group, stats, values.device)[0]


def locally_finite(values: torch.Tensor) -> bool:
    """Whether ``values`` is finite here (its sum: one pass, and an overflow counts as not)."""
    return bool(torch.isfinite(values.sum()))


def any_rank(flags: Sequence[bool], group: Optional[dist.ProcessGroup], stats: CommStats,
             device: torch.device) -> List[bool]:
    """Per flag, whether it is set on some rank: one all-reduce of ``len(flags)`` floats."""
    if world_size_of(group) == 1 or not flags:
        return list(flags)
    values = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    stats.record("all_reduce", allreduce_bytes(values.numel() * values.element_size(), world_size_of(group)))
    return [bool(v) for v in values.tolist()]
