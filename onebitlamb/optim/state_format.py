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
  keeps one copy of an entry that has the same name on every rank (0/1 Adam's local momentum
  and update sum too, which differ between its syncs: ``"rank_local"``);
- where the state holds what this rank's parameters moved by since the ranks last agreed (0/1
  Adam between its syncs), a checksum of them, ``"parameters_crc32"`` under ``"rank<r>"``: the
  first step after a load checks that the rank has them back (``checks.check_resumed_parameters``);
  states without it load unchecked;
- with sharded parameters (FSDP2, HSDP) every entry differs between the ranks of a node, which
  hold different shards: the whole entry sits under ``"shard<s>of<S>"`` (this rank's shard ``s`` of
  ``S``), so that DCP keeps one copy per shard (the replicas' are alike but for the errors, which
  stay under ``"rank<r>"`` inside it) and a load on another shard is refused by name;
- what others (a state-dict hook, a framework) put in ``optimizer.state`` beside that parameter
  shares its entry, named in ``"others_entries"``, so that a load gives it back to the parameter
  (as torch.optim does) rather than to the flat state.

State dicts of the earlier form (a ``"flat"`` entry) still load.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

import torch

from onebitlamb.optim.layout import buffer_sizes, plan_buckets

PER_RANK = ("worker_error", "server_error", "warmup_worker_error", "warmup_server_error")
# the quantised warm-up average's errors (``Exchange.new_warmup_error_buffers``): real from the first step
WARMUP_ERRORS = ("warmup_worker_error", "warmup_server_error")
# what the freeze creates (exp_avg_sq_fresh: 1-bit LAMB's only)
FROZEN = ("momentum_mask", "frozen_coeff", "prev_factor", "momentum_scale", "exp_avg_sq_fresh")
_RANK_KEY = re.compile(r"rank(\d+)")
_SHARD_KEY = re.compile(r"shard(\d+)of(\d+)")
# the names, in the saved entry, of what others put beside the parameter it is saved under
OTHERS = "others_entries"
# this rank's parameters when the state was taken (``parameters_checksum``), where the state records them
PARAMETERS = "parameters_crc32"


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


def per_rank_keys(flat: Dict[str, Any]) -> tuple:
    """The entries that differ between ranks: the compression errors, and those a state names in
    ``"rank_local"`` (0/1 Adam's local momentum and update sum, which differ between syncs)."""
    return PER_RANK + tuple(flat.get("rank_local", ()))


