"""The collectives for either kind of group a user may pass: a process group (or None, the
world), which the flat collectives of ``collectives.py`` serve, or a ``NodeGroups``
(``hierarchy.node_groups()``), which brings its own. The one place that tells them apart, above
both modules (``hierarchy`` builds on ``collectives``; neither imports this one).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from onebitlamb.comm import collectives as flat
from onebitlamb.comm import quantized
from onebitlamb.comm.hierarchy import NodeGroups
from onebitlamb.comm.stats import CommStats
from onebitlamb.compression.blockwise import INT8
from onebitlamb.compression.codec import Codec
from onebitlamb.compression.wire import FLOAT32

Group = Union[dist.ProcessGroup, NodeGroups, None]


def world_size_of(group: Group = None) -> int:
    """The group's number of ranks (``N * L`` for a ``NodeGroups``); 1 when torch.distributed is
    not initialised."""
    return group.world_size if isinstance(group, NodeGroups) else flat.world_size_of(group)


def rank_of(group: Group = None) -> int:
    """This rank's index in ``group`` (its world rank for a ``NodeGroups``); 0 when torch.distributed
    is not initialised."""
    return group.rank if isinstance(group, NodeGroups) else flat.rank_of(group)


def spanning_group(group: Group = None) -> Optional[dist.ProcessGroup]:
    """The one process group holding every rank of ``group``, for checks that gather a value from
    every rank: itself, or the world for a ``NodeGroups``."""
    return group.spanning_group if isinstance(group, NodeGroups) else group


def check_spans_world(group: Group = None) -> int:
    """The world size, if ``group`` spans the world (so that ``duplicate_group`` can copy it: every
    rank of the world makes the copy); else ValueError."""
    world = flat.world_size_of(None)
    if world_size_of(group) != world:
        raise ValueError(f"a process group of {world_size_of(group)} of the world's {world} ranks: a thread's "
                         f"own copy of it is made by every rank of the world, so it must span the world")
    return world


def duplicate_group(group: Group = None) -> Group:
    """A second group of the same kind over the same ranks, for a thread's own collectives;
    collective (``collectives.duplicate_group``)."""
    return group.duplicate() if isinstance(group, NodeGroups) else flat.duplicate_group(group)


def allreduce_mean_(buffer: torch.Tensor, group: Group = None, stats: Optional[CommStats] = None) -> torch.Tensor:
    """Average ``buffer`` over the group in place (``collectives.allreduce_mean_``; over node groups,
    exact inside each node and across nodes: ``hierarchy.allreduce_mean_``)."""
    if isinstance(group, NodeGroups):
        return group.allreduce_mean_(buffer, stats)
    return flat.allreduce_mean_(buffer, group, stats)


def average_(values: torch.Tensor, group: Group = None, stats: Optional[CommStats] = None,
             wire: Codec = FLOAT32, async_op: bool = False):
    """The warm-up's average, as every path takes it (the optimizer's exchange in ``step()`` and
    behind the backward, and DDP's comm hook under ``register_ddp``): ``values`` encoded by
    ``wire``, a codec without error feedback (the float formats), averaged over the group
    (``allreduce_mean_``: the network sums the wire tensor), decoded back into ``values``, which is
    returned (with ``async_op``, over a process group: a future of it). A codec with error
    feedback is refused: its codes do not add up on the wire (``quantized_average_``)."""
    if wire.carries_error:
        raise ValueError(f"average_ sums the wire tensor in one all-reduce: {wire.name!r} carries an error, "
                         f"its average is quantized_average_")
    sent = wire.to_wire_(values)
    if async_op:
        if isinstance(group, NodeGroups):
            raise ValueError("average_(async_op=True) runs over a process group, not node groups")
        return flat.allreduce_mean_(sent, group, stats, async_op=True).then(
            lambda fut: wire.from_wire(fut.value(), values.numel(), out=values))
    allreduce_mean_(sent, group, stats)
    return wire.from_wire(sent, values.numel(), out=values)


def compressed_allreduce(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         group: Group = None, stats: Optional[CommStats] = None, *,
                         fused: Optional[bool] = None) -> torch.Tensor:
    """The error-compensated 1-bit average of ``buffer`` over ``group``, written into ``buffer``:
    ``collectives.compressed_allreduce`` (its docstring has the arguments and the maths) over a
    process group; over a ``NodeGroups``, ``hierarchy.compressed_allreduce`` (node reduce-scatter,
    the flat 1-bit all-reduce across nodes, node all-gather), whose errors have
    ``error_sizes(D, group)`` elements."""
    if isinstance(group, NodeGroups):
        return group.compressed_allreduce(buffer, worker_error, server_error, stats, fused=fused)
    return flat.compressed_allreduce(buffer, worker_error, server_error, group, stats, fused=fused)


def quantized_average_(values: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                       group: Group = None, stats: Optional[CommStats] = None,
                       codec: Union[str, int, Codec] = INT8,
                       segments: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The error-compensated quantised average of ``values`` over a process group
    (``quantized.quantized_average_``: the arguments and the maths). Node groups have no
    hierarchical version of it yet: a ``NodeGroups`` is refused (TypeError)."""
    if isinstance(group, NodeGroups):
        raise TypeError("quantized_average_ runs over a process group; it has no hierarchical version for node "
                        "groups yet (pass their spanning group, the world, for the flat one)")
    return quantized.quantized_average_(values, worker_error, server_error, group, stats, codec, segments)
