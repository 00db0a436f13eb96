"""Resuming on another number of ranks: the per-rank compression errors, re-sharded.

Everything in a 1-bit optimizer's state is the same on every rank except the compression errors:
each worker's error (``D`` elements, what its last compressions rounded away) and each server's
error (its ``D / n`` chunk of the averaged result's rounding). A run saved on ``n`` ranks continues
on ``m`` when

- every new worker starts from the *mean* of the old workers' errors: the all-reduce averages the
  workers' error-compensated buffers, so the correction it adds to the next average, the mean
  error, is exactly what it would have added on ``n`` ranks;
- the server errors, chunks of one vector in the averaged domain, are joined and cut into ``m``
  chunks again.

0/1 Adam's local momentum and update sum (``"rank_local"``), which differ between its syncs,
become their mean over the old ranks on every new rank: what the next sync averages. The
quantised warm-up average's errors (``warmup_dtype="int8"``, ...) are re-sharded by the same two
rules: the mean of the workers' errors on every new worker, the servers' chunks joined and cut again.

Both errors are cut to the model's ``d`` elements and padded with zeros to the new ``D``: the padding
never reaches a parameter. The same holds bucket by bucket (``overlap_with_backward``) and between
flat and hierarchical groups (``node_groups``), whose ranks hold other parts of the two vectors.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Sequence

import torch

from onebitlamb.compression.wire import warmup_format
from onebitlamb.optim.layout import Bucket, buffer_sizes, check_bucket_ranges, plan_buckets, plan_warmup_errors
from onebitlamb.optim.state_format import PARAMETERS, flat_of, shard_wrapped, to_saved


def reshard_state_dicts(state_dicts: Sequence[Dict[str, Any]], world_size: int,
                        local_size: int = 1) -> List[Dict[str, Any]]:
    """The ``state_dict()`` of each of ``n`` ranks (in rank order) as ``world_size`` state dicts, one
    per new rank (in rank order), for ``load_state_dict`` on a run with ``world_size`` ranks;
    ``local_size``: the new run's ranks per node when its optimizers take ``node_groups(local_size)``
    (1: a flat group). The saved run may have had either kind of group.

    States without compression errors (``Lamb``, or a 1-bit optimizer before its freeze) are the
    same on every rank and load on any world size as they are; this returns copies of rank 0's.

    Sharded parameters (HSDP): the ranks are the replicas of one shard (their ``process_group``),
    so pass the state dicts of one shard's replicas and get that shard's for ``world_size``
    replicas; the shard size itself cannot change.
    """
    if not state_dicts:
        raise ValueError("reshard_state_dicts needs the state dict of every rank of the saved run, got none")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size: {world_size!r} (must be an integer >= 1)")
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 or world_size % local_size:
        raise ValueError(f"Invalid local_size: {local_size!r} (must be an integer >= 1 dividing world_size "
                         f"{world_size})")
    flats = [flat_of(sd) for sd in state_dicts]
    if any(flat is None for flat in flats):
        return [copy.deepcopy(state_dicts[0]) for _ in range(world_size)]
    n = len(flats)
    for rank, flat in enumerate(flats):
        if flat.get("world_size", n) != n or flat.get("rank", rank) != rank:
            raise ValueError(f"state dict {rank} is rank {flat.get('rank')}'s of a run on {flat.get('world_size')} "
                             f"ranks: pass the {n} ranks' state dicts of one run, in rank order")
        for key in ("optimizer", "step", "frozen_at", "layer_numels", "local_size", "buckets", "shard"):
            if flat.get(key) != flats[0].get(key):
                raise ValueError(f"state dicts 0 and {rank} differ in {key} ({flats[0].get(key)!r}, "
                                 f"{flat.get(key)!r}): not the ranks of one checkpoint")
    d = sum(flats[0]["layer_numels"])
    ranges = flats[0].get("buckets", [[0, d]])
    check_bucket_ranges(ranges, d)
    per_rank = "worker_error" in flats[0]
    old_local = flats[0].get("local_size", 1)
    old, new = plan_buckets(ranges, n, old_local), plan_buckets(ranges, world_size, local_size)
    if per_rank:  # bucket by bucket, each with its own padding: the two vectors, in the averaged domain
        corrections = [_mean_worker_error(flats, b, old_local) for b in old]
        servers = [_server_vector(flats, b, old_local) for b in old]
    if "warmup_worker_error" in flats[0]:  # flat groups only: the worker error covers the d elements
        warmup_correction = torch.stack([f["warmup_worker_error"].double().cpu() for f in flats]).mean(dim=0)
        warmup_correction = warmup_correction.float().to(flats[0]["warmup_worker_error"].device)
        codec = warmup_format(state_dicts[0]["param_groups"][0]["warmup_dtype"])
        # each bucket's aligned layout, the ranks' chunks joined: its data lie where they lie on any n
        warmup_servers = [torch.cat([f["warmup_server_error"][region].cpu() for f in flats])
                          for _, region in plan_warmup_errors(flats[0]["layer_numels"], ranges, n, codec)]
        new_plan = plan_warmup_errors(flats[0]["layer_numels"], ranges, world_size, codec)
    out = []
    for rank in range(world_size):
        sd = copy.deepcopy({k: v for k, v in state_dicts[0].items() if k != "state"})
        # (rank 0's checksum of its parameters is no new rank's: a re-sharded state is not checked)
        flat = {k: v for k, v in flats[0].items() if k not in ("worker_error", "server_error", "warmup_worker_error",
                                                                "warmup_server_error", PARAMETERS, "shard")}
        flat = copy.deepcopy(flat)
        flat["world_size"], flat["rank"], flat["local_size"] = world_size, rank, local_size
        for key in flats[0].get("rank_local", ()):  # 0/1 Adam between syncs: what the next sync averages
            flat[key] = torch.stack([f[key].double() for f in flats]).mean(dim=0).to(flats[0][key].dtype)
        if per_rank and world_size > 1:
            _, worker_size, server_size = buffer_sizes(new)
            device = flats[0]["worker_error"].device
            worker = torch.zeros(worker_size, dtype=torch.float32, device=device)
            server = torch.zeros(server_size, dtype=torch.float32, device=device)
            for b, correction, vector in zip(new, corrections, servers):
                padded = b.comm.stop - b.comm.start
                whole, summed = torch.zeros(padded, device=device), torch.zeros(padded, device=device)
                whole[:b.numel], summed[:b.numel] = correction[:b.numel], vector[:b.numel]
                worker[b.worker] = _worker_part(whole, rank, local_size)
                server[b.server] = _server_part(summed, rank, world_size, local_size)
            flat["worker_error"], flat["server_error"] = worker, server
        if "warmup_worker_error" in flats[0] and world_size > 1:
            flat["warmup_worker_error"] = warmup_correction.clone()
            flat["warmup_server_error"] = _warmup_server_part(warmup_servers, new_plan, rank, world_size)
        # a state re-sharded here is loaded with load_state_dict, which needs no templates
        key = next(iter(state_dicts[0]["state"]))
        saved = flat if key == "flat" else to_saved(flat, compresses=False, fresh_variance=False)
        if flats[0].get("shard") is not None:  # one shard's state, under its name (``state_format``)
            saved = shard_wrapped(saved, *flats[0]["shard"])
        sd["state"] = {key: saved}
        out.append(sd)
    return out


# Where a rank's errors sit in a bucket's padded buffer of D elements. A flat group (L = 1): each
# worker's error covers all D, rank j's server error chunk j of D/n. A hierarchical one
# (``comm.hierarchy``): rank (node k, local rank r) compresses chunk r (D/L) of its node's average
# among the N ranks of local index r, its server error being their chunk k of it (D/n).

def _worker_part(vector: torch.Tensor, rank: int, L: int) -> torch.Tensor:
    chunk = vector.numel() // L
    r = rank % L
    return vector[r * chunk:(r + 1) * chunk]


def _server_part(vector: torch.Tensor, rank: int, n: int, L: int) -> torch.Tensor:
    chunk, k, r = vector.numel() // n, rank // L, rank % L
    start = r * (vector.numel() // L) + k * chunk
    return vector[start:start + chunk]


def _mean_worker_error(flats: List[Dict[str, Any]], b: Bucket, L: int) -> torch.Tensor:
    """The correction the next all-reduce adds to the average: the mean of the workers' errors over
    the ranks that compress each element together (all ranks; with nodes, one per node)."""
    padded = b.comm.stop - b.comm.start
    total = torch.zeros(padded, dtype=torch.float64)
    for rank, f in enumerate(flats):
        chunk = padded // L
        r = rank % L
        total[r * chunk:(r + 1) * chunk] += f["worker_error"][b.worker].double().cpu()
    return (total / (len(flats) // L)).float()


def _server_vector(flats: List[Dict[str, Any]], b: Bucket, L: int) -> torch.Tensor:
    """The servers' errors joined into one vector over the bucket's padded buffer."""
    padded = b.comm.stop - b.comm.start
    vector = torch.zeros(padded, dtype=torch.float32)
    for rank, f in enumerate(flats):
        _server_part(vector, rank, len(flats), L).copy_(f["server_error"][b.server].cpu())
    return vector


def _warmup_server_part(vectors: List[torch.Tensor], plan: List[Any], rank: int, world_size: int) -> torch.Tensor:
    """New rank ``rank``'s server error of the quantised warm-up: each bucket's joined vector (its
    aligned layout, whose data sit at the same places on any number of ranks; only the zero
    padding at its end differs) cut or padded to the new length, and this rank's chunk of it."""
    out = torch.zeros(plan[-1][1].stop if plan else 0, dtype=torch.float32)
    for vector, (_, region) in zip(vectors, plan):
        chunk = region.stop - region.start
        whole = torch.zeros(chunk * world_size, dtype=torch.float32)
        kept = min(whole.numel(), vector.numel())
        whole[:kept] = vector[:kept]
        out[region] = whole[rank * chunk:(rank + 1) * chunk]
    return out
