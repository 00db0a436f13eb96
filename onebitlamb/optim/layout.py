"""One flat float32 buffer per moment: which slice each parameter owns, and the state built on it.

Every trainable parameter (param-group order, then order within the group; empty ones and those
with ``requires_grad=False`` left out) owns a slice of the flat buffers. That layout is what one
all-reduce averages in the warm-up and what one compressed all-reduce sends afterwards, and it
is identical on every rank, whichever ranks happen to have ``None`` gradients.

The whole optimizer state is the flat state (``optimizer.state["flat"]``), so ``state_dict()``
continues a run bit-identically, and it stays float32 whatever the parameters' dtype
(``torch.optim``'s usual per-parameter state would be cast to a bf16 parameter's dtype on load).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from onebitlamb.comm import padded_size, quantized_error_sizes
from onebitlamb.optim import functional as F
from onebitlamb.optim.sharding import Shards, local


@dataclass
class FlatLayout:
    params: List[torch.Tensor]
    groups: List[int]  # each parameter's param-group index
    numels: List[int]
    slices: List[slice]
    offsets: torch.Tensor  # the layers' bounds, int64 on the CPU (the compiled loop reads them)
    numel: int
    device: torch.device
    # sharded parameters (FSDP2, ``sharding.py``): the slices hold this rank's shards, ``numels``
    # their sizes, ``whole_numels`` the whole layers'; per-layer statistics reduce over ``shards``
    shards: Optional[Shards] = None
    whole_numels: Optional[List[int]] = None

    @classmethod
    def of(cls, param_groups: Sequence[Dict[str, Any]], shards: Optional[Shards] = None) -> "FlatLayout":
        params, groups = [], []
        for gi, g in enumerate(param_groups):
            for p in g["params"]:
                # a sharded parameter counts by its whole size: a rank whose shard of it is empty
                # still has the layer, so every rank of the shard group has the same layers
                if p.requires_grad and p.numel() > 0:
                    params.append(p)
                    groups.append(gi)
        numels = [local(p).numel() for p in params]
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        devices = {local(p).device for p in params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        return cls(params=params, groups=groups, numels=numels,
                   slices=[slice(offsets[i], offsets[i + 1]) for i in range(len(params))],
                   offsets=torch.tensor(offsets, dtype=torch.int64), numel=offsets[-1],
                   device=local(params[0]).device if params else torch.device("cpu"),
                   shards=shards, whole_numels=[p.numel() for p in params])

    @property
    def tensors(self) -> List[torch.Tensor]:
        """What the flat layout holds of each parameter: the parameter, or this rank's shard of it."""
        return [local(p) for p in self.params]

    @property
    def spans_shards(self) -> bool:
        """Whether per-layer statistics must be reduced over a shard group (more than one shard)."""
        return self.shards is not None and self.shards.size > 1

    def whole(self, norms: Sequence[torch.Tensor] = (), maxima: Sequence[torch.Tensor] = ()) -> List[torch.Tensor]:
        """Per-layer norms and maxima of this rank's shards as the whole layers' (``Shards.whole``:
        one small collective inside the node); as they are when the layers are whole here."""
        if not self.spans_shards:
            return [*norms, *maxima]
        return self.shards.whole(norms, maxima)

    def per_layer(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def ones(self) -> torch.Tensor:
        return self.per_layer([1.0] * len(self.params))

    def layer_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The layer each flat index lies in."""
        return torch.searchsorted(self.offsets.to(indices.device), indices, right=True) - 1

    def hyper(self, param_groups: Sequence[Dict[str, Any]], key: str) -> torch.Tensor:
        """A per-group hyper-parameter expanded to one value per layer."""
        return self.per_layer([float(param_groups[gi][key]) for gi in self.groups])

    def local_norms(self, flat: torch.Tensor) -> torch.Tensor:
        """Each layer's Euclidean norm of a flat buffer, over this rank's shard of it (``whole`` makes
        it the whole layer's)."""
        return F.norms([flat[s] for s in self.slices])

    def norms(self, flat: torch.Tensor) -> torch.Tensor:
        """Each (whole) layer's Euclidean norm of a flat buffer."""
        return self.whole([self.local_norms(flat)])[0]

    def trust_norms(self, update: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each (whole) layer's parameter norm and update norm, what LAMB's trust ratio divides:
        with sharded parameters both in one reduction over the shard group."""
        param_norms, update_norms = self.whole([F.norms(self.tensors), self.local_norms(update)])
        return param_norms, update_norms

    def params_in(self, start: int, end: int) -> List[Tuple[torch.Tensor, slice]]:
        """The parameters (with their slices) whose elements begin in ``start:end``: a bucket's,
        whose bounds are parameter bounds."""
        return [(p, s) for p, s in zip(self.params, self.slices) if start <= s.start < end]

    def gather_grads(self, out: torch.Tensor, owner: str, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """This rank's gradients in the flat layout, float32; ``None`` counts as zero. With
        ``start``/``end`` (a bucket's bounds): only the parameters in that range."""
        for p, s in self.params_in(start, self.numel if end is None else end):
            if p.grad is None:
                out[s].zero_()
            elif p.grad.is_sparse:
                raise ValueError(f"{owner} does not support sparse gradients (parameter of shape "
                                 f"{tuple(p.shape)}); use a dense embedding")
            else:
                out[s].copy_(local(p.grad).reshape(-1))
        return out

    def add_weight_decay_(self, update: torch.Tensor, param_groups: Sequence[Dict[str, Any]]) -> None:
        for p, s, gi in zip(self.tensors, self.slices, self.groups):
            wd = param_groups[gi]["weight_decay"]
            if wd != 0:
                update[s].add_(p.reshape(-1), alpha=wd)

    def decayed_update_norms(self, update: torch.Tensor, plain_norms: torch.Tensor,
                             param_groups: Sequence[Dict[str, Any]]) -> torch.Tensor:
        """The update's norms after weight decay, given those before: only the layers with weight
        decay changed (biases and LayerNorms usually have none). Of this rank's shards, as given."""
        decayed = [i for i, gi in enumerate(self.groups) if param_groups[gi]["weight_decay"] != 0]
        if not decayed:
            return plain_norms
        norms = plain_norms.clone()
        norms[decayed] = F.norms([update[self.slices[i]] for i in decayed]).to(norms.device)
        return norms

    def step_sizes(self, coeff: torch.Tensor, param_groups: Sequence[Dict[str, Any]]) -> List[float]:
        """Each layer's ``lr * coeff``, with its group's learning rate (in double precision)."""
        return [param_groups[gi]["lr"] * c for gi, c in zip(self.groups, coeff.tolist())]

    def apply_(self, update: torch.Tensor, step_sizes: Sequence[float]) -> None:
        """``x -= step_size * u`` per layer, each layer's step size ``lr * coeff`` (``step_sizes``,
        checked by ``StepContext.checked_step_sizes``)."""
        for p, s, step_size in zip(self.tensors, self.slices, step_sizes):
            u = update[s].view(p.shape)
            if p.dtype == torch.float32:
                p.add_(u, alpha=-step_size)
            else:  # low-precision parameter: update in float32, round once
                p.copy_(p.float().add_(u, alpha=-step_size))


    def assign_(self, values: torch.Tensor) -> None:
        """Every parameter set to its slice of the flat float32 ``values`` (rounded once to a
        low-precision parameter's dtype)."""
        for p, s in zip(self.tensors, self.slices):
            p.copy_(values[s].view(p.shape))

    def gather_params(self, out: torch.Tensor) -> torch.Tensor:
        """The parameters in the flat layout, as float32."""
        for p, s in zip(self.tensors, self.slices):
            out[s].copy_(p.detach().reshape(-1))
        return out


def new_flat_state(layout: FlatLayout, owner: str, world_size: int, rank: int, local_size: int = 1,
                   buckets: Optional[List[Tuple[int, int]]] = None) -> Dict[str, Any]:
    """The state every optimizer starts from: the moments and the trust ratio's running average."""
    f32 = dict(dtype=torch.float32, device=layout.device)
    d, layers = layout.numel, len(layout.params)
    return {
        "optimizer": owner,
        "step": 0,
        "skipped_steps": 0,
        "consecutive_skips": 0,
        "world_size": world_size,
        "rank": rank,
        "local_size": local_size,  # ranks per node of a hierarchical group: it sets the errors' sizes
        "layer_numels": list(layout.numels),
        "exp_avg": torch.zeros(d, **f32),
        "exp_avg_sq": torch.zeros(d, **f32),  # v; after the freeze, v_frozen (= v_hat then)
        "coeff_ema": torch.zeros(layers, **f32),
        "coeff_ema_count": torch.zeros(layers, **f32),
        "frozen_at": None,  # the step at whose end the freeze happened
        # the exchange's buckets (flat ranges, exchange order): the error buffers follow them
        "buckets": [list(r) for r in (buckets or [(0, d)])],
    }


def check_saved_by(flat: Dict[str, Any], owner: str) -> None:
    """A loaded state must be this optimizer class's (checked before its settings: another class's
    state is named as such, not by a setting the two classes happen to hold differently)."""
    saved_by = flat.get("optimizer", owner)  # states from before it was recorded: trusted
    if saved_by != owner:
        raise ValueError(f"the optimizer state was saved by {saved_by} and is loaded into {owner}")


def check_loaded_state(flat: Dict[str, Any], layout: FlatLayout, owner: str, world_size: int, rank: int,
                       local_size: int = 1, warmup_codec: Any = None) -> None:
    """A loaded state must be this optimizer's, fit the model and, where it holds this rank's
    compression errors, this rank and world size; its tensors move to the model's device."""
    check_saved_by(flat, owner)
    if list(flat["layer_numels"]) != list(layout.numels):
        raise ValueError(f"the optimizer state holds {len(flat['layer_numels'])} parameters of sizes "
                         f"{flat['layer_numels'][:8]}..., the model has {len(layout.numels)} of sizes "
                         f"{layout.numels[:8]}...: not the same model or param groups")
    per_rank = any(k in flat for k in ("worker_error", "server_error", "warmup_worker_error", "warmup_server_error"))
    if per_rank and flat["world_size"] != world_size:
        raise ValueError(f"the optimizer state was saved with world size {flat['world_size']} and is "
                         f"loaded with world size {world_size}; its compression errors are per rank: resume on "
                         f"{flat['world_size']} ranks, or re-shard the {flat['world_size']} ranks' state dicts "
                         f"with onebitlamb.reshard_state_dicts(state_dicts, {world_size}) and load each rank's")
    if per_rank and flat.get("local_size", 1) != local_size:
        raise ValueError(f"the optimizer state was saved with {flat.get('local_size', 1)} ranks per node and is "
                         f"loaded with {local_size}; its compression errors follow the nodes: resume with "
                         f"the same process_group, or re-shard the ranks' state dicts with "
                         f"onebitlamb.reshard_state_dicts(state_dicts, {world_size}, local_size={local_size})")
    if per_rank and flat.get("rank", rank) != rank:
        raise ValueError(f"the optimizer state holds rank {flat['rank']}'s compression errors and is loaded "
                         f"on rank {rank}: each rank must load the state it saved (rank {rank}'s)")
    flat["world_size"], flat["rank"], flat["local_size"] = world_size, rank, local_size  # the rest of the state is the same on every rank
    flat.setdefault("buckets", [[0, layout.numel]])  # saved before buckets existed: one
    check_bucket_ranges(flat["buckets"], layout.numel)
    if "worker_error" in flat or "server_error" in flat:
        _, worker, server = buffer_sizes(plan_buckets(flat["buckets"], world_size, local_size))
        sizes = (flat["worker_error"].numel(), flat["server_error"].numel())
        if sizes != (worker, server):
            raise ValueError(f"the optimizer state's compression errors have {sizes[0]} and {sizes[1]} elements, "
                             f"its buckets on {world_size} ranks need {worker} and {server}: a damaged state")
    if "warmup_worker_error" in flat or "warmup_server_error" in flat:
        plan = plan_warmup_errors(flat["layer_numels"], flat["buckets"], world_size, warmup_codec)
        server = plan[-1][1].stop if plan else 0
        sizes = (flat["warmup_worker_error"].numel(), flat["warmup_server_error"].numel())
        if sizes != (layout.numel, server):
            raise ValueError(f"the optimizer state's warm-up errors have {sizes[0]} and {sizes[1]} elements, its "
                             f"buckets on {world_size} ranks need {layout.numel} and {server}: a damaged state")
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and value.device != layout.device:
            flat[key] = value.to(layout.device)


class _FlatBuffer:
    """A float32 buffer of the flat layout's size, named by the attribute of ``Scratch`` it is."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, scratch: "Scratch", owner: Optional[type] = None) -> torch.Tensor:
        return self if scratch is None else scratch._flat(self.name)


class Scratch:
    """Float32 buffers of the flat layout's size, reused across steps, each named for what it holds
    (made at first use); caches derived from the state (``derived``: not part of it); and the
    state's copies before a step (``StagedOptimizer._held_state``)."""

    def __init__(self, device: torch.device, numel: int = 0) -> None:
        self.device = device
        self.numel = numel
        self._buffers: Dict[str, torch.Tensor] = {}
        self.derived: Dict[str, Any] = {}
        self.copies: Dict[str, torch.Tensor] = {}

    def _flat(self, name: str, numel: Optional[int] = None) -> torch.Tensor:
        numel = self.numel if numel is None else numel
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != numel:
            buf = torch.zeros(numel, dtype=torch.float32, device=self.device)
            self._buffers[name] = buf
        return buf

    # the buffers, each named for what it holds
    grad = _FlatBuffer("this rank's gradient in the flat layout; after the warm-up's exchange, the average")
    update = _FlatBuffer("the step's update u (Adam's direction plus weight decay) before its coefficient")
    momentum_prev = _FlatBuffer("stage 2: the synchronized momentum of the previous step")
    ratio = _FlatBuffer("stage 2: the frozen over the fresh denominator, element by element (the factor's)")
    averaged = _FlatBuffer("the 1-bit averages of the buckets, their scales undone")
    synced = _FlatBuffer("0/1 Adam: the parameters a sync sets")
    local_momentum = _FlatBuffer("0/1 Adam: this rank's momentum before a 1-bit step averages it")
    variance_denominator = _FlatBuffer("0/1 Adam: sqrt(v_hat) + eps of the variance as it stands")
    frozen_denominator = _FlatBuffer("sqrt(v_frozen) + eps")

    def error_backups(self, worker: int, server: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Copies of the compression errors taken before a bucket's exchange behind the backward."""
        return self._flat("worker_backup", worker), self._flat("server_backup", server)

    def copy_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (any dtype) in a buffer kept under ``name`` for the next copy."""
        buf = self.copies.get(name)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype or buf.device != tensor.device:
            buf = self.copies[name] = torch.empty_like(tensor)
        return buf.copy_(tensor)


# ---------------------------------------------------------------------- buckets
#
# The compressed exchange runs per bucket: a contiguous range of the flat layout with its own
# region of the communication buffer and of each error buffer. Without ``overlap_with_backward``
# there is one bucket, the whole layout, and the regions are the whole buffers (as before buckets
# existed). The ranges are part of the state from the freeze on, because the errors follow them.

@dataclass(frozen=True)
class Bucket:
    start: int  # the flat layout's elements start:end
    end: int
    comm: slice  # its padded region of the communication buffer (a multiple of 8n elements)
    worker: slice  # its regions of the worker and the server error
    server: slice

    @property
    def numel(self) -> int:
        return self.end - self.start


def bucket_ranges(numels: Sequence[int], cap_elements: Optional[int]) -> List[Tuple[int, int]]:
    """The flat layout cut at parameter bounds into ranges of at most ``cap_elements`` (a larger
    parameter is a range of its own), in the order a backward produces them: from the last
    parameter to the first. ``None``: one range, the whole layout."""
    total = sum(numels)
    if cap_elements is None or total == 0:
        return [(0, total)]
    ranges, end, size = [], total, 0
    for n in reversed(numels):
        if size and size + n > cap_elements:
            ranges.append((end - size, end))
            end, size = end - size, 0
        size += n
    ranges.append((end - size, end))
    return ranges


def plan_buckets(ranges: Sequence[Sequence[int]], world_size: int, local_size: int = 1) -> List[Bucket]:
    """Each range's regions of the communication and error buffers, one after another in the
    ranges' order; each bucket is padded to ``padded_size(numel, world_size)``, whose worker error
    is ``1/local_size`` of it on a hierarchical group and whose server error is ``1/world_size``."""
    buckets, comm, worker, server = [], 0, 0, 0
    for start, end in ranges:
        padded = padded_size(end - start, world_size)
        w, s = padded // local_size, padded // world_size
        buckets.append(Bucket(int(start), int(end), slice(comm, comm + padded), slice(worker, worker + w),
                              slice(server, server + s)))
        comm, worker, server = comm + padded, worker + w, server + s
    return buckets


def plan_warmup_errors(numels: Sequence[int], ranges: Sequence[Sequence[int]], world_size: int,
                       codec: Any) -> List[Tuple[Tuple[int, ...], slice]]:
    """For the quantised warm-up average (``codec`` a ``compression.blockwise.BlockwiseCodec``): per
    bucket range, the sizes of the parameters it holds (each starts a block of its own:
    ``comm.quantized``) and its region of the warm-up server error; the worker error is the flat
    layout's ``d`` elements, a bucket's its range."""
    if codec is None:
        raise ValueError("the optimizer state holds the errors of a quantised warm-up, and the optimizer has none: "
                         "a damaged state, or one saved with another warmup_dtype")
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    plan, at = [], 0
    for start, end in ranges:
        segments = tuple(n for o, n in zip(offsets, numels) if start <= o < end)
        _, server = quantized_error_sizes(end - start, world_size, segments, codec)
        plan.append((segments, slice(at, at + server)))
        at += server
    return plan


def buffer_sizes(buckets: Sequence[Bucket]) -> Tuple[int, int, int]:
    """The communication buffer's, the worker error's and the server error's numbers of elements."""
    if not buckets:
        return 0, 0, 0
    last = buckets[-1]
    return last.comm.stop, last.worker.stop, last.server.stop


def check_bucket_ranges(ranges: Any, numel: int) -> None:
    """The buckets of a state (perhaps from a damaged file) must tile the flat layout's ``numel``
    elements: ``[start, end]`` integer pairs that, sorted, run from 0 to ``numel`` without a gap."""
    try:
        pairs = sorted((int(a), int(b)) for a, b in ranges if int(a) == a and int(b) == b)
        whole = len(pairs) == len(ranges)
    except (TypeError, ValueError):
        pairs, whole = [], False
    position = 0
    for a, b in pairs:
        whole = whole and a == position and (b > a or numel == 0)
        position = b
    if not (whole and position == numel and pairs):
        raise ValueError(f"the optimizer state's buckets {str(ranges)[:200]} do not tile the model's {numel} "
                         f"elements: a damaged state")
