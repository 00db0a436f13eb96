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

Both are cut to the model's ``d`` elements and padded with zeros to the new ``D``: the padding
never reaches a parameter.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Sequence

import torch

from onebitlamb.optim.layout import buffer_sizes, check_bucket_ranges, plan_buckets
from onebitlamb.optim.state_format import flat_of, to_saved


def reshard_state_dicts(state_dicts: Sequence[Dict[str, Any]], world_size: int) -> List[Dict[str, Any]]:
    """The ``state_dict()`` of each of ``n`` ranks (in rank order) as ``world_size`` state dicts, one
    per new rank (in rank order), for ``load_state_dict`` on a run with ``world_size`` ranks.

    States without compression errors (``Lamb``, or a 1-bit optimizer before its freeze) are the
    same on every rank and load on any world size as they are; this returns copies of rank 0's.
    """
    if not state_dicts:
        raise ValueError("reshard_state_dicts needs the state dict of every rank of the saved run, got none")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size: {world_size!r} (must be an integer >= 1)")
    flats = [flat_of(sd) for sd in state_dicts]
    if any(flat is None for flat in flats):
        return [copy.deepcopy(state_dicts[0]) for _ in range(world_size)]
    n = len(flats)
    if any(flat.get("local_size", 1) != 1 for flat in flats):
        raise ValueError("reshard_state_dicts re-shards the states of a flat process group; these were saved with "
                         "a hierarchical one (node_groups): resume on the same nodes")
    for rank, flat in enumerate(flats):
        if flat.get("world_size", n) != n or flat.get("rank", rank) != rank:
            raise ValueError(f"state dict {rank} is rank {flat.get('rank')}'s of a run on {flat.get('world_size')} "
                             f"ranks: pass the {n} ranks' state dicts of one run, in rank order")
        for key in ("optimizer", "step", "frozen_at", "layer_numels"):
            if flat.get(key) != flats[0].get(key):
                raise ValueError(f"state dicts 0 and {rank} differ in {key} ({flats[0].get(key)!r}, "
                                 f"{flat.get(key)!r}): not the ranks of one checkpoint")
    d = sum(flats[0]["layer_numels"])
    ranges = flats[0].get("buckets", [[0, d]])
    check_bucket_ranges(ranges, d)
    per_rank = "worker_error" in flats[0]
    old, new = plan_buckets(ranges, n), plan_buckets(ranges, world_size)
    out = []
    for rank in range(world_size):
        sd = copy.deepcopy({k: v for k, v in state_dicts[0].items() if k != "state"})
        flat = {k: v for k, v in flats[0].items() if k not in ("worker_error", "server_error")}
        flat = copy.deepcopy(flat)
        flat["world_size"], flat["rank"] = world_size, rank
        if per_rank and world_size > 1:  # bucket by bucket, each with its own padding
            _, worker_size, server_size = buffer_sizes(new)
            device = flats[0]["worker_error"].device
            worker = torch.zeros(worker_size, dtype=torch.float32, device=device)
            server = torch.zeros(server_size, dtype=torch.float32, device=device)
            for was, now in zip(old, new):
                workers = torch.stack([f["worker_error"][was.worker][:was.numel].double() for f in flats])
                worker[now.worker][:now.numel] = workers.mean(dim=0).float()
                joined = torch.zeros(now.comm.stop - now.comm.start, dtype=torch.float32, device=device)
                joined[:was.numel] = torch.cat([f["server_error"][was.server] for f in flats])[:was.numel]
                server[now.server] = joined.view(world_size, -1)[rank]
            flat["worker_error"], flat["server_error"] = worker, server
        # every state holding errors has frozen: the saved form needs no templates
        key = next(iter(state_dicts[0]["state"]))
        sd["state"] = {key: flat if key == "flat" else to_saved(flat, compresses=False, fresh_variance=False)}
        out.append(sd)
    return out
