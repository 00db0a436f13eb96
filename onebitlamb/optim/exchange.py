"""How an optimizer's gradients and momenta cross the ranks: one object, chosen at construction.

The optimizers hold update rules; an :class:`Exchange` holds everything about communication (as
``PowerSGDState`` does for the PowerSGD hook): the process group (flat, or ``node_groups()``), the
wire dtype of the warm-up's average, the buckets and whether they go out behind the backward
(``overlap.py``), the link to a DDP model that averages the warm-up instead (``register_ddp``),
the byte counts, and its part of the state: the buckets' ranges and the compression errors,
which follow them.

Two settings change the numbers and are therefore hyper-parameters, in the optimizer's
``defaults`` and its saved ``param_groups``: ``warmup_dtype`` (bfloat16 rounds the averaged
gradient) and ``bucket_cap_mb`` (each bucket has its own compression scale). The others (the
overlap, the DDP link) change when bytes move, not which: a run is the same bit for bit with or
without them, so a state moves freely between them.
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from onebitlamb.comm import (CommStats, NodeGroups, average_, compressed_allreduce, duplicate_group,
                             quantized_average_, spanning_group,
                             world_size_of)
from onebitlamb.comm.groups import check_spans_world
from onebitlamb.compression.codec import Codec
from onebitlamb.compression.packing import fused_codec
from onebitlamb.compression.wire import warmup_format
from onebitlamb.optim.checks import (Waiting, agreed_finite, agreed_finite_and_born, any_rank, locally_finite,
                                    refuse_averaged_gradients)
from onebitlamb.optim.layout import (Bucket, FlatLayout, Scratch, bucket_ranges, buffer_sizes, plan_buckets,
                                     plan_warmup_errors)
from onebitlamb.optim.overlap import BackwardOverlap

ProcessGroupLike = Union[dist.ProcessGroup, NodeGroups, None]

# The three exchanges a step can run (its *stage*, named by the optimizer's phase): the gradients'
# full-precision average; the 1-bit all-reduce of what the phase sends; nothing but the agreed
# check that every rank's gradient is finite (0/1 Adam's local steps).
WARMUP, COMPRESSION, LOCAL = "warmup", "compression", "local"


def check_bucket_cap(bucket_cap_mb: Optional[float]) -> None:
    if bucket_cap_mb is None:
        return
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
        raise ValueError(f"Invalid bucket_cap_mb: {bucket_cap_mb!r} (must be None or a number of MiB > 0)")


_SAME_SIZE_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits_checksum(t: torch.Tensor) -> int:
    """The sum, wrapping, of a tensor's elements read as integers of their size: a change to any
    one element's bits changes it; changes that cancel exactly (values swapped between elements)
    do not. Summed in the integers' own width: as fast as a float sum (an int64 accumulator is
    30x slower on CPU), and a wrapping sum is exact, so the same on every call."""
    ints = _SAME_SIZE_INT[t.element_size()]
    return int(t.detach().view(ints).sum(dtype=ints))


def _grad_marks(layout: FlatLayout, bucket: Bucket) -> list:
    """Which gradient tensors the bucket's parameters hold, at which in-place version, with which
    bits: a later backward, clipping or ``p.grad = ...`` change the first two; a GradScaler's
    unscaling and edits through ``p.grad.data`` bump no version counter, and only the checksum
    of the bits sees them (one read of the gradient: docs/optimizers.md has its cost)."""
    return [None if p.grad is None else (id(p.grad), p.grad._version, _bits_checksum(p.grad))
            for p, _ in layout.params_in(bucket.start, bucket.end)]


class Exchange:
    """The communication of one optimizer (its ``exchange`` attribute).

    Built by the optimizer from its keyword-only options; read it, do not change it. Public:
    ``process_group``, ``wire`` (and its ``warmup_dtype``), ``bucket_cap_mb``, ``overlap_with_backward``, ``fused``,
    ``comm_stats`` (bytes and rounds so far), ``buckets`` (after the first step), ``ddp_link``
    and :meth:`no_sync`; :meth:`average_in_ddp_hook` is ``register_ddp``'s hook's.

    :meth:`run` does a step's exchange and returns what it averaged. The optimizer binds its state
    at its first step (:meth:`bind`) with one function, ``payload(bucket, out)``: what the bucket
    sends through the 1-bit all-reduce (its phase's: ``phases.py``), the one thing only the
    optimizer knows, which a bucket sent behind the backward needs before ``step()``. It is held
    weakly, so that an optimizer dropped by its user goes at once and the hooks on its
    parameters fall silent.
    """

    def __init__(self, owner: str, process_group: ProcessGroupLike, *, warmup_dtype: Union[str, torch.dtype, Codec],
                 bucket_cap_mb: Optional[float], overlap_with_backward: bool, agree_every: Optional[int],
                 fused: Optional[bool] = None, device: Optional[torch.device] = None) -> None:
        if not isinstance(overlap_with_backward, bool):
            raise ValueError(f"Invalid overlap_with_backward: {overlap_with_backward!r} (must be True or False)")
        if agree_every is not None and (isinstance(agree_every, bool) or not isinstance(agree_every, int)
                                        or agree_every < 1):
            raise ValueError(f"Invalid agree_every: {agree_every!r} (must be None or a number of steps >= 1)")
        if fused not in (None, True, False):
            raise ValueError(f"Invalid fused: {fused!r} (must be None, True or False)")
        if fused and device is not None:  # where the kernels cannot run, say so now, not at the freeze
            fused_codec(torch.empty(0, device=device), fused)
        self.fused = fused
        self.agree_every = agree_every
        self.owner = owner
        self.process_group = process_group
        self.wire = warmup_format(warmup_dtype)
        if self.quantizes_warmup:
            self._check_quantized_warmup(process_group, overlap_with_backward)
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap_with_backward = overlap_with_backward
        self.comm_stats = CommStats()
        self.ddp_link: Any = None  # set by onebitlamb.register_ddp
        self.buckets: List[Bucket] = []
        self._init_runtime()

    def _init_runtime(self) -> None:
        """What binds this object to a running job: the hooks, the thread, its process group."""
        self._payload_ref = None
        self._waiting_ref = self._born_ref = None
        self._negate = False  # maximize: the gradients' sign flipped as they are gathered
        self._sent: Optional[torch.Tensor] = None  # the buckets' padded regions: sent, then their averages
        self._layout: Optional[FlatLayout] = None
        self._flat: Optional[Dict[str, Any]] = None
        self._scratch: Optional[Scratch] = None
        self._failures: Dict[int, FloatingPointError] = {}  # per bucket, from the exchange thread
        self._marks: Dict[int, list] = {}  # per bucket, which gradients it took (_grad_marks)
        self._overlap: Optional[BackwardOverlap] = None
        self._exchanged_behind_backward = False  # this step's errors changed in the backward (run)
        # register_ddp's quantised warm-up, averaged in DDP's hook before step() (average_in_ddp_hook):
        # whether it changed the warm-up errors since the last step, and a failure for step() to raise
        self._averaged_in_hook = False
        self._hook_failure: Optional[FloatingPointError] = None
        self._group = None
        if self.overlap_with_backward and self.world_size > 1:
            # the thread's own group (its collectives never interleave with the caller's) is made at
            # the first step, after the ranks agreed on the settings (bind): made here, a rank
            # built without the overlap would leave the others waiting in dist.new_group
            check_spans_world(self.process_group)
            self._overlap = BackwardOverlap(self._prepare_bucket, self._laid_out)

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> Dict[str, Any]:
        """A copy (``copy.deepcopy``, pickle) keeps the settings, the statistics and the buckets; like
        PowerSGD's state it drops the process group (a copy uses the default one), and with it the
        thread, the hooks and the DDP link: a copy exchanges in ``step()``, with the same buckets,
        so it steps as the original would."""
        keep = ("owner", "wire", "fused", "bucket_cap_mb", "agree_every", "comm_stats", "buckets")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        if "warmup_dtype" in state:  # pickled before the wire format was an object
            state["wire"] = warmup_format(state.pop("warmup_dtype"))
        state.setdefault("fused", None)
        self.__dict__.update(state)
        self.process_group, self.overlap_with_backward, self.ddp_link = None, False, None
        self._init_runtime()

    @property
    def warmup_dtype(self) -> Optional[torch.dtype]:
        """The dtype the warm-up's average travels in (``wire``, a float format such as
        ``compression.wire.BFLOAT16``); None for a quantised warm-up (a codec with error feedback,
        such as ``compression.blockwise.INT8``), whose codes are no floats the network could sum."""
        return None if self.quantizes_warmup else getattr(self.wire, "dtype", None)

    @property
    def warmup_codec(self) -> Optional[Codec]:
        """The quantised warm-up's codec, else None."""
        return self.wire if self.quantizes_warmup else None

    @property
    def quantizes_warmup(self) -> bool:
        """Whether the warm-up's average is the quantised one (``warmup_dtype="int8"``, ...): its codec
        carries an error, so the state holds the errors from the first step (``new_warmup_error_buffers``)
        and the average is ``comm.quantized_average_``, not one all-reduce."""
        return self.wire.carries_error

    def _check_quantized_warmup(self, process_group: ProcessGroupLike, overlap_with_backward: bool) -> None:
        name = self.wire.name
        if isinstance(process_group, NodeGroups):
            raise ValueError(f"Invalid warmup_dtype: {name!r} with node_groups(): the quantised warm-up average runs "
                             f"over a flat process group only; use warmup_dtype='float32' or 'bfloat16' there")
        if overlap_with_backward:
            raise ValueError(f"Invalid warmup_dtype: {name!r} with overlap_with_backward=True: the quantised warm-up "
                             f"average first agrees that every rank's gradient is finite, which needs the whole "
                             f"gradient; use one or the other")

    # ------------------------------------------------------------------ topology
    @property
    def world_size(self) -> int:
        return world_size_of(self.process_group)

    @property
    def local_size(self) -> int:
        """Ranks per node of a hierarchical group (``node_groups``), else 1: it sets the errors' sizes."""
        return getattr(self.process_group, "local_size", 1)

    def bucket_ranges(self, layout: FlatLayout) -> List[List[int]]:
        """The flat ranges of the buckets this exchange cuts ``layout`` into (one without a cap)."""
        cap = None if self.bucket_cap_mb is None else max(1, int(self.bucket_cap_mb * 2 ** 20) // 4)
        return [list(r) for r in bucket_ranges(layout.numels, cap)]

    def new_warmup_error_buffers(self, flat: Dict[str, Any], device: torch.device) -> None:
        """Zero errors of the quantised warm-up average (``layout.plan_warmup_errors``): a worker
        error over the flat layout's ``d`` elements (a bucket's is its range) and a server error of
        a chunk of each bucket's aligned layout; nothing for the float formats or one process. They are another quantity than the 1-bit errors (the gradients' rounding, not the
        momentum's) and stay apart from them, in the state from the first step on."""
        if self.quantizes_warmup and self.world_size > 1:
            plan = plan_warmup_errors(flat["layer_numels"], flat["buckets"], self.world_size, self.wire)
            server = plan[-1][1].stop if plan else 0
            flat["warmup_worker_error"] = torch.zeros(sum(flat["layer_numels"]), dtype=torch.float32, device=device)
            flat["warmup_server_error"] = torch.zeros(server, dtype=torch.float32, device=device)

    def new_error_buffers(self, flat: Dict[str, Any], device: torch.device) -> None:
        """Zero worker and server errors, a region per bucket (``layout.plan_buckets``: a hierarchical
        group keeps a worker error for this rank's chunk only); one process compresses nothing."""
        if self.world_size > 1:
            _, worker, server = buffer_sizes(plan_buckets(flat["buckets"], self.world_size, self.local_size))
            flat["worker_error"] = torch.zeros(worker, dtype=torch.float32, device=device)
            flat["server_error"] = torch.zeros(server, dtype=torch.float32, device=device)

    def setup(self) -> Dict[str, Any]:
        """What every rank's exchange must have alike (``checks.agree_on_setup``): ranks that differ
        would enter different collectives and wait for each other until the timeout."""
        return {"overlap_with_backward": self._overlap is not None, "agree_every": self.agree_every,
                "exchange averaged by DDP (register_ddp)": self.ddp_link is not None,
                "ranks per node (process_group)": self.local_size}

    # ------------------------------------------------------------------ binding
    def bind(self, layout: FlatLayout, flat: Dict[str, Any], scratch: Scratch,
             payload: Callable[[Bucket, torch.Tensor], None], *, negate: bool = False,
             waiting: Optional[Callable[[], Optional[Waiting]]] = None,
             born: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], None]] = None) -> None:
        """At the optimizer's first step (and the first after a load): the buckets of the state, what
        they send (``payload``, a bound method, held weakly), whether the gradients are gathered
        negated (``maximize``), and the hooks that start the buckets behind the backward.
        ``waiting`` and ``born`` (bound methods, held weakly): while some elements send nothing yet,
        because no rank has met them since before the freeze, the mask of those that do (a
        ``checks.Waiting``, else None); and what makes the ones some rank's gradient now reaches
        send from this step on, given their indices and, where the phase asks, the ranks' mean
        squared gradient there (``checks.agreed_finite_and_born``)."""
        self._layout, self._flat, self._scratch = layout, flat, scratch
        self._payload_ref, self._negate = weakref.WeakMethod(payload), negate
        self._waiting_ref = None if waiting is None else weakref.WeakMethod(waiting)
        self._born_ref = None if born is None else weakref.WeakMethod(born)
        self.buckets = plan_buckets(flat["buckets"], self.world_size, self.local_size)
        self._sent = torch.zeros(buffer_sizes(self.buckets)[0], dtype=torch.float32, device=layout.device)
        if self._overlap is not None and self._group is None:  # collective: every rank agreed on the overlap
            self._group = duplicate_group(self.process_group)
        if self._overlap is not None:
            self._overlap.set_buckets([[p for p, _ in layout.params_in(b.start, b.end)] for b in self.buckets])

    def unbind(self) -> None:
        """Before a load replaces the state: wait for what a backward started, and forget the state."""
        if self._overlap is not None:
            self._overlap.abandon()
        self._layout = self._flat = None

    def _laid_out(self) -> bool:
        """Whether a step has laid out the state: hooks start buckets only then."""
        return self._layout is not None

    def attach_ddp(self, link: Any) -> None:
        """``register_ddp``'s link: DDP's hook averages the warm-up's gradients from now on. The one
        change an exchange takes after construction, because every framework wraps the model in
        DDP after the optimizer is built; it changes when bytes move, not the numbers."""
        if self._overlap is not None:
            raise ValueError(f"{self.owner} exchanges behind the backward itself (overlap_with_backward=True): use "
                             f"that or register_ddp, not both")
        if self.ddp_link is not None:
            raise ValueError(f"{self.owner} is already registered with a DDP model")
        self.ddp_link = link

    def average_in_ddp_hook(self, gradients: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``register_ddp``'s quantised warm-up, run by DDP's hook once DDP has handed it every bucket
        of the backward: ``gradients`` pairs each parameter with its gradient in DDP's buckets, which
        are gathered into the flat layout, averaged exactly as ``step()`` averages them without DDP
        (every rank's gradient agreed finite, then each bucket of the state through
        ``comm.quantized_average_`` with its region of the warm-up errors), and written back: the same
        numbers bit for bit, the same errors in the same state, the same bytes. DDP's buckets only
        say where the gradients are; they are cut otherwise than the state's and DDP re-cuts them
        after its first backward, so no error follows them. A gradient not finite on some rank leaves
        the errors as they were and hands NaN back on every rank: ``step()`` skips the step, as it does
        after DDP's float average of a NaN. Needs the state laid out
        (``StagedOptimizer.prepare_state``)."""
        if self.world_size == 1:  # the average of one gradient is itself
            return
        lay, grads, flat = self._layout, self._scratch.grad, self._flat
        views = {id(p): g for p, g in gradients}
        missing = [i for i, p in enumerate(lay.params) if id(p) not in views]
        if missing:  # register_ddp checked the parameters; one set to require a gradient since then
            raise ValueError(f"{len(missing)} of {self.owner}'s trainable parameters (index {missing[0]} in its "
                             f"order) are in none of DDP's buckets: DDP does not average them")
        for p, s in zip(lay.params, lay.slices):
            grads[s].copy_(views[id(p)].reshape(-1))
        if self._negate:
            grads.neg_()
        if not agreed_finite(grads, spanning_group(self.process_group), self.comm_stats, averaged=False):
            for _, g in gradients:
                g.fill_(float("nan"))
            return
        worker, server = flat["warmup_worker_error"], flat["warmup_server_error"]
        # kept until step(): a step refused after the average (a non-finite update) puts them back
        self._scratch.copy_of("warmup worker error before the hook", worker)
        self._scratch.copy_of("warmup server error before the hook", server)
        try:
            self._quantized_average(grads)
        except FloatingPointError as failure:  # on every rank alike; step() raises it, as it would its own
            self._restore_warmup_errors()
            self._hook_failure = failure
            return
        self._averaged_in_hook = True
        if self._negate:
            grads.neg_()
        for p, s in zip(lay.params, lay.slices):
            g = views[id(p)]
            g.copy_(grads[s].view(g.shape))

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context for the backwards of all micro-batches but the last of a gradient accumulation:
        with ``overlap_with_backward`` they start no exchange; otherwise it does nothing."""
        return self._overlap.no_sync() if self._overlap is not None else contextlib.nullcontext()

    @property
    def started_in_backward(self) -> int:
        """Buckets the last backward started (0 without overlap)."""
        return 0 if self._overlap is None else self._overlap.started

    # ------------------------------------------------------------------ the step's exchange
    def run(self, grads: torch.Tensor, stage: str, first: bool) -> Optional[List[torch.Tensor]]:
        """The step's exchange, after the backward, as ``stage`` names it (``phases.py``): this rank's
        gradients gathered into ``grads``, then ``"warmup"``: their average, in ``grads``;
        ``"compression"``: the 1-bit all-reduce of each bucket's payload, whose averages (still
        scaled as the payload scaled them) come back, one per bucket; ``"local"``: nothing but the
        check. Returns None when some rank's gradient was not finite (the step is then skipped on
        every rank), else the buckets' averages (empty when nothing compressed was exchanged, or
        with one process)."""
        # register_ddp's quantised warm-up changed this step's errors before step() was called
        self._exchanged_behind_backward, self._averaged_in_hook = self._averaged_in_hook, False
        compressing = stage != WARMUP
        if self._overlap is not None and not first:
            finite = self._finish_overlapped(grads, compressing)
        else:
            finite = self._serial(grads, compressing, first, stage == COMPRESSION)
        if not finite:
            return None
        exchanged = stage == COMPRESSION and self.world_size > 1
        return [self._sent[b.comm][:b.numel] for b in self.buckets] if exchanged else []

    def undo_backward_exchanges(self) -> None:
        """The errors as they were before this step's exchanges behind the backward (a step refused
        after them: ``StagedOptimizer._restore_state``); nothing when the step exchanged in
        ``step()``, whose errors the optimizer's own copy holds."""
        if self._exchanged_behind_backward:
            if self.ddp_link is not None:  # the quantised warm-up in DDP's hook (average_in_ddp_hook)
                self._restore_warmup_errors()
            else:
                for b in self.buckets:
                    self._restore_errors(b)
            self._exchanged_behind_backward = False

    def _gather(self, grads: torch.Tensor, bucket: Optional[Bucket] = None) -> None:
        """This rank's gradients (of ``bucket``, else all) into the flat buffer, as the update
        descends: negated under ``maximize``."""
        start, end = (0, self._layout.numel) if bucket is None else (bucket.start, bucket.end)
        self._layout.gather_grads(grads, self.owner, start, end)
        if self._negate:
            grads[start:end].neg_()

    def _payload(self, bucket: Bucket, payload: Optional[Callable[[Bucket, torch.Tensor], None]] = None) -> torch.Tensor:
        """The bucket's padded region of the send buffer, its padding zeroed (the previous exchange
        left values there) and its first ``numel`` elements filled by ``payload`` (by default the
        optimizer's)."""
        region = self._sent[bucket.comm]
        region[bucket.numel:].zero_()
        (payload or self._payload_ref())(bucket, region[:bucket.numel])
        return region

    def compress(self, payload: Callable[[Bucket, torch.Tensor], None]) -> List[torch.Tensor]:
        """Outside a step, the 1-bit all-reduce of what ``payload(bucket, out)`` puts in each bucket,
        with the buckets' errors, as a step's compression stage runs it; returns the buckets'
        averages (empty with one process). Collective: every rank calls it (0/1 Adam's
        ``synchronize``)."""
        if self.world_size == 1:
            return []
        for b in self.buckets:
            self._exchange_bucket(b, self._payload(b, payload), self.process_group)
        return [self._sent[b.comm][:b.numel] for b in self.buckets]

    def _serial(self, grads: torch.Tensor, compressing: bool, first: bool, exchange: bool = True) -> bool:
        self._gather(grads)
        spanning = spanning_group(self.process_group)
        if self.ddp_link is None:
            if first:
                refuse_averaged_gradients(self.owner, grads, self._layout.params, spanning)
            if not compressing and self.quantizes_warmup:
                # every rank's gradient finite first: a NaN must not reach the errors, which carry it on
                if not agreed_finite(grads, spanning, self.comm_stats, averaged=False):
                    return False
                self._quantized_average(grads)
                return True
            if not compressing:
                average_(grads, self.process_group, self.comm_stats, self.wire)
        elif not compressing and not self.ddp_link.averages_this_step():
            raise RuntimeError(f"{self.owner} is registered with a DDP model (register_ddp) but DDP averaged no "
                               f"gradient since the last step: the backward did not run through the registered "
                               f"DDP model, or its last micro-batch ran under no_sync()")
        elif self._hook_failure is not None:
            failure, self._hook_failure = self._hook_failure, None
            raise failure
        # in the warm-up the average shows any rank's NaN; in stage 2 one flag is agreed on first
        # (with the births of waiting elements: a local step's too, where its phase has them)
        if compressing:
            waiting = self._waiting()
            if waiting is None:  # nothing waits: the one flag, as before elements could be born
                finite = agreed_finite(grads, spanning, self.comm_stats, averaged=False)
            else:
                finite, _ = self._agree_births(grads, waiting, spanning)
        else:
            finite = agreed_finite(grads, spanning, self.comm_stats, averaged=not compressing)
        if finite and compressing and exchange and self.world_size > 1:
            for b in self.buckets:
                self._exchange_bucket(b, self._payload(b), self.process_group)
        return finite

    def _waiting(self) -> Optional[Waiting]:
        """While some elements wait for their first gradient, the mask of those that do not (the
        optimizer's ``waiting``); None when none waits."""
        return None if self._waiting_ref is None else self._waiting_ref()()

    def _agree_births(self, grads: torch.Tensor, waiting: Waiting,
                      spanning: Any) -> Tuple[bool, Optional[torch.Tensor]]:
        """Stage 2's agreed check with the births of waiting elements
        (``checks.agreed_finite_and_born``), the births applied before anything (more) is sent:
        whether every rank's gradient is finite, and the indices born at this step."""
        finite, born, squares = agreed_finite_and_born(grads, waiting.born, spanning, self.comm_stats,
                                                       waiting.mean_squares)
        if finite and born.numel():
            self._born_ref()(born, squares)
        return finite, born

    def _quantized_average(self, grads: torch.Tensor) -> None:
        """The warm-up's quantised average of each bucket's gradients, in place, with the bucket's
        regions of the warm-up errors (``comm.quantized_average_``)."""
        if self.world_size == 1:
            return
        worker, server = self._flat["warmup_worker_error"], self._flat["warmup_server_error"]
        plan = plan_warmup_errors(self._layout.numels, [(b.start, b.end) for b in self.buckets], self.world_size,
                                  self.wire)
        for b, (segments, region) in zip(self.buckets, plan):  # each parameter starts a block of its own
            quantized_average_(grads[b.start:b.end], worker[b.start:b.end], server[region], self.process_group,
                               self.comm_stats, self.wire, segments=segments)

    def _restore_warmup_errors(self) -> None:
        """The warm-up errors as ``average_in_ddp_hook`` found them."""
        flat, scratch = self._flat, self._scratch
        flat["warmup_worker_error"].copy_(scratch.copies["warmup worker error before the hook"])
        flat["warmup_server_error"].copy_(scratch.copies["warmup server error before the hook"])

    def _exchange_bucket(self, b: Bucket, momentum: torch.Tensor, group: ProcessGroupLike) -> None:
        """The compressed all-reduce of bucket ``b``'s momentum over ``group``, with the bucket's
        regions of the error buffers."""
        compressed_allreduce(momentum, self._flat["worker_error"][b.worker], self._flat["server_error"][b.server],
                             group, self.comm_stats, fused=self.fused)

    # ------------------------------------------------------------------ behind the backward
    def _prepare_bucket(self, k: int) -> Callable[[], None]:
        """On the hook's thread: bucket ``k``'s gradients copied into the flat buffer and, after the
        freeze, its momentum formed and its errors kept (to undo a stale or skipped exchange);
        returns the exchange the thread runs."""
        b, lay, flat, scratch = self.buckets[k], self._layout, self._flat, self._scratch
        grads = scratch.grad
        self._gather(grads, b)
        self._marks[k] = _grad_marks(lay, b)
        if "worker_error" in flat:  # after the freeze
            buf = self._payload(b)  # formed here, on the hook's thread; sent on the exchange thread
            worker, server = scratch.error_backups(flat["worker_error"].numel(), flat["server_error"].numel())
            worker[b.worker].copy_(flat["worker_error"][b.worker])
            server[b.server].copy_(flat["server_error"][b.server])
            failures = self._failures

            def exchange() -> None:
                try:
                    self._exchange_bucket(b, buf, self._group)
                except FloatingPointError as e:  # on every rank alike; step() skips or raises it
                    failures[k] = e
            return exchange
        def average() -> None:
            average_(grads[b.start:b.end], self._group, self.comm_stats, self.wire)
        return average

    def _restore_errors(self, b: Bucket) -> None:
        flat = self._flat
        worker, server = self._scratch.error_backups(flat["worker_error"].numel(), flat["server_error"].numel())
        flat["worker_error"][b.worker].copy_(worker[b.worker])
        flat["server_error"][b.server].copy_(server[b.server])

    def _finish_overlapped(self, grads: torch.Tensor, compressing: bool) -> bool:
        """Wait for the buckets' exchanges, redo the stale ones, and return whether the step may go
        on (every rank's gradient finite); one small all-reduce agrees on both."""
        lay = self._layout
        spanning = spanning_group(self.process_group)
        stale_here = self._overlap.finish()
        # a gradient changed in place or replaced after its bucket left (a later backward, clipping,
        # unscaling) makes the bucket stale too: its exchange used the gradient the backward left
        changed = [self._marks.get(k) != _grad_marks(lay, b) for k, b in enumerate(self.buckets)]
        stale_here = [s or c for s, c in zip(stale_here, changed)]
        for k, stale in enumerate(stale_here):  # take the final gradient whole
            if stale:
                self._gather(grads, self.buckets[k])
        bad_here = compressing and not locally_finite(grads)
        agreed = any_rank([bad_here, *stale_here], spanning, self.comm_stats, grads.device)
        bad, stale = agreed[0], [k for k, s in enumerate(agreed[1:]) if s]
        newborn: List[int] = []
        waiting = self._waiting() if compressing and not bad else None
        if waiting is not None:  # elements met for the first time went out masked: their buckets redone
            _, born = self._agree_births(grads, waiting, spanning)
            newborn = [k for k, b in enumerate(self.buckets) if k not in stale and
                       bool(((born >= b.start) & (born < b.end)).any())]
        if stale and not self._overlap.given_up:  # every rank alike: the stale list is agreed
            self._overlap.give_up()
            warnings.warn(f"{self.owner}: the gradients of {len(stale)} of {len(self.buckets)} bucket(s) changed "
                          f"after their exchange had started, so step() exchanged them again; to send nothing "
                          f"twice, overlap_with_backward now exchanges in step(), after the backward. The cause: a "
                          f"gradient accumulation (run the backwards before the last under `with optimizer.no_sync():`)"
                          f", or gradients changed between backward() and step() (clipping by the global norm, "
                          f"unscaling), which an exchange behind the backward cannot wait for", RuntimeWarning)
        if compressing:
            if bad:
                for b in self.buckets:
                    self._restore_errors(b)
                self._failures.clear()
                return False
            for k in stale + newborn:
                b = self.buckets[k]
                self._failures.pop(k, None)
                self._restore_errors(b)
                self._exchange_bucket(b, self._payload(b), self._group)
            self._exchanged_behind_backward = True  # every bucket's errors were kept before its exchange
            if self._failures:
                failure = next(iter(self._failures.values()))
                self._failures.clear()
                raise failure
            return True
        for k in stale:  # the warm-up: the average overwrote the gradients; gather them again
            self._prepare_bucket(k)()
        return agreed_finite(grads, spanning, self.comm_stats, averaged=True)
