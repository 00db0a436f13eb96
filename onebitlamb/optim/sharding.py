"""Parameters sharded by FSDP2 across the ranks of a node, replicated across nodes (HSDP).

With HSDP a rank holds one shard of every layer; the ranks that hold the same shard in the other
replicas (one per node) form the optimizer's process group, over the slow link. The optimizer
then works on shards: its flat layout, state and exchange are those of this rank's shards, so
its state is ``1/S`` of the unsharded optimizer's, and what crosses the slow link is each shard's
average (the warm-up) or its 1-bit momentum (stage 2), exactly the all-reduce across replicas
that FSDP would otherwise run in full precision.

What the shards cannot decide alone is a whole layer's statistic: LAMB's trust ratio needs the
norm of the whole weight and of its whole update, 1-bit LAMB's factor the largest ratio over the
whole layer, the freeze each layer's norms. :class:`Shards` reduces those per-layer vectors over
the shard group (the ranks of one node): one all-gather of a few floats per layer, summed (or
maximised) in rank order, so every rank of the node gets the same bits. It also makes the ranks
of a node agree on whether a step is taken, since they no longer see the same averaged gradient.

FSDP2 gives two forms of HSDP. ``fully_shard(module, mesh=mesh)`` on a 2-D ``("replicate",
"shard")`` mesh all-reduces every shard's gradient across replicas itself, in full precision,
and its switch (``set_requires_all_reduce(False)``) keeps the gradients back for a later
accumulating backward instead of handing them to the optimizer; so the optimizers take the other
form, FSDP2's documented seam for a custom exchange across replicas: ``fully_shard(module,
mesh=mesh["shard"])`` (1-D FSDP inside the node) with the optimizer's ``process_group`` the
replicate group, ``mesh["replicate"].get_group()`` (``docs/integrations.md``, "Sharded models").
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from onebitlamb.comm import CommStats
from onebitlamb.comm.stats import all_gather_bytes, allreduce_bytes
from onebitlamb.docs import pointer

HSDP_FIX = ("shard each node's ranks with fully_shard(module, mesh=mesh['shard']) on mesh = init_device_mesh("
            "device, (nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard')), and build the optimizer "
            f"with process_group=mesh['replicate'].get_group() ({pointer('integrations', 'Sharded models')})")


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ``DTensor`` (what FSDP2's ``fully_shard`` makes of a parameter)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no FSDP2 either
        return False
    return isinstance(p, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not sharded): a view of the parameter's
    own storage, so an update written into it moves the parameter."""
    return t.detach().to_local() if is_sharded(t) else t


def _group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


