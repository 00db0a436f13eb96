"""What the optimizers refuse, and what the ranks must agree on, before anything moves.

Each check names what is wrong. The cheap ones run at every step (param groups are edited by
schedulers and by users between steps); the one that needs the other ranks runs once, at the first
step, as one small all-gather, so that ranks built differently fail there with a message instead
of pairing mismatched collectives, or drifting apart silently.
"""
from __future__ import annotations

import gc
import math
import zlib
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from onebitlamb.comm import CommStats, rank_of, world_size_of
from onebitlamb.comm.stats import all_gather_bytes, allreduce_bytes
from onebitlamb.docs import pointer

# Hyper-parameters that may differ between param groups; the others are the optimizer's own.
PER_GROUP = ("lr", "weight_decay")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_finite_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number >= 0)")


def check_param_groups(owner: str, param_groups: Sequence[Dict[str, Any]], defaults: Dict[str, Any]) -> None:
    """Each group's ``lr`` and ``weight_decay`` finite and >= 0, ``betas`` as ``_check_betas`` says,
    every other hyper-parameter the optimizer's own (the update reads those from ``defaults``: an
    edit in a group would otherwise be ignored), no parameter twice, supported dtypes."""
    seen = set()
    for index, group in enumerate(param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            if key in PER_GROUP:
                check_finite_nonneg(f"{key} in param group {index}", value)
            elif key == "betas" and "betas" in defaults:
                _check_betas(owner, index, value, param_groups[0]["betas"], defaults["betas"])
            elif key in defaults and value != defaults[key]:
                raise ValueError(f"{key}={value!r} in param group {index}, the optimizer's is {defaults[key]!r}: "
                                 f"{owner} reads it once for all groups (only {', '.join(PER_GROUP)} may differ "
                                 f"between groups or change during training)")
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is given to {owner} twice (param group "
                                 f"{index}): it would move twice per step")
            seen.add(id(p))
            if p.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"{owner} supports float32, bfloat16 and float16 parameters, got {p.dtype} "
                                 f"(shape {tuple(p.shape)}); its state is float32")


def _check_betas(owner: str, index: int, betas: Any, first: Any, defaults: Tuple[float, float]) -> None:
    """beta1 may change during training (a momentum schedule: OneCycleLR's ``cycle_momentum``), the
    same in every group, since one flat momentum holds every layer; beta2 may not (after the freeze
    it is frozen with the variance)."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas={betas!r} in param group {index}: must be a pair (beta1, beta2)")
    beta1, beta2 = betas
    if isinstance(beta1, bool) or not isinstance(beta1, (int, float)) or not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1={beta1!r} in param group {index} (betas={betas!r}): must be in [0, 1)")
    if beta2 != defaults[1]:
        raise ValueError(f"betas={tuple(betas)!r} in param group {index}, the optimizer's beta2 is {defaults[1]!r}: "
                         f"{owner} lets a scheduler move beta1 (OneCycleLR's cycle_momentum does) but not beta2, "
                         f"which the freeze keeps with the variance; set beta2 at construction")
    if beta1 != first[0]:
        raise ValueError(f"beta1={beta1!r} in param group {index}, {first[0]!r} in param group 0: {owner} keeps "
                         f"one momentum for all groups, so beta1 may change during training but must be the same "
                         f"in every group (for OneCycleLR: one max_momentum and one base_momentum)")


def trainable(param_groups: Sequence[Dict[str, Any]]) -> List[torch.Tensor]:
    """The parameters the flat layout holds, in its order."""
    return [p for g in param_groups for p in g["params"] if p.requires_grad and p.numel() > 0]


def check_layout_unchanged(owner: str, held: Sequence[torch.Tensor], param_groups: Sequence[Dict[str, Any]],
                           numels: Optional[Sequence[int]] = None) -> None:
    """The flat layout is fixed at the first step: every rank's buffers and the compression errors
    follow it. A parameter added, removed, resized (``numels``: the sizes at the first step; a
    resize through ``p.data`` keeps the same tensor object) or (un)frozen later is an error."""
    now = trainable(param_groups)
    if len(now) == len(held) and all(a is b for a, b in zip(now, held)):
        if numels is None or all(p.numel() == n for p, n in zip(now, numels)):
            return
        i, (p, n) = next((i, (p, n)) for i, (p, n) in enumerate(zip(now, numels)) if p.numel() != n)
        raise ValueError(f"parameter {i} (in the optimizer's order) of {owner} has {p.numel()} elements (shape "
                         f"{tuple(p.shape)}), {n} at the first step: resized, through .data or in place, after "
                         f"the first step. Its flat state follows the first step's sizes on every rank; nothing "
                         f"was changed. Build a new optimizer for the resized model")
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


def parameters_checksum(params: Sequence[torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes one after another: what a saved state records of the parameters
    it was taken with (``check_resumed_parameters``)."""
    value = 0
    for p in params:
        value = zlib.crc32(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy(), value)
    return value


