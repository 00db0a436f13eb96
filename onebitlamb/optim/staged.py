"""The machinery LAMB, 1-bit LAMB and 1-bit Adam share: one flat layout, two stages.

Stage 1 (the warm-up) is LAMB or Adam with the gradients averaged in full precision. At the end
of the step the freeze schedule names (``freeze.py``) the variance and the trust ratio are frozen,
and from then on each step sends only this rank's momentum through the error-compensated 1-bit
all-reduce (stage 2). ``docs/algorithm.md`` gives the maths step by step.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim import Optimizer

from onebitlamb.comm import (CommStats, allreduce_mean_, compressed_allreduce, duplicate_group, rank_of,
                             spanning_group, world_size_of)
from onebitlamb.optim import functional as F
from onebitlamb.optim.checks import (agree_on_setup, agreed_finite, any_rank, check_finite_nonneg,
                                     check_layout_unchanged, check_param_groups, locally_finite, parameter_checksum,
                                     refuse_averaged_gradients)
from onebitlamb.optim.freeze import AutomaticSchedule, FixedSchedule
from onebitlamb.optim.layout import (Bucket, FlatLayout, Scratch, bucket_ranges, buffer_sizes, check_loaded_state,
                                     new_flat_state, plan_buckets)
from onebitlamb.optim.overlap import BackwardOverlap
from onebitlamb.optim.state_format import split_state, to_saved

WARMUP, COMPRESSION = "warmup", "compression"

# The 1-bit optimizers' warm-up average sent in bfloat16 (2 bytes an element, as the paper's fp16
# baseline) when this names it: measured as good as float32 on the demo over 3 seeds, with 1.8x fewer
# bytes over the run (BENCHMARKS.md, "Warm-up average in bfloat16"). A variable, read at
# construction, because the constructors' parameter counts are capped (issue 37).
WARMUP_DTYPE_VARIABLE = "ONEBITLAMB_WARMUP_DTYPE"


def warmup_dtype_from_environment() -> Optional[torch.dtype]:
    """bfloat16 when ``ONEBITLAMB_WARMUP_DTYPE=bfloat16``; None (float32, exact) unset or ``float32``."""
    name = os.environ.get(WARMUP_DTYPE_VARIABLE, "")
    if name in ("", "float32"):
        return None
    if name != "bfloat16":
        raise ValueError(f"{WARMUP_DTYPE_VARIABLE}={name!r}: float32 or bfloat16")
    return torch.bfloat16


# A step whose gradient is not finite on some rank is skipped on every rank; this many in a row
# means the run has diverged rather than met a rare overflow.
MAX_CONSECUTIVE_SKIPS = 10


def validate_common(lr: float, betas, eps: float, weight_decay: float, maximize: bool) -> None:
    if not isinstance(maximize, bool):
        raise ValueError(f"Invalid maximize: {maximize!r} (must be True or False)")
    check_finite_nonneg("learning rate", lr)
    check_finite_nonneg("weight_decay", weight_decay)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas!r} (must be a pair (beta1, beta2))")
    for i, b in enumerate(betas):
        if not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta{i + 1}: {b!r} (must be in [0, 1))")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"Invalid eps: {eps!r} (must be > 0)")


@contextlib.contextmanager
def _torch_hooks_paused(optimizer: Optimizer, *names: str):
    """torch.optim's ``state_dict``/``load_state_dict`` without their hooks: the optimizers call the
    hooks themselves, around the conversion between torch.optim's form and the flat state, so
    that the hooks see what the caller sees."""
    saved = {name: getattr(optimizer, name) for name in names}
    try:
        for name in names:
            setattr(optimizer, name, OrderedDict())
        yield
    finally:
        for name, hooks in saved.items():
            setattr(optimizer, name, hooks)


def _spans_the_world(group: Any) -> bool:
    """Whether ``group`` is a plain process group of every rank, in the world's order: one a copy
    can replace with the default group."""
    return (isinstance(group, dist.ProcessGroup) and dist.is_initialized()
            and dist.get_world_size(group) == dist.get_world_size() and dist.get_rank(group) == dist.get_rank())


def _grad_marks(layout: FlatLayout, bucket: Bucket) -> list:
    """Which gradient tensors, at which in-place version, the bucket's parameters hold: any change
    (a later backward, clipping, ``p.grad = ...``) changes the marks, without a pass over the data."""
    return [None if p.grad is None else (id(p.grad), p.grad._version)
            for p, _ in layout.params_in(bucket.start, bucket.end)]


class StagedOptimizer(Optimizer):
    """Base of the three optimizers. Subclasses set the update rule with two switches:

    - ``_layerwise``: LAMB's trust ratio ``c`` (else ``c = 1``: Adam);
    - ``_fresh_variance``: 1-bit LAMB's factor from a variance kept fresh after the freeze;

    and pass a freeze schedule (``None``: warm-up forever, i.e. plain LAMB with full communication).
    """

    _layerwise = True
    _fresh_variance = True
    # GradScaler.step then calls step(grad_scaler=scaler) instead of skipping it on the ranks whose
    # own gradient overflowed: every rank enters the step's collectives, and the skip is agreed
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable, defaults: Dict[str, Any],
                 schedule: "FixedSchedule | AutomaticSchedule | None",
                 process_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(params, defaults)
        check_param_groups(type(self).__name__, self.param_groups, defaults)
        self._schedule = schedule
        self.process_group = process_group
        self.comm_stats = CommStats()
        self.last_step_bytes = 0
        self._bytes_after_last_step = 0
        # the wire dtype of the warm-up's average (None: float32); LAMB, the exact baseline, keeps float32
        self.warmup_dtype = warmup_dtype_from_environment() if schedule is not None else None
        # set by onebitlamb.register_ddp: DDP's comm hook averages the warm-up's gradients
        self.ddp_link = None
        self._layout: Optional[FlatLayout] = None
        self._scratch: Optional[Scratch] = None
        self._last_coeff: Optional[torch.Tensor] = None
        self.last_step_skipped = False
        # overlap_with_backward: the bucket size (elements), the hooks and thread, their group
        self._bucket_cap: Optional[int] = None
        self._overlap: Optional[BackwardOverlap] = None
        self._exchange_group = None
        self._buckets: List[Bucket] = []
        self._exchange_failures: Dict[int, FloatingPointError] = {}  # per bucket, from the thread
        self._warmup_wire: Dict[int, torch.Tensor] = {}  # per bucket, the bf16 copy being averaged
        self._grad_marks: Dict[int, list] = {}  # per bucket, which gradients it took (_grad_marks)
        # the state exists from the start, like the layout it follows, so that a state dict taken
        # before the first step is a complete template (DCP loads into one); rebuilt at the first
        # step if the parameters changed until then
        self._new_state(FlatLayout.of(self.param_groups))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "_layout", None) is not None:
            raise ValueError(f"add_param_group after {type(self).__name__}'s first step: its flat state follows "
                             f"the first step's parameters on every rank; build a new optimizer instead")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ state
    @property
    def _flat(self) -> Dict[str, Any]:
        return self.state["flat"]

    def _new_state(self, layout: FlatLayout) -> None:
        world, rank = world_size_of(self.process_group), rank_of(self.process_group)
        self.state["flat"] = new_flat_state(layout, type(self).__name__, world, rank, self._local_size(),
                                            bucket_ranges(layout.numels, self._bucket_cap))
        if self._schedule is not None:
            self._schedule.init_state(self._flat, len(layout.params), layout.device)

    def _untouched(self) -> bool:
        flat = self._flat
        return flat["step"] == 0 and flat.get("skipped_steps", 0) == 0 and flat["frozen_at"] is None

    def _prepare(self) -> None:
        """The layout is built at the first step (or the first after a load), when the param groups
        are final; a loaded state is checked against it."""
        layout = FlatLayout.of(self.param_groups)
        world, owner = world_size_of(self.process_group), type(self).__name__
        rank = rank_of(self.process_group)
        if self._untouched():
            self._new_state(layout)
        else:
            check_loaded_state(self._flat, layout, owner, world, rank, self._local_size())
            if self._schedule is not None:
                self._schedule.check_state(self._flat)
            wanted = [list(r) for r in bucket_ranges(layout.numels, self._bucket_cap)]
            if self._flat["frozen_at"] is None:
                self._flat["buckets"] = wanted  # the errors, made at the freeze, will follow them
            elif self._flat["buckets"] != wanted and self._overlap is not None:
                warnings.warn(f"{owner}: this run froze with {len(self._flat['buckets'])} bucket(s) and its "
                              f"compression errors follow them; they stay, bucket_cap_mb applies from a run's "
                              f"freeze on", RuntimeWarning)
            if self._flat["frozen_at"] is not None and "worker_error" not in self._flat:
                self._new_error_buffers(layout, world)  # frozen on one process, resumed on several
        agree_on_setup(self._setup(layout), spanning_group(self.process_group), layout.device)
        self._layout, self._scratch = layout, Scratch(layout.device)
        self._plan_buckets()

    def _plan_buckets(self) -> None:
        lay = self._layout
        self._buckets = plan_buckets(self._flat["buckets"], world_size_of(self.process_group), self._local_size())
        if self._overlap is not None:
            self._overlap.set_buckets([[p for p, _ in lay.params_in(b.start, b.end)] for b in self._buckets])

    def _setup(self, layout: FlatLayout) -> Dict[str, Any]:
        """What every rank must have alike (``checks.agree_on_setup``)."""
        return {"optimizer": type(self).__name__, "parameter sizes": layout.numels,
                "param groups (lr, weight_decay)": [(g["lr"], g["weight_decay"]) for g in self.param_groups],
                "parameters per group": [layout.groups.count(i) for i in range(len(self.param_groups))],
                "hyper-parameters": sorted((k, v) for k, v in self.defaults.items() if k not in ("lr", "weight_decay")),
                "freeze_step": repr(self._schedule),
                "warm-up average sent as": str(self.warmup_dtype or torch.float32),
                # the buckets follow from the parameter sizes and this cap, or after a freeze from the state
                "overlap_with_backward (bucket elements)": self._bucket_cap if self._overlap is not None else None,
                **({"buckets of the state": self._flat["buckets"]} if self._flat["frozen_at"] is not None else {}),
                "state (step, frozen_at)": (self._flat["step"], self._flat["frozen_at"]),
                "parameter values (crc32 of each tensor)": [parameter_checksum(p) for p in layout.params]}

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because some rank's gradient was not finite (``step()``)."""
        return self._flat.get("skipped_steps", 0)

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim``'s form: ``{"state": {i: ...}, "param_groups": [...]}``, the whole state
        under the index of the first trainable parameter and an empty entry for each other one
        (``state_format.py``): what ``torch.distributed.checkpoint`` and the frameworks expect.
        What a state-dict pre-hook adds to ``optimizer.state`` is kept, and the post-hooks see
        this form, as with any torch optimizer."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with _torch_hooks_paused(self, "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks"):
            state_dict = super().state_dict()
        packed = state_dict["state"]
        flat = packed.pop("flat")
        held = {id(p) for p in (self._layout.params if self._layout is not None
                                else FlatLayout.of(self.param_groups).params)}
        every = [p for g in self.param_groups for p in g["params"]]
        indices = [i for i, p in enumerate(every) if id(p) in held]
        if indices:
            ours = {i: {} for i in indices}
            ours[indices[0]] = to_saved(flat, self._schedule is not None,
                                        self._fresh_variance and self._schedule is not None)
            # entries someone else put in optimizer.state (a hook, a framework) stay beside ours
            state_dict["state"] = {**{i: {**packed.get(i, {}), **entry} for i, entry in ours.items()},
                                   **{k: v for k, v in packed.items() if k not in ours}}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a ``state_dict()``; the state is checked here, before anything changes: the
        optimizer class, the parameters' sizes and, where it holds compression errors (a 1-bit
        optimizer after its freeze), this rank and world size (``reshard_state_dicts`` changes
        the latter). Load-state-dict pre-hooks run before the check, post-hooks after the load."""
        state_dict = state_dict.copy()  # shallow, as torch.optim: a pre-hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        flat, others = split_state(state_dict)
        owner = type(self).__name__
        if flat is not None:
            check_loaded_state(flat, FlatLayout.of(self.param_groups), owner, world_size_of(self.process_group),
                               rank_of(self.process_group), self._local_size())
        if self._overlap is not None:
            self._overlap.abandon()  # what a backward started used the state being replaced
        # handed to torch.optim under "flat", which it keeps as it is: under a parameter's index it
        # would be cast to that parameter's dtype
        with _torch_hooks_paused(self, "_optimizer_load_state_dict_pre_hooks",
                                 "_optimizer_load_state_dict_post_hooks"):
            super().load_state_dict({**state_dict, "state": others if flat is None else {**others, "flat": flat}})
        if flat is None:
            self._new_state(FlatLayout.of(self.param_groups))
        self._layout = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> Dict[str, Any]:
        """What ``copy.deepcopy`` and pickle keep: the parameters, the state, the hyper-parameters
        and the statistics; not what binds this object to a running job. Like torch.optim's, a
        copy has no hooks. Like PowerSGD's state, a copy holds no process group and uses the
        default one (an optimizer on a group that is not the whole world cannot be copied). A copy
        has no ``register_ddp`` link and exchanges in ``step()`` (``overlap_with_backward``'s hooks
        stay with the original), with the same buckets, so it steps as the original would; its
        next step lays out its state again, as after ``load_state_dict`` (a collective, on every
        rank: the ranks agree on the setup and the state is checked against this rank)."""
        group = self.process_group
        if group is not None and not _spans_the_world(group):
            raise ValueError(f"{type(self).__name__} on a process group that is not the whole world cannot be "
                             f"copied (a copy uses the default group, as PowerSGD's state does): build a new "
                             f"optimizer on that group and load_state_dict(optimizer.state_dict()) into it")
        state = super().__getstate__()
        state.update({k: v for k, v in self.__dict__.items() if k not in state and not k.startswith("_optimizer_")})
        state.update(process_group=None, ddp_link=None, _overlap=None, _exchange_group=None, _layout=None,
                     _scratch=None, _buckets=[], _exchange_failures={}, _warmup_wire={}, _grad_marks={})
        return state

    @property
    def stage(self) -> str:
        """The stage the next step runs: ``"warmup"`` until the freeze (at the end of the step the
        freeze schedule chose), then ``"compression"``."""
        if self._schedule is None or "flat" not in self.state:
            return WARMUP
        return WARMUP if self._flat["frozen_at"] is None else COMPRESSION

    def layer_diagnostics(self) -> List[Dict[str, Optional[float]]]:
        """Per trainable parameter (flat order): the coefficient applied at the last step
        (``trust_ratio``; in stage 2, frozen coefficient x factor), and in stage 2 the frozen
        coefficient and 1-bit LAMB's factor."""
        if self._last_coeff is None:
            return []
        compressed = self.stage == COMPRESSION
        frozen = self._flat.get("frozen_coeff") if compressed else None
        factor = self._flat.get("prev_factor") if compressed and self._fresh_variance else None
        return [{"trust_ratio": float(self._last_coeff[i]),
                 "frozen_coeff": None if frozen is None else float(frozen[i]),
                 "factor": None if factor is None else float(factor[i])}
                for i in range(len(self._last_coeff))]

    # ------------------------------------------------------------------ overlap
    def overlap_with_backward(self, bucket_cap_mb: float = 1.0) -> None:
        """Exchange behind the backward: cut the parameters into buckets of at most
        ``bucket_cap_mb`` MiB of float32 gradient (last parameters first, a larger parameter a
        bucket of its own) and start each bucket's exchange, on a thread of this optimizer's, as
        soon as the backward has produced the bucket's gradients: the warm-up's average and, after
        the freeze, the compressed all-reduce of the momentum. ``step()`` waits for the last one.

        Collective: call it on every rank, before the first step. It needs a process group that
        spans the world (it makes a copy of it for its thread). Accumulating gradients over
        micro-batches: run every backward but the last under ``with optimizer.no_sync():``;
        without it the exchange is redone in ``step()`` (correct, slower, with a warning).

        Each bucket has its own compression scale, so with several buckets the numbers differ from
        one exchange of the whole buffer (with one they are the same, bit for bit); the buckets of
        the freeze stay for the run (the errors follow them) and are saved in the state. Not
        together with ``register_ddp``, where DDP's buckets already run behind the backward.
        ``docs/optimizers.md`` has the measurements.
        """
        owner = type(self).__name__
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
            raise ValueError(f"Invalid bucket_cap_mb: {bucket_cap_mb!r} (must be a number of MiB > 0)")
        if self.ddp_link is not None:
            raise ValueError(f"{owner} is registered with a DDP model (register_ddp), whose buckets already run "
                             f"behind the backward: use one or the other")
        if self._overlap is not None:
            raise ValueError(f"{owner}.overlap_with_backward was already called")
        if world_size_of(self.process_group) == 1:
            return  # nothing to exchange
        self._bucket_cap = max(1, int(bucket_cap_mb * 2 ** 20) // 4)
        self._exchange_group = duplicate_group(self.process_group)
        self._overlap = BackwardOverlap(self._prepare_bucket, self._laid_out)
        if self._untouched():  # a template state (DCP loads into it) has the buckets' error regions
            self._new_state(FlatLayout.of(self.param_groups))
        self._layout = None  # the next step lays the buckets out (and the ranks agree on them)

    def _laid_out(self) -> bool:
        """Whether a step has laid out the state: hooks start buckets only then."""
        return self._layout is not None

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context for the backwards of all micro-batches but the last of a gradient accumulation:
        with ``overlap_with_backward`` they start no exchange; otherwise it does nothing."""
        return self._overlap.no_sync() if self._overlap is not None else contextlib.nullcontext()

    def _prepare_bucket(self, k: int) -> Callable[[], None]:
        """On the hook's thread: bucket ``k``'s gradients copied into the flat buffer and, after the
        freeze, its momentum formed and its errors kept (to undo a stale or skipped exchange);
        returns the exchange the thread runs."""
        b, lay, flat = self._buckets[k], self._layout, self._flat
        grads = self._scratch.buffer("grad", lay.numel)
        self._gather(grads, b)
        self._grad_marks[k] = _grad_marks(lay, b)
        if self.stage == COMPRESSION:
            buf = self._bucket_momentum(b)  # formed here, on the hook's thread; sent on the exchange thread
            self._scratch.buffer("worker_backup", flat["worker_error"].numel())[b.worker].copy_(
                flat["worker_error"][b.worker])
            self._scratch.buffer("server_backup", flat["server_error"].numel())[b.server].copy_(
                flat["server_error"][b.server])
            failures = self._exchange_failures

            def exchange() -> None:
                try:
                    self._exchange_bucket(b, buf, self._exchange_group)
                except FloatingPointError as e:  # on every rank alike; step() skips or raises it
                    failures[k] = e
            return exchange
        wire = grads[b.start:b.end]
        if self.warmup_dtype is not None:
            wire = self._warmup_wire[k] = wire.to(self.warmup_dtype)

        def average() -> None:
            allreduce_mean_(wire, self._exchange_group, self.comm_stats)
        return average

    def _gather(self, grads: torch.Tensor, b: Optional[Bucket] = None) -> None:
        """This rank's gradients (of bucket ``b``, else all) into the flat buffer, as the update
        descends: negated under ``maximize``."""
        start, end = (0, self._layout.numel) if b is None else (b.start, b.end)
        self._layout.gather_grads(grads, type(self).__name__, start, end)
        if self.defaults["maximize"]:
            grads[start:end].neg_()

    def _bucket_momentum(self, b: Bucket) -> torch.Tensor:
        """This rank's new momentum of bucket ``b`` (from the local gradient), each layer scaled,
        in the bucket's padded region of the communication buffer."""
        beta1, _ = self._betas()
        scale, _ = self._compression_scales()
        buf = self._scratch.buffer("comm", buffer_sizes(self._buckets)[0])[b.comm]
        mine = buf[:b.numel]
        torch.mul(self._flat["exp_avg"][b.start:b.end], beta1, out=mine)
        mine.add_(self._scratch.buffers["grad"][b.start:b.end], alpha=1 - beta1)
        mine.mul_(scale[b.start:b.end])
        buf[b.numel:].zero_()  # the padding: the previous result left values there
        return buf

    def _exchange_bucket(self, b: Bucket, momentum: torch.Tensor, group) -> None:
        """The compressed all-reduce of bucket ``b``'s momentum (``_bucket_momentum``) over ``group``,
        with the bucket's regions of the error buffers."""
        compressed_allreduce(momentum, self._flat["worker_error"][b.worker], self._flat["server_error"][b.server],
                             group, self.comm_stats)

    def _restore_errors(self, b: Bucket) -> None:
        flat, scratch = self._flat, self._scratch.buffers
        flat["worker_error"][b.worker].copy_(scratch["worker_backup"][b.worker])
        flat["server_error"][b.server].copy_(scratch["server_backup"][b.server])

    def _finish_overlapped(self, grads: torch.Tensor, compressing: bool) -> bool:
        """Wait for the buckets' exchanges, redo the stale ones, and return whether the step may go
        on (every rank's gradient finite); one small all-reduce agrees on both."""
        lay, owner = self._layout, type(self).__name__
        stale_here = self._overlap.finish()
        # a gradient changed in place or replaced after its bucket left (a later backward, clipping,
        # unscaling) makes the bucket stale too: its exchange used the gradient the backward left
        changed = [self._grad_marks.get(k) != _grad_marks(lay, b) for k, b in enumerate(self._buckets)]
        stale_here = [s or c for s, c in zip(stale_here, changed)]
        for k, stale in enumerate(stale_here):  # take the final gradient whole
            if stale:
                self._gather(grads, self._buckets[k])
        bad_here = compressing and not locally_finite(grads)
        agreed = any_rank([bad_here, *stale_here], spanning_group(self.process_group), self.comm_stats, grads.device)
        bad, stale = agreed[0], [k for k, s in enumerate(agreed[1:]) if s]
        if stale and not self._overlap.given_up:  # every rank alike: the stale list is agreed
            self._overlap.give_up()
            warnings.warn(f"{owner}: the gradients of {len(stale)} of {len(self._buckets)} bucket(s) changed after "
                          f"their exchange had started, so step() exchanged them again; to send nothing twice, "
                          f"overlap_with_backward now exchanges in step(), after the backward. The cause: a gradient "
                          f"accumulation (run the backwards before the last under `with optimizer.no_sync():`), or "
                          f"gradients changed between backward() and step() (clipping by the global norm, "
                          f"unscaling), which an exchange behind the backward cannot wait for", RuntimeWarning)
        if compressing:
            if bad:
                for b in self._buckets:
                    self._restore_errors(b)
                self._exchange_failures.clear()
                return False
            for k in stale:
                b = self._buckets[k]
                self._exchange_failures.pop(k, None)
                self._restore_errors(b)
                self._exchange_bucket(b, self._bucket_momentum(b), self._exchange_group)
            if self._exchange_failures:
                failure = next(iter(self._exchange_failures.values()))
                self._exchange_failures.clear()
                raise failure
            return True
        for k in stale:  # the warm-up: the average overwrote the gradients; gather them again
            self._prepare_bucket(k)()
        if self.warmup_dtype is not None:
            for k, b in enumerate(self._buckets):
                grads[b.start:b.end].copy_(self._warmup_wire.pop(k))
        return agreed_finite(grads, spanning_group(self.process_group), self.comm_stats, averaged=True)

    # ------------------------------------------------------------------ step
    # torch.compile(opt.step), or a compiled function that calls it, runs the step as it is: a step
    # is decisions on values (finite? frozen? which stage?) around collectives and compiled C
    # loops, which Dynamo could only break apart, and whose fused kernels would round differently
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler: Optional[GradScaler] = None):
        """One step on every rank. ``grad_scaler``: passed by ``scaler.step(optimizer)`` of a
        ``torch.amp.GradScaler`` (the optimizer declares ``_step_supports_amp_scaling``): the
        gradients are unscaled here unless ``scaler.unscale_(optimizer)`` did it, the step is
        skipped on every rank if some rank's gradient overflowed, and the scaler is told that
        agreed verdict, so every rank's ``scaler.update()`` moves its scale alike."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owner = type(self).__name__
        found_inf = self._unscaled_by(grad_scaler)
        check_param_groups(owner, self.param_groups, self.defaults)
        first = self._layout is None
        if first:
            self._prepare()
        else:
            check_layout_unchanged(owner, self._layout.params, self.param_groups)
        if self._layout.numel == 0:
            return loss
        grads = self._scratch.buffer("grad", self._layout.numel)
        compressing = self.stage == COMPRESSION  # decided by the steps completed so far
        if self._overlap is not None and not first:
            self.last_step_skipped = not self._finish_overlapped(grads, compressing)
        else:
            self.last_step_skipped = not self._serial_exchange(grads, compressing, first)
        if self.last_step_skipped:
            self._skip(warn=grad_scaler is None)
        elif compressing:
            self._flat["step"] += 1
            self._compression_step(grads)
        else:
            self._flat["step"] += 1
            self._warmup_step(grads)
            if self._schedule is not None and self._schedule.due(self._flat):
                self._freeze()
        if not self.last_step_skipped:
            self._flat["consecutive_skips"] = 0
        # with register_ddp the warm-up's bytes were recorded by DDP's hook during the backward
        self.last_step_bytes = self.comm_stats.bytes_sent - self._bytes_after_last_step
        self._bytes_after_last_step = self.comm_stats.bytes_sent
        for flag in found_inf.values():  # what the scaler's update() reads: the verdict of every rank
            flag.fill_(1.0 if self.last_step_skipped else 0.0)
        return loss

    def _unscaled_by(self, scaler: Optional[GradScaler]) -> Dict[torch.device, torch.Tensor]:
        """The gradients unscaled by ``scaler`` (unless ``scaler.unscale_(self)`` did it) and the
        scaler's found-inf flags for this optimizer, which ``step`` overwrites with the verdict
        all ranks agreed on (empty without a scaler)."""
        if scaler is None:
            if getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None:
                raise RuntimeError(f"{type(self).__name__}: this GradScaler set optimizer.grad_scale/found_inf instead "
                                   f"of passing itself to step(grad_scaler=...); its update() would then read each "
                                   f"rank's own overflow and the ranks' loss scales would part. Use a torch whose "
                                   f"GradScaler passes itself (the versions onebitlamb is tested with do)")
            return {}
        if not scaler.is_enabled():
            return {}
        # GradScaler has no public accessor for the per-optimizer flags that update() reads
        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            scaler.unscale_(self)
        return state["found_inf_per_device"]

    def _serial_exchange(self, grads: torch.Tensor, compressing: bool, first: bool) -> bool:
        """After the backward: gather the gradients and average them (the warm-up) or exchange the
        momentum bucket by bucket (stage 2); return whether every rank's gradient was finite."""
        owner = type(self).__name__
        self._gather(grads)
        if self.ddp_link is None:
            if first:
                refuse_averaged_gradients(owner, grads, self._layout.params, spanning_group(self.process_group))
            if not compressing and self.warmup_dtype is None:
                allreduce_mean_(grads, self.process_group, self.comm_stats)
            elif not compressing:
                grads.copy_(allreduce_mean_(grads.to(self.warmup_dtype), self.process_group, self.comm_stats))
        elif not self.ddp_link.averages_this_step() and not compressing:
            raise RuntimeError(f"{owner} is registered with a DDP model (register_ddp) but DDP averaged no "
                               f"gradient since the last step: the backward did not run through the registered "
                               f"DDP model, or its last micro-batch ran under no_sync()")
        # in the warm-up the average shows any rank's NaN; in stage 2 one flag is agreed on first
        finite = agreed_finite(grads, spanning_group(self.process_group), self.comm_stats, averaged=not compressing)
        if finite and compressing and world_size_of(self.process_group) > 1:
            for b in self._buckets:
                self._exchange_bucket(b, self._bucket_momentum(b), self.process_group)
        return finite

    def _skip(self, warn: bool = True) -> None:
        """A non-finite gradient on some rank: every rank leaves parameters, moments, step count and
        error buffers as they were, so the run goes on as if the step had not been taken. Under a
        GradScaler (``warn`` False) an overflow is how the scale finds its level: no warning, and
        the scaler, not a count of skips in a row, deals with a run that keeps overflowing."""
        flat = self._flat
        flat["skipped_steps"] = flat.get("skipped_steps", 0) + 1
        if not warn:
            return
        flat["consecutive_skips"] = flat.get("consecutive_skips", 0) + 1
        if flat["consecutive_skips"] >= MAX_CONSECUTIVE_SKIPS:
            raise FloatingPointError(f"{type(self).__name__}: the gradient was not finite on some rank at "
                                     f"{flat['consecutive_skips']} steps in a row (after step {flat['step']}): the "
                                     f"run has diverged; lower the learning rate or resume from an earlier checkpoint")
        warnings.warn(f"{type(self).__name__}: step skipped on every rank, some rank's gradient was not finite "
                      f"({flat['skipped_steps']} skipped so far, after step {flat['step']})", RuntimeWarning)

    def _betas(self) -> tuple[float, float]:
        """beta1 as the param groups hold it now (a momentum schedule, such as OneCycleLR's
        ``cycle_momentum``, moves it alike in every group: ``check_param_groups``), beta2 the
        optimizer's own (after the freeze it is frozen with the variance)."""
        return self.param_groups[0]["betas"][0], self.defaults["betas"][1]

    def _bias_corrections(self) -> tuple[float, float]:
        if not self.defaults["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = self._betas()
        t = self._flat["step"]
        return 1 - beta1 ** t, 1 - beta2 ** t

    def _apply_(self, update: torch.Tensor, coeff: torch.Tensor) -> None:
        self._last_coeff = coeff.clone()
        self._layout.apply_(update, coeff, self.param_groups)

    def _warmup_step(self, grads: torch.Tensor) -> None:
        """Stage 1 (all of LAMB) on the averaged gradients: Adam moments, layer-wise trust ratio."""
        flat, lay = self._flat, self._layout
        beta1, beta2 = self._betas()
        F.update_moments_(flat["exp_avg"], flat["exp_avg_sq"], grads, beta1, beta2)
        bc1, bc2 = self._bias_corrections()
        update = self._scratch.buffer("update", lay.numel)
        den = F.adam_denominator(flat["exp_avg_sq"], bc2, self.defaults["eps"], out=update)
        F.adam_direction(flat["exp_avg"], den, bc1, out=update)
        lay.add_weight_decay_(update, self.param_groups)
        if self._layerwise:
            coeff, defined = F.trust_ratios(lay.param_norms(), lay.norms(update),
                                            self.defaults["min_coeff"], self.defaults["max_coeff"])
            if self._schedule is not None:  # the running average becomes the frozen coefficient
                F.update_ema_(flat["coeff_ema"], flat["coeff_ema_count"], coeff, defined,
                              self.defaults["coeff_beta"])
        else:
            coeff = lay.ones()
        if self._schedule is not None and self._schedule.watches:
            self._schedule.record(flat, self._variance_levels(bc2), self._trust_levels())
        self._apply_(update, coeff)

    def _variance_levels(self, bias_correction2: float) -> torch.Tensor:
        """Each layer's ``log ||v_hat||``, the statistic whose settling the automatic freeze reads."""
        return torch.log(self._layout.norms(self._flat["exp_avg_sq"]) / bias_correction2)

    def _trust_levels(self) -> Optional[torch.Tensor]:
        """Each layer's ``log`` of the trust ratio a freeze now would keep; ``-inf`` (left out of the
        median) for a layer whose ratio was never defined."""
        if not self._layerwise:
            return None
        flat = self._flat
        kept = F.corrected_ema(flat["coeff_ema"], flat["coeff_ema_count"], self.defaults["coeff_beta"])
        return torch.where(flat["coeff_ema_count"] > 0, torch.log(kept), torch.full_like(kept, -math.inf))

    def _freeze(self) -> None:
        """End of the warm-up: freeze the variance (bias-corrected) and the trust ratio, and fix
        the per-layer momentum scaling and the mask of never-updated elements."""
        flat, lay = self._flat, self._layout
        _, bc2 = self._bias_corrections()
        v = flat["exp_avg_sq"]
        flat["momentum_mask"] = v != 0
        if self._fresh_variance:
            flat["exp_avg_sq_fresh"] = v.clone()
        v.div_(bc2)  # now v_frozen = v_hat
        flat["frozen_at"] = flat["step"]
        flat["frozen_coeff"] = (F.corrected_ema(flat["coeff_ema"], flat["coeff_ema_count"],
                                                self.defaults["coeff_beta"])
                                if self._layerwise else lay.ones())
        flat["prev_factor"] = lay.ones()
        flat["momentum_scale"] = F.momentum_scales(lay.norms(flat["exp_avg"]), lay.per_layer(lay.numels))
        self._new_error_buffers(lay, world_size_of(self.process_group))

    def _local_size(self) -> int:
        """Ranks per node of a hierarchical ``process_group`` (``onebitlamb.comm.node_groups``), else 1."""
        return getattr(self.process_group, "local_size", 1)

    def _new_error_buffers(self, layout: FlatLayout, world: int) -> None:
        """Zero worker and server errors, a region per bucket (``layout.plan_buckets``: a
        hierarchical group keeps a worker error for this rank's chunk only); one process
        compresses nothing and keeps none."""
        if world > 1:
            _, worker, server = buffer_sizes(plan_buckets(self._flat["buckets"], world, self._local_size()))
            self._flat["worker_error"] = torch.zeros(worker, dtype=torch.float32, device=layout.device)
            self._flat["server_error"] = torch.zeros(server, dtype=torch.float32, device=layout.device)

    def _frozen_denominators(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``sqrt(v_frozen) + eps`` and its inverse, derived from the state once after a freeze or load."""
        derived, v_frozen = self._scratch.derived, self._flat["exp_avg_sq"]
        if derived.get("denominator_source") is not v_frozen:
            den = self._scratch.buffer("frozen_denominator", v_frozen.numel())
            torch.sqrt(v_frozen, out=den).add_(self.defaults["eps"])
            derived["denominator"], derived["inverse_denominator"] = den, torch.reciprocal(den)
            derived["denominator_source"] = v_frozen
        return derived["denominator"], derived["inverse_denominator"]

    def _compression_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per element, ``k_l`` (each layer's momentum brought to one common RMS, since the
        compressor has one scale per chunk) and what the decompressed result is multiplied by:
        its inverse times the momentum mask, so one pass both undoes the scaling and masks."""
        derived, flat = self._scratch.derived, self._flat
        if derived.get("scale_source") is not flat["momentum_scale"]:
            numels = torch.tensor(self._layout.numels, device=self._layout.device)
            scale = torch.repeat_interleave(flat["momentum_scale"], numels)
            derived["scale"], derived["unscale"] = scale, torch.reciprocal(scale).mul_(flat["momentum_mask"])
            derived["scale_source"] = flat["momentum_scale"]
        return derived["scale"], derived["unscale"]

    def _compression_step(self, grads: torch.Tensor) -> None:
        """Stage 2 after the exchange: the averaged momentum, frozen variance and trust ratio."""
        flat, lay = self._flat, self._layout
        beta1, beta2 = self._betas()
        d = lay.numel
        m = flat["exp_avg"]
        m_prev = self._scratch.buffer("momentum_prev", d)
        m_prev.copy_(m)
        if world_size_of(self.process_group) > 1:
            # the buckets' exchanges (in step(), or behind the backward) left the averaged momentum,
            # scaled, in the communication buffer
            _, unscale = self._compression_scales()
            buf = self._scratch.buffers["comm"]
            for b in self._buckets:
                torch.mul(buf[b.comm][:b.numel], unscale[b.start:b.end], out=m[b.start:b.end])
        else:
            m.mul_(beta1).add_(grads, alpha=1 - beta1).mul_(flat["momentum_mask"])
        den, inverse_den = self._frozen_denominators()
        bc1, bc2 = self._bias_corrections()
        update = self._scratch.buffer("update", d)
        coeff = flat["frozen_coeff"]
        if self._fresh_variance:
            max_ratio, plain_norms = F.fresh_variance_statistics_(
                flat["exp_avg_sq_fresh"], m, m_prev, den, inverse_den, bc1, bc2, beta1, beta2,
                self.defaults["eps"], lay.slices, lay.offsets, update, scratch=self._scratch.buffer("ratio", d))
            lay.add_weight_decay_(update, self.param_groups)
            update_norms = lay.decayed_update_norms(update, plain_norms, self.param_groups)
            factor = F.scaling_factors(max_ratio, plain_norms, update_norms,
                                       lay.hyper(self.param_groups, "weight_decay"), flat["prev_factor"],
                                       self.defaults["factor_min"], self.defaults["factor_max"],
                                       self.defaults["factor_threshold"])
            flat["prev_factor"] = factor
            coeff = coeff * factor
        else:
            F.adam_direction(m, den, bc1, out=update)
            lay.add_weight_decay_(update, self.param_groups)
        self._apply_(update, coeff)