class Shards:
    """The shard group of an optimizer's sharded parameters: the ranks of one replica (one node)
    that hold the other shards of the same layers. Built by :meth:`of` from the parameters, which
    carry their mesh; ``stats`` counts what the reductions send (inside the node)."""

    def __init__(self, group: dist.ProcessGroup, mesh_ranks: List[int]) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.mesh_ranks = mesh_ranks
        self.stats = CommStats()

    def __repr__(self) -> str:  # what the ranks agree on (``checks.agree_on_setup``)
        return f"Shards(size={self.size})"

    def __getstate__(self) -> Any:
        raise TypeError("an optimizer over sharded parameters holds their shard group and cannot be copied or "
                        "pickled; save it with optimizer.state_dict() (or torch.distributed.checkpoint)")

    @classmethod
    def of(cls, owner: str, params: Sequence[torch.Tensor]) -> Optional["Shards"]:
        """The shard group of ``params``, None when none is sharded; ValueError naming the fix for
        what the optimizers cannot take: a mix of sharded and whole parameters, parameters on several
        meshes, and FSDP2's native HSDP (a 2-D mesh), which all-reduces across replicas itself."""
        sharded = [p for p in params if is_sharded(p)]
        if not sharded:
            return None
        if len(sharded) != len(params):
            raise ValueError(f"{owner} got {len(sharded)} sharded (DTensor) and {len(params) - len(sharded)} whole "
                             f"parameters: shard every parameter it trains with fully_shard (on the root module "
                             f"too), or none")
        from torch.distributed.tensor import Shard
        mesh = sharded[0].device_mesh
        meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in sharded}  # by their ranks
        if len(meshes) > 1:
            raise ValueError(f"{owner} got parameters sharded over {len(meshes)} different meshes: its per-layer "
                             f"statistics reduce over one shard group; shard every module on the same mesh")
        for p in sharded:
            if p.device_mesh.ndim != 1 or not isinstance(p.placements[0], Shard):
                raise ValueError(f"{owner} got a parameter of shape {tuple(p.shape)} placed {p.placements} on a "
                                 f"{p.device_mesh.ndim}-D mesh: FSDP2's native HSDP (fully_shard on a 2-D mesh) "
                                 f"all-reduces every gradient across the replicas itself, in full precision, "
                                 f"before the optimizer sees it, and its switch set_requires_all_reduce(False) "
                                 f"keeps the gradients back instead of handing them over. For the 1-bit "
                                 f"exchange across replicas, {HSDP_FIX}")
        return cls(mesh.get_group(), mesh.mesh.flatten().tolist())

    def check_replicas(self, owner: str, process_group: Optional[dist.ProcessGroup]) -> None:
        """The optimizer's process group must hold one rank of each replica, this one's shard: it
        may share no rank but this one with the shard group. 1-D FSDP over every rank (the
        default group for both) has no replicas: nothing crosses a slow link that 1-bit could
        replace."""
        exchange_ranks = _group_ranks(process_group)
        shared = sorted(set(exchange_ranks) & set(self.mesh_ranks))
        if shared != [dist.get_rank()]:
            raise ValueError(f"{owner} got parameters sharded over ranks {self.mesh_ranks} and a process group of "
                             f"ranks {exchange_ranks}: the group it exchanges over must hold this rank's shard in "
                             f"the other replicas (ranks it shares with the shard group: {shared}). 1-D FSDP over "
                             f"every rank has no replicas; all its traffic across nodes is FSDP's own "
                             f"parameter all-gathers and gradient reduce-scatters, which a 1-bit exchange cannot "
                             f"replace ({pointer('integrations', 'Sharded models')}). For a 1-bit "
                             f"exchange across nodes use HSDP: {HSDP_FIX}")
        # the checks that must hold on every rank of the mesh run over the world (``_agree``): the
        # shard group times the replicas must be it (a group of just the mesh's ranks would have to
        # be made by every rank of the world)
        if dist.get_world_size(process_group) * self.size != dist.get_world_size():
            raise ValueError(f"{owner} got parameters sharded over {self.size} ranks and a process group of "
                             f"{dist.get_world_size(process_group)} replicas that together do not span the world's "
                             f"{dist.get_world_size()} ranks: the optimizers take HSDP on a mesh of every rank")

    # ------------------------------------------------------------------ whole layers
    def _gathered(self, vector: torch.Tensor) -> torch.Tensor:
        """Every shard rank's ``vector``, one row each in rank order (one all-gather)."""
        rows = [torch.empty_like(vector) for _ in range(self.size)]
        dist.all_gather(rows, vector.contiguous(), group=self.group)
        self.stats.record("all_gather", all_gather_bytes(vector.numel() * vector.element_size(), self.size))
        return torch.stack(rows)

    def whole(self, norms: Sequence[torch.Tensor] = (), maxima: Sequence[torch.Tensor] = ()) -> List[torch.Tensor]:
        """Per-layer vectors of this rank's shards made whole-layer vectors, in one all-gather: each of
        ``norms`` (Euclidean norms of the shards) becomes the norm of the whole layer, each of
        ``maxima`` the largest value over the layer (an empty shard's is the caller's neutral
        value). Summed in rank order, so every rank of the shard group gets the same bits."""
        parts = [n.float() ** 2 for n in norms] + [m.float() for m in maxima]
        if not parts:
            return []
        sizes = [p.numel() for p in parts]
        rows = self._gathered(torch.cat(parts))
        out, at = [], 0
        for i, size in enumerate(sizes):
            column = rows[:, at:at + size]
            out.append(column.sum(dim=0).sqrt() if i < len(norms) else column.max(dim=0).values)
            at += size
        return out

    def every_rank(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on every rank of the shard group (one 1-element all-reduce)."""
        value = torch.tensor([0.0 if flag else 1.0], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        self.stats.record("all_reduce", allreduce_bytes(value.numel() * value.element_size(), self.size))
        return not bool(value.item())