def check_resumed_parameters(owner: str, saved: int, params: Sequence[torch.Tensor],
                             group: Optional[dist.ProcessGroup], device: torch.device, step: int) -> None:
    """At the first step after a load: this rank's parameters must be those it held when its state
    was saved (``saved``: their ``parameters_checksum``), where the state holds what they were
    moved by since they last agreed (0/1 Adam between its syncs: each rank's parameters are its
    own). The usual script saves the model from rank 0 only and loads it on every rank; the other
    ranks would then silently continue another run. One all-gather of a flag per rank, so that
    every rank raises, naming the ranks whose parameters differ, or none does."""
    n = world_size_of(group)
    mine = torch.tensor([int(parameters_checksum(params) != saved)], dtype=torch.int64, device=device)
    rows = [mine] if n == 1 else [torch.empty_like(mine) for _ in range(n)]
    if n > 1:
        dist.all_gather(rows, mine, group=group)
    differing = [r for r, row in enumerate(rows) if int(row[0])]
    if not differing:
        return
    which = ("every rank" if len(differing) == n else
             "rank " + ", ".join(map(str, differing)) if len(differing) == 1 else
             "ranks " + ", ".join(map(str, differing)))
    cause = ("the model was most likely saved from rank 0 only (or by a tool that keeps one copy of it, as "
             "DCP does) and loaded on every rank" if len(differing) < n else
             "the model loaded is not the one saved with this optimizer state")
    raise ValueError(f"{owner}: the parameters of {which} are not the ones held when the optimizer state was "
                     f"saved (after step {step}), and the state holds what each rank moved its own parameters by "
                     f"since the last sync; {cause}. Going on would silently continue another run (the next sync "
                     f"would also put back the state's parameters). Save each rank's own model beside its "
                     f"optimizer state and load each rank's own, or call opt.synchronize() on every rank before "
                     f"saving (or save where opt.parameters_synchronized is True, right after a sync), so that "
                     f"one copy of the model serves every rank ({pointer('optimizers', 'State and checkpoints')})")


def agree_on_setup(setup: Dict[str, Any], group: Optional[dist.ProcessGroup], device: torch.device,
                   after_step: Optional[int] = None) -> None:
    """Every rank must have built the same optimizer: compare a fingerprint of ``setup`` (name:
    value) across the group with one all-gather of one int64 per entry; if any differs, gather the
    values themselves and raise on every rank, naming each entry that differs and each rank's value.
    ``after_step``: the check is the periodic one (``agree_every``), after that many steps."""
    n = world_size_of(group)
    if n == 1:
        return
    names = sorted(setup)
    mine = torch.tensor([_crc(setup[k]) for k in names], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(n)]
    try:
        dist.all_gather(rows, mine, group=group)
    except RuntimeError as exc:  # (DistBackendError) a rank never came: the timeout, or its process gone
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        when = (f"the agreement after step {after_step} (agree_every)" if after_step is not None
                else "the first step's agreement on the optimizer's settings")
        raise RuntimeError(f"{setup.get('optimizer', 'the optimizer')}: rank {rank_of(group)} waited in {when}, and "
                           f"some rank never came ({said}): that rank stopped before it, most often because its "
                           f"optimizer's constructor refused an argument given on that rank only (its own error "
                           f"says which), or it died or hung") from exc
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
    if after_step is not None:
        raise ValueError(f"the ranks drifted apart by step {after_step} (agree_every): {details}. Something changed "
                         f"one rank's parameters or hyper-parameters after the first step (an lr set on one rank, "
                         f"a model edited or loaded on one rank only); change them alike on every rank, or resume "
                         f"from a checkpoint")
    raise ValueError(f"the ranks built different optimizers: {details}. Every rank must pass the same "
                     f"parameters (in the same order and shapes, with the same values: seed every rank "
                     f"alike, or broadcast them from rank 0 before the first step), hyper-parameters and "
                     f"freeze_step{hint}")


