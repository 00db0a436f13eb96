"""The compressed all-reduce for clusters with several ranks per node (docs/hierarchy.md).

The flat collective sends each rank's own ``D/8`` sign bytes across the network, so a node of
``L`` ranks puts ``L`` times the necessary bytes on its network card. Here, for ``N`` nodes of
``L`` ranks (``n = N L``), a call runs in three stages:

1. **inside the node**, an exact reduce-scatter of the ``D`` elements: local rank ``r`` ends with
   chunk ``r`` (``D/L`` elements) averaged over its node (summed in local-rank order, then
   divided by ``L``);
2. **across nodes**, the flat error-compensated 1-bit all-reduce of that chunk among the ``N``
   ranks of local index ``r`` (``group=inter``), with a worker error of ``D/L`` elements and a
   server error of ``D/(L N) = D/n``;
3. **inside the node**, an all-gather of the chunks: every rank holds the full result.

Every rank of local index ``r`` gets the same bits for chunk ``r`` from stage 2, and stage 3 only
copies them, so the result is bit-identical on every rank. A ``NodeGroups`` brings its own
collectives (its methods); ``onebitlamb.comm``'s functions take one as their ``group``. This module
builds on the flat one (``collectives``), which knows nothing of nodes. Never imports an optimizer.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from onebitlamb.comm import collectives as flat
from onebitlamb.comm.stats import GLOBAL_STATS, CommStats, all_gather_bytes, all_to_all_bytes

#: torchrun's variable for the number of ranks on this node (``node_groups``'s default).
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
_UNSET = -(2 ** 62)  # what a rank without a usable local size sends in the agreement all-gather

# The names under which the intra-node stages are recorded in ``CommStats.bytes_by_op``; the
# inter-node stage records the flat collective's own ("all_to_all", "all_gather", "all_reduce").
INTRA_REDUCE_SCATTER = "intra_reduce_scatter"
INTRA_ALL_GATHER = "intra_all_gather"
INTRA_OPS = (INTRA_REDUCE_SCATTER, INTRA_ALL_GATHER)


@dataclass(frozen=True, eq=False)
class NodeGroups:
    """This rank's two process groups in a cluster of ``nodes`` nodes of ``local_size`` ranks.

    Node ``k`` holds the ranks ``k L .. k L + L - 1`` (torchrun's layout). ``intra``: the ranks
    of this rank's node; ``inter``: the ranks with this rank's local index on every node (its
    rank in ``inter`` is its node). Made by ``node_groups()``; pass it as the ``group`` of
    ``compressed_allreduce`` or ``allreduce_mean_``.
    """

    intra: Any  # dist.ProcessGroup
    inter: Any  # dist.ProcessGroup
    local_size: int
    nodes: int
    rank: int  # in the world

    @property
    def world_size(self) -> int:
        return self.nodes * self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def spanning_group(self) -> None:
        """The one process group holding every rank: the world (None), which node groups tile."""
        return None

    def duplicate(self) -> "NodeGroups":
        """New groups with the same nodes, with the world group's timeout; collective (see
        ``collectives.duplicate_group``)."""
        return _split(self.local_size, self.nodes, self.rank, flat.world_timeout())

    def allreduce_mean_(self, buffer: torch.Tensor, stats: Optional[CommStats] = None) -> torch.Tensor:
        return allreduce_mean_(buffer, self, stats)

    def compressed_allreduce(self, buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                             stats: Optional[CommStats] = None, *, fused: Optional[bool] = None) -> torch.Tensor:
        return compressed_allreduce(buffer, worker_error, server_error, self, stats, fused=fused)

    def __repr__(self) -> str:
        return (f"NodeGroups(nodes={self.nodes}, local_size={self.local_size}, rank={self.rank}: "
                f"node {self.node}, local rank {self.local_rank})")


def node_groups(local_size: Optional[int] = None) -> NodeGroups:
    """Split the world into nodes of ``local_size`` consecutive ranks; collective.

    Every rank must call it (it creates every node's and every local index's group with
    ``dist.new_group``, which each rank must call for every group in the same order).
    ``local_size`` defaults to torchrun's ``LOCAL_WORLD_SIZE``. The ranks first compare their
    ``local_size`` in one all-gather of one integer each, so a bad value raises the same
    ``ValueError`` on every rank instead of leaving the others waiting: ``local_size`` unset,
    not an integer, below 1, not dividing the world size, or not the same on every rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("node_groups needs an initialised torch.distributed: call "
                         "dist.init_process_group first (with one process there is nothing to split)")
    world, rank = dist.get_world_size(), dist.get_rank()
    source = "local_size" if local_size is not None else f"${LOCAL_WORLD_SIZE_ENV}"
    raw: Any = local_size if local_size is not None else os.environ.get(LOCAL_WORLD_SIZE_ENV)
    value = _as_int(raw)
    device = (torch.device("cuda", torch.cuda.current_device()) if str(dist.get_backend()) == "nccl"
              else torch.device("cpu"))
    mine = torch.tensor([_UNSET if value is None else value], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    values = [int(r) for r in rows]
    if len(set(values)) > 1:
        each = ", ".join(f"rank {r}: {'unset' if v == _UNSET else v}" for r, v in enumerate(values))
        raise ValueError(f"node_groups: the ranks disagree on local_size ({source}): {each}. Every rank "
                         f"must pass the same number of ranks per node")
    if value is None:
        raise ValueError(f"node_groups: no local_size given and {LOCAL_WORLD_SIZE_ENV} is "
                         f"{'unset' if raw is None else f'not an integer ({raw!r})'}: pass "
                         f"local_size, or launch with torchrun, which sets it")
    if value < 1:
        raise ValueError(f"node_groups: local_size ({source}) must be >= 1, got {value}")
    if world % value != 0:
        raise ValueError(f"node_groups: local_size {value} ({source}) does not divide the world size "
                         f"{world}: the world must be whole nodes of local_size ranks each")
    return _split(value, world // value, rank)


def _split(L: int, N: int, rank: int, timeout=None) -> NodeGroups:
    intra = inter = None
    for k in range(N):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(k * L, (k + 1) * L)), timeout=timeout)
        if k == rank // L:
            intra = g
    for r in range(L):
        g = dist.new_group([k * L + r for k in range(N)], timeout=timeout)
        if r == rank % L:
            inter = g
    return NodeGroups(intra=intra, inter=inter, local_size=L, nodes=N, rank=rank)