def to_saved(flat: Dict[str, Any], compresses: bool, fresh_variance: bool,
             rank_entries: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The flat state as the state dict holds it (its tensors are the live ones, as torch.optim's);
    ``rank_entries``: more of this rank's own (``PARAMETERS``)."""
    own = per_rank_keys(flat)
    saved = {k: v for k, v in flat.items() if k not in own and k not in ("rank", PARAMETERS)}
    errors = {k: flat[k] for k in own if k in flat}
    if compresses and flat["frozen_at"] is None:
        saved.update(_frozen_templates(flat, fresh_variance))
        if flat["world_size"] > 1:
            errors = {**_error_templates(flat), **{k: v for k, v in errors.items() if k in WARMUP_ERRORS}}
    saved[f"rank{flat['rank']}"] = {**errors, **(rank_entries or {})}
    return saved


def shard_wrapped(saved: Dict[str, Any], shard: int, shards: int) -> Dict[str, Any]:
    """A sharded optimizer's saved entry: its state under the name of its shard (the module's docstring)."""
    return {f"shard{shard}of{shards}": saved}


def _is_ours(entry: Any) -> bool:
    return isinstance(entry, dict) and ("layer_numels" in entry or any(
        isinstance(k, str) and _SHARD_KEY.fullmatch(k) for k in entry))


def beside(saved: Dict[str, Any], others: Dict[Any, Any]) -> Dict[str, Any]:
    """The saved entry with ``others`` (what others put in ``optimizer.state`` for the parameter it
    is saved under) beside it, their names kept so that ``from_saved`` can tell them apart; on a
    name both use, the optimizer's own entry wins."""
    names = [k for k in others if k not in saved and k != OTHERS]
    if not names:
        return saved
    return {**{k: others[k] for k in names}, **saved, OTHERS: names}


def others_of(saved: Dict[str, Any]) -> Dict[Any, Any]:
    """What others put beside the parameter the entry ``saved`` is saved under (``beside``)."""
    return {k: saved[k] for k in saved.get(OTHERS, ()) if k in saved}


def from_saved(saved: Dict[str, Any]) -> Dict[str, Any]:
    """The flat state from its saved form (without what others put beside it: ``others_of``)."""
    names = set(saved.get(OTHERS, ()))
    saved = {k: v for k, v in saved.items() if k != OTHERS and k not in names}
    shard = [k for k in saved if isinstance(k, str) and _SHARD_KEY.fullmatch(k)]
    if shard:
        if len(shard) != 1:
            raise ValueError(f"an optimizer state holds the state of exactly one shard, this one holds {shard}")
        flat = from_saved(saved[shard[0]])
        flat["shard"] = tuple(int(x) for x in _SHARD_KEY.fullmatch(shard[0]).groups())
        return flat
    ranks = [k for k in saved if isinstance(k, str) and _RANK_KEY.fullmatch(k)]
    if len(ranks) != 1:
        raise ValueError(f"an optimizer state holds the compression errors of exactly one rank, this one holds "
                         f"{ranks or 'none'}")
    flat = {k: v for k, v in saved.items() if k != ranks[0]}
    flat["rank"] = int(_RANK_KEY.fullmatch(ranks[0]).group(1))
    if flat["frozen_at"] is None and "rank_local" not in flat:  # the templates of a state saved before the freeze
        flat = {k: v for k, v in flat.items() if k not in FROZEN}
        flat.update({k: v for k, v in saved[ranks[0]].items() if k in WARMUP_ERRORS})
    else:  # 0/1 Adam (``rank_local``) holds its whole state, errors included, from the first step
        flat.update(saved[ranks[0]])
    if PARAMETERS in saved[ranks[0]]:
        flat[PARAMETERS] = saved[ranks[0]][PARAMETERS]
    return flat


def _saved_key(state: Dict[Any, Any]) -> Any:
    """The key of the one onebitlamb state entry (None before any state); the other parameters'
    entries are empty, or hold what others (a hook, a framework) put in ``optimizer.state``."""
    ours = [k for k, v in state.items() if _is_ours(v)]
    if len(ours) > 1:
        raise ValueError(f"a onebitlamb optimizer's state dict holds one optimizer state, this one {len(ours)} "
                         f"(under {ours})")
    if ours:
        return ours[0]
    foreign = [v for k, v in state.items() if isinstance(k, int) and isinstance(v, dict) and v]
    if foreign:
        raise ValueError(f"the state dict was saved by another optimizer (its parameters' states hold "
                         f"{sorted(map(str, foreign[0]))}), not by a onebitlamb optimizer")
    return None


def split_state(state_dict: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], Dict[Any, Any]]:
    """The flat state a state dict holds, in either form, as own copies (the caller's dict must not
    alias the live state; None before any state), and the other non-empty entries, which
    ``load_state_dict`` hands to torch.optim as they are (what others put beside the flat state's
    parameter among them, under that parameter's index)."""
    state = state_dict["state"]
    key = "flat" if "flat" in state else _saved_key(state)
    others = {k: v for k, v in state.items() if k != key and not (isinstance(v, dict) and not v)}
    if key is None:
        return None, others
    if key != "flat" and others_of(state[key]):
        others[key] = others_of(state[key])
    flat = state["flat"] if key == "flat" else from_saved(state[key])
    return {k: (v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v)
            for k, v in flat.items()}, others


def flat_of(state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The flat state a state dict holds (``split_state``)."""
    return split_state(state_dict)[0]