def refusals_of_every_rank(refusal: Optional[str], group: Optional[dist.ProcessGroup],
                           device: torch.device) -> Dict[int, str]:
    """Which ranks of ``group`` refused, with their reasons (``refusal``: this rank's, None if it did
    not refuse), the same on every rank: one all-gather of a flag per rank and, only where some
    rank refused, one of the reasons. Every rank must call it (``load_state_dict``'s verdict)."""
    n = world_size_of(group)
    if n == 1:
        return {} if refusal is None else {rank_of(group): refusal}
    mine = torch.tensor([int(refusal is not None)], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(rows, mine, group=group)
    if not any(int(row[0]) for row in rows):
        return {}
    reasons: List[Optional[str]] = [None] * n
    dist.all_gather_object(reasons, refusal, group=group)
    return {r: why for r, why in enumerate(reasons) if why is not None}


def refuse_averaged_gradients(owner: str, grads: torch.Tensor, params: Sequence[torch.Tensor],
                              group: Optional[dist.ProcessGroup]) -> None:
    """At the first step: gradients that are already the same on every rank, of parameters that a
    DistributedDataParallel model holds, were averaged by it before the optimizer saw them (DDP
    wrapped by hand, or by the Trainer, accelerate or Lightning, without ``register_ddp``). The
    optimizer would average them again, and after the freeze DDP would go on sending full
    gradients beside the 1-bit momentum. Identical gradients alone prove nothing: every rank may
    have been given the same batch. One all-gather of a CRC-32 and a flag; only when they are identical, a
    look for the DDP model and one all-reduce of what each rank found, so that every rank raises
    or none does."""
    n = world_size_of(group)
    if n == 1:
        return
    # every rank gathers, one without any gradient too (it says so): a check that some ranks skip
    # would pair their next collective with this one
    mine = torch.tensor([parameter_checksum(grads), int(bool(grads.any()))], dtype=torch.int64, device=grads.device)
    rows = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(rows, mine, group=group)
    if len({int(r[0]) for r in rows}) > 1 or not all(int(r[1]) for r in rows):
        return
    found = torch.tensor([1.0 if _held_by_ddp(params) else 0.0], device=grads.device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    if found.item():
        raise ValueError(f"the gradients at {owner}'s first step are identical on all {n} ranks and a "
                         f"DistributedDataParallel model holds the parameters: DDP (yours, or the one the Trainer, "
                         f"accelerate or Lightning wraps the model in) averaged them before the optimizer saw "
                         f"them, and every step would send them twice. Call onebitlamb.register_ddp(ddp_model, "
                         f"optimizer) once before the first backward, or use the integration for your framework "
                         f"({pointer('integrations')})")


def _held_by_ddp(params: Sequence[torch.Tensor]) -> bool:
    """Whether a live DistributedDataParallel model holds one of ``params``. DDP leaves no mark on
    the parameters or their gradients, so this looks through the objects the garbage collector
    tracks: once, and only when the gradients were identical on every rank."""
    from torch.nn.parallel import DistributedDataParallel
    held = {id(p) for p in params}
    # type(), not isinstance(): a proxy's __class__ could run code
    return any(issubclass(type(obj), DistributedDataParallel) and any(id(p) in held for p in obj.parameters())
               for obj in gc.get_objects())


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def agreed_finite(values: torch.Tensor, group: Optional[dist.ProcessGroup], stats: CommStats,
                  averaged: bool) -> bool:
    """Whether ``values`` and the sum of their squares are finite on every rank (``locally_finite``).
    ``averaged``: the values are already the same on every rank (an averaged gradient, where a
    NaN of any rank shows), so no communication is needed; otherwise one 1-element all-reduce."""
    finite = locally_finite(values)
    if averaged:
        return finite
    return not any_rank([not finite], group, stats, values.device)[0]


def locally_finite(values: torch.Tensor) -> bool:
    """Whether ``values`` and the sum of their squares are finite here, in one pass. The square,
    not the value: a gradient enters the second moment and the layers' norms squared, so one
    element of 1e30 (finite, and so is a plain sum) would put ``inf`` into ``exp_avg_sq``, or
    move the parameters by 1e28 after the freeze. Only a gradient whose norm exceeds ~1.8e19
    counts as not finite; a NaN or inf anywhere shows too."""
    flat = values.reshape(-1)
    return bool(torch.isfinite(torch.dot(flat, flat)))


def any_rank(flags: Sequence[bool], group: Optional[dist.ProcessGroup], stats: CommStats,
             device: torch.device) -> List[bool]:
    """Per flag, whether it is set on some rank: one all-reduce of ``len(flags)`` floats."""
    if world_size_of(group) == 1 or not flags:
        return list(flags)
    values = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    stats.record("all_reduce", allreduce_bytes(values.numel() * values.element_size(), world_size_of(group)))
    return [bool(v) for v in values.tolist()]


class Waiting(NamedTuple):
    """While some elements wait for their first gradient after the freeze: ``born``, the mask of
    those that do not (alike on every rank), and whether their births carry the ranks' mean
    squared gradient there (``agreed_finite_and_born``), for a phase that sets a born element's
    variance from it."""
    born: torch.Tensor
    mean_squares: bool = False


def agreed_finite_and_born(values: torch.Tensor, born: torch.Tensor, group: Optional[dist.ProcessGroup],
                           stats: CommStats, mean_squares: bool = False
                           ) -> Tuple[bool, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``agreed_finite`` for stage 2, and which elements not yet ``born`` (a mask alike on every
    rank: False where no rank's gradient has reached the element since before the freeze) some
    rank's gradient ``values`` reaches now. Returns whether every rank's gradient is finite and, if
    so, the flat indices of those elements in ascending order, the same on every rank; with
    ``mean_squares``, also the mean over the ranks of their gradient's square there (float32, the
    same bits on every rank: summed in rank order, in float64), else None.

    Why every rank alike: a born element's momentum is exchanged and applied from this step on,
    which must happen on every rank or none. The verdict and the largest count travel in the one
    small all-reduce the finiteness check makes anyway (two float64: counts stay exact); only a step
    where some rank meets a new element adds an all-gather of the indices (with their gradients
    where ``mean_squares``: one float64 pair each, exact for indices below 2^53), padded to that
    count, so over a run each element's index travels once per rank that meets it. Found here by
    one comparison over the gradient and the mask (``(g != 0) > born``): a gather at a list of the
    waiting indices reads 8 bytes of index and one scattered value per element, and is slower."""
    finite = locally_finite(values)
    here = torch.nonzero(torch.gt(values != 0, born)).flatten() if finite else None
    world = world_size_of(group)
    if world == 1:
        squares = values[here].double().square().float() if finite and mean_squares else None
        return finite, here, squares
    flags = torch.tensor([0.0 if finite else 1.0, float(here.numel()) if finite else 0.0], dtype=torch.float64,
                         device=values.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    stats.record("all_reduce", allreduce_bytes(flags.numel() * flags.element_size(), world))
    if flags[0] > 0:
        return False, None, None
    most = int(flags[1])
    if most == 0:
        return True, here, (values.new_zeros(0) if mean_squares else None)
    if not mean_squares:
        padded = torch.full((most,), -1, dtype=torch.int64, device=values.device)
        padded[:here.numel()] = here
    else:  # each index beside this rank's gradient there
        padded = torch.full((most, 2), -1.0, dtype=torch.float64, device=values.device)
        padded[:here.numel(), 0] = here.double()
        padded[:here.numel(), 1] = values[here].double()
    rows = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(rows, padded, group=group)
    stats.record("all_gather", all_gather_bytes(padded.numel() * padded.element_size(), world))
    if not mean_squares:
        union = torch.cat(rows)
        return True, torch.unique(union[union >= 0]), None
    indices = [row[row[:, 0] >= 0, 0].long() for row in rows]
    union = torch.unique(torch.cat(indices))
    total = torch.zeros(union.numel(), dtype=torch.float64, device=values.device)
    for row, idx in zip(rows, indices):  # rank order: the same sum on every rank
        total[torch.searchsorted(union, idx)] += row[:idx.numel(), 1].square()
    return True, union, (total / world).float()
