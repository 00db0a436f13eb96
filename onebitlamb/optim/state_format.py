"""The optimizer's ``state_dict()``: torch.optim's shape, so that checkpoint tools treat it as any
optimizer's.

Inside, the whole state is one flat dict (``optimizer.state["flat"]``, ``layout.py``). In the
state dict it is the state of the first trainable parameter, in the form that
``torch.distributed.checkpoint`` (DCP) needs:

- every other trainable parameter has an empty entry (DCP wants one for each);
- it has the same entries at every stage: the buffers the freeze creates appear as zeros before
  it, so a new optimizer's state dict is a template into which DCP can load any later checkpoint
  (DCP loads only the entries, and the shapes, its template has);
- this rank's compression errors sit under ``"rank<r>"``: they differ between ranks, and DCP
  keeps one copy of an entry that has the same name on every rank.

State dicts of the earlier form (a ``"flat"`` entry) still load.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional

import torch

from onebitlamb.optim.layout import buffer_sizes, plan_buckets

PER_RANK = ("worker_error", "server_error")
# what the freeze creates (exp_avg_sq_fresh: 1-bit LAMB's only)
FROZEN = ("momentum_mask", "frozen_coeff", "prev_factor", "momentum_scale", "exp_avg_sq_fresh")
_RANK_KEY = re.compile(r"rank(\d+)")


def _frozen_templates(flat: Dict[str, Any], fresh_variance: bool) -> Dict[str, torch.Tensor]:
    """Zeros shaped like what ``_freeze`` creates, for a state that has not frozen yet."""
    d, layers = sum(flat["layer_numels"]), len(flat["layer_numels"])
    device = flat["exp_avg"].device
    f32 = dict(dtype=torch.float32, device=device)
    out = {"momentum_mask": torch.zeros(d, dtype=torch.bool, device=device),
           "frozen_coeff": torch.zeros(layers, **f32), "prev_factor": torch.zeros(layers, **f32),
           "momentum_scale": torch.zeros(layers, **f32)}
    if fresh_variance:
        out["exp_avg_sq_fresh"] = torch.zeros(d, **f32)
    return out


def _error_templates(flat: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Zeros shaped like the errors the freeze creates: a region per bucket (``layout.plan_buckets``)."""
    buckets = flat.get("buckets", [[0, sum(flat["layer_numels"])]])
    _, worker, server = buffer_sizes(plan_buckets(buckets, flat["world_size"], flat.get("local_size", 1)))
    f32 = dict(dtype=torch.float32, device=flat["exp_avg"].device)
    return {"worker_error": torch.zeros(worker, **f32), "server_error": torch.zeros(server, **f32)}


def to_saved(flat: Dict[str, Any], compresses: bool, fresh_variance: bool) -> Dict[str, Any]:
    """The flat state as the state dict holds it (its tensors are the live ones, as torch.optim's)."""
    saved = {k: v for k, v in flat.items() if k not in PER_RANK and k != "rank"}
    errors = {k: flat[k] for k in PER_RANK if k in flat}
    if compresses and flat["frozen_at"] is None:
        saved.update(_frozen_templates(flat, fresh_variance))
        if flat["world_size"] > 1:
            errors = _error_templates(flat)
    saved[f"rank{flat['rank']}"] = errors
    return saved


def from_saved(saved: Dict[str, Any]) -> Dict[str, Any]:
    """The flat state from its saved form."""
    ranks = [k for k in saved if isinstance(k, str) and _RANK_KEY.fullmatch(k)]
    if len(ranks) != 1:
        raise ValueError(f"an optimizer state holds the compression errors of exactly one rank, this one holds "
                         f"{ranks or 'none'}")
    flat = {k: v for k, v in saved.items() if k != ranks[0]}
    flat["rank"] = int(_RANK_KEY.fullmatch(ranks[0]).group(1))
    if flat["frozen_at"] is None:  # the templates of a state saved before the freeze
        flat = {k: v for k, v in flat.items() if k not in FROZEN}
    else:
        flat.update(saved[ranks[0]])
    return flat


def saved_entry(state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The one state entry of a onebitlamb optimizer's state dict (None before any state); the
    other parameters' entries are empty."""
    entries = [entry for entry in state_dict["state"].values() if entry]
    if len(entries) > 1:
        raise ValueError(f"a onebitlamb optimizer's state dict holds one state entry, this one "
                         f"{len(entries)}: it was saved by another optimizer")
    return entries[0] if entries else None


def flat_of(state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The flat state a state dict holds, in either form, as own copies (the caller's dict must
    not alias the live state)."""
    if "flat" in state_dict["state"]:
        flat = state_dict["state"]["flat"]
    else:
        entry = saved_entry(state_dict)
        if entry is None:
            return None
        flat = from_saved(entry)
    return {k: (v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v)
            for k, v in flat.items()}