def _as_int(raw: Any) -> Optional[int]:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            return None
    return None


def error_sizes(D: int, group: Union[None, Any, NodeGroups] = None) -> Tuple[int, int]:
    """``(worker, server)``: the numbers of elements of the two error buffers that
    ``compressed_allreduce`` keeps for a buffer of ``D`` elements over ``group``: ``(D, D/n)`` for
    a process group of ``n`` ranks, ``(D/L, D/n)`` for a ``NodeGroups`` of ``n = N L`` ranks."""
    n = group.world_size if isinstance(group, NodeGroups) else flat.world_size_of(group)
    if D != flat.padded_size(D, n):
        raise ValueError(f"D = {D} is not a multiple of {8 * n} ({n} ranks): use padded_size(d, {n}) = "
                         f"{flat.padded_size(D, n)}")
    L = group.local_size if isinstance(group, NodeGroups) else 1
    return D // L, D // n


class _Workspace:
    """Per buffer layout, the node stage's scratch: the reduce-scatter's receive rows and the
    all-gather's input (it may not alias its output)."""

    _cache: Dict[Tuple, Dict[str, torch.Tensor]] = {}

    @classmethod
    def get(cls, numel: int, L: int, dtype: torch.dtype, device: torch.device) -> Dict[str, torch.Tensor]:
        key = (numel, L, dtype, str(device), threading.get_ident())  # per thread, as the flat one's
        ws = cls._cache.get(key)
        if ws is None:
            if len(cls._cache) > 32:
                cls._cache.clear()
            kw = dict(dtype=dtype, device=device)
            ws = cls._cache[key] = {"rows": torch.empty(L, numel // L, **kw),
                                    "piece": torch.empty(numel // L, **kw)}
        return ws


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes: the node stages only move data, and gloo lacks some dtypes."""
    return t.reshape(-1).view(torch.uint8)


def _node_mean_(buffer: torch.Tensor, groups: NodeGroups, ws: Dict[str, torch.Tensor],
                stats: CommStats) -> torch.Tensor:
    """The reduce-scatter inside the node: returns this rank's chunk of ``buffer`` (a view),
    holding the node's average of that chunk. An all-to-all gives local rank ``r`` chunk ``r``
    of every local rank, summed here in local-rank order and divided by ``L``: the same bytes on
    the wire as a ring reduce-scatter, on any backend, in a fixed summation order."""
    L, r = groups.local_size, groups.local_rank
    rows = ws["rows"]
    c = rows.shape[1]
    dist.all_to_all_single(_bytes(rows), _bytes(buffer), group=groups.intra)
    stats.record(INTRA_REDUCE_SCATTER, all_to_all_bytes(buffer.numel() * buffer.element_size(), L))
    mine = buffer[r * c:(r + 1) * c]
    mine.copy_(rows[0])
    for i in range(1, L):
        mine.add_(rows[i])
    return mine.div_(L)


def _node_all_gather_(buffer: torch.Tensor, mine: torch.Tensor, groups: NodeGroups,
                      ws: Dict[str, torch.Tensor], stats: CommStats) -> None:
    """The all-gather inside the node: chunk ``r`` of ``buffer`` from local rank ``r``."""
    piece = ws["piece"]
    piece.copy_(mine)
    flat._all_gather_single(_bytes(buffer), _bytes(piece), group=groups.intra)
    stats.record(INTRA_ALL_GATHER, all_gather_bytes(piece.numel() * piece.element_size(), groups.local_size))


def _check(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
           groups: NodeGroups) -> None:
    n, L = groups.world_size, groups.local_size
    flat.check_tensors(buffer, worker_error, server_error)
    D = buffer.numel()
    if D != flat.padded_size(D, n):
        raise ValueError(f"buffer has {D} elements; with {n} ranks ({groups.nodes} nodes x {L}) it must be a "
                         f"multiple of {8 * n} (pad it to padded_size({D}, {n}) = {flat.padded_size(D, n)})")
    worker, server = D // L, D // n
    if worker_error.numel() != worker or server_error.numel() != server:
        raise ValueError(f"with {groups.nodes} nodes x {L} ranks and a buffer of {D}, worker_error must have "
                         f"D/L = {worker} elements and server_error D/n = {server} (error_sizes(D, groups)); "
                         f"got {worker_error.numel()} and {server_error.numel()}")


def compressed_allreduce(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         groups: NodeGroups, stats: Optional[CommStats] = None, *,
                         fused: Optional[bool] = None) -> torch.Tensor:
    """The hierarchical error-compensated 1-bit average of ``buffer``, written into ``buffer``
    (the module's docstring). ``buffer``: ``D = padded_size(d, n)`` elements; ``worker_error``:
    ``D/L``, ``server_error``: ``D/n`` (``error_sizes``), both this rank's, updated in place.

    With ``L == 1`` this is the flat collective on ``inter`` (the world, in rank order). With
    ``N == 1`` nothing crosses a node: the 1-bit stage is skipped, the result is the exact node
    average (up to float summation order), the errors stay zero, and, as the flat collective on
    one rank, non-finite values pass through. Otherwise a NaN or infinity in any rank's buffer
    raises ``FloatingPointError`` on every rank, after the node's all-gather (so no rank waits).
    """
    _check(buffer, worker_error, server_error, groups)
    L, N, D = groups.local_size, groups.nodes, buffer.numel()
    if L * N == 1 or D == 0:
        return buffer
    stats = stats or GLOBAL_STATS
    if L == 1:
        return flat.compressed_allreduce(buffer, worker_error, server_error, groups.inter, stats, fused=fused)
    ws = _Workspace.get(D, L, buffer.dtype, buffer.device)
    mine = _node_mean_(buffer, groups, ws, stats)
    failure: Optional[FloatingPointError] = None
    if N > 1:
        try:
            flat.compressed_allreduce(mine, worker_error, server_error, groups.inter, stats, fused=fused)
        except FloatingPointError as exc:  # every rank of this local index raised; tell the node
            failure = exc
            mine.fill_(float("nan"))
    _node_all_gather_(buffer, mine, groups, ws, stats)
    if N > 1:
        c = D // L
        heads = buffer[::c]  # a 1-bit chunk is one finite scale times signs: its first element says
        if failure is not None or not bool(torch.isfinite(heads).all()):
            bad = torch.nonzero(~torch.isfinite(heads)).flatten().tolist()
            detail = f" ({failure})" if failure is not None else ""
            raise FloatingPointError(f"compressed_allreduce (hierarchical, {N} nodes x {L}): the node "
                                     f"averages of the chunk(s) of local rank(s) {bad} gave non-finite scales "
                                     f"on some node: a rank's buffer holds NaN or infinite values{detail}")
    return buffer


def allreduce_mean_(buffer: torch.Tensor, groups: NodeGroups, stats: Optional[CommStats] = None) -> torch.Tensor:
    """The exact average of ``buffer`` (any shape and size) over all ``N L`` ranks, in place:
    reduce-scatter inside the node, an all-reduce of the chunk across nodes, all-gather inside
    the node. Equal to the flat average up to float summation order; the same on every rank. A
    size that is not a multiple of ``L`` (or a non-contiguous buffer) goes through a padded copy."""
    L, N = groups.local_size, groups.nodes
    numel = buffer.numel()
    if L * N == 1 or numel == 0:
        return buffer
    stats = stats or GLOBAL_STATS
    if L == 1:
        return flat.allreduce_mean_(buffer, groups.inter, stats)
    c = -(-numel // L)
    ws = _Workspace.get(c * L, L, buffer.dtype, buffer.device)
    direct = numel == c * L and buffer.is_contiguous()
    if direct:
        work = buffer.view(-1)
    else:
        work = ws.get("padded")
        if work is None:
            work = ws["padded"] = torch.zeros(c * L, dtype=buffer.dtype, device=buffer.device)
        work[:numel].copy_(buffer.reshape(-1))
        work[numel:].zero_()
    mine = _node_mean_(work, groups, ws, stats)
    flat.allreduce_mean_(mine, groups.inter, stats)  # nothing to do with one node
    _node_all_gather_(work, mine, groups, ws, stats)
    if not direct:
        buffer.copy_(work[:numel].view(buffer.shape))
    return buffer
