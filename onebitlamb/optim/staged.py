"""The machinery LAMB, 1-bit LAMB, 1-bit Adam and 0/1 Adam share: one flat layout, its state,
the exchange, the checks, and a step that runs the current phase (``phases.py``).

An optimizer is a schedule of phases: 1-bit LAMB's warm-up (LAMB with the gradients averaged in
full precision) runs until the freeze schedule (``freeze.py``) names its last step; then the
variance and the trust ratio are frozen and each step sends only this rank's momentum through
the error-compensated 1-bit all-reduce (stage 2). ``docs/algorithm.md`` gives the maths step by
step.
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim import Optimizer

from onebitlamb.comm import CommStats, rank_of, spanning_group, world_size_of
from onebitlamb.optim import functional as F
from onebitlamb.optim.checks import (Waiting, agree_on_setup, check_finite_nonneg, check_layout_unchanged,
                                     check_param_groups, check_resumed_parameters, parameter_checksum,
                                     refusals_of_every_rank, trainable)
from onebitlamb.optim.exchange import Exchange, ProcessGroupLike
from onebitlamb.optim.layout import Bucket, FlatLayout, Scratch, check_loaded_state, check_saved_by, new_flat_state
from onebitlamb.optim.phases import COMPRESSION, LOCAL, WARMUP, OneBitMomentum, Phase  # noqa: F401 (re-exported)
from onebitlamb.optim.context import StepContext
from onebitlamb.optim.sharding import Shards, local
from onebitlamb.optim.state_format import PARAMETERS, beside, shard_wrapped, split_state, to_saved

# The settings that change the numbers and are checked on load, as states saved before they were
# options had them: the exchange's, and what the 1-bit optimizers compress.
EXCHANGE_SETTINGS_BEFORE = {"warmup_dtype": "float32", "bucket_cap_mb": None}
CHECKED_SETTINGS_BEFORE = {**EXCHANGE_SETTINGS_BEFORE, "compression_space": "momentum",
                           "trust_ratio_after_freeze": "frozen", "bound_direction": False}
COMPRESSION_SPACES = ("momentum", "update")
# what the setup check compares across replicas but not across the ranks of a node, which hold
# other shards of the same parameters
SHARD_OWN_SETUP = ("parameter sizes", "parameter values (crc32 of each tensor)", "buckets of the state")
TRUST_RATIOS_AFTER_FREEZE = ("frozen", "live")

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


class StagedOptimizer(Optimizer):
    """Base of the four optimizers: each passes its hyper-parameters and its phases (one, or two
    with a freeze between them; ``phases.py`` has the table). The base holds what every phase
    shares: the flat layout and state, the exchange, the checks, the saved form, and the step:
    the exchange the current phase's stage names, then the phase's update, then, at the end of
    the phase's last step, the next phase's beginning (the freeze)."""

    # GradScaler.step then calls step(grad_scaler=scaler) instead of skipping it on the ranks whose
    # own gradient overflowed: every rank enters the step's collectives, and the skip is agreed
    _step_supports_amp_scaling = True
    _shards: Optional[Shards] = None  # (a copy pickled before sharding existed)

    def __init__(self, params: Iterable, defaults: Dict[str, Any], phases: Sequence[Phase],
                 process_group: ProcessGroupLike, overlap_with_backward: bool, agree_every: Optional[int] = None,
                 fused: Optional[bool] = None) -> None:
        super().__init__(params, defaults)
        check_param_groups(type(self).__name__, self.param_groups, defaults)
        if not 1 <= len(phases) <= 2:
            raise ValueError(f"{type(self).__name__}: one or two phases (before and after a freeze), got {phases!r}")
        self._phases: Tuple[Phase, ...] = tuple(phases)
        # FSDP2-sharded parameters (HSDP): the state and the exchange are this rank's shards'
        self._shards = Shards.of(type(self).__name__, trainable(self.param_groups))
        if self._shards is not None:
            self._check_sharded_setup(process_group, overlap_with_backward)
        self.exchange = Exchange(type(self).__name__, process_group, warmup_dtype=defaults["warmup_dtype"],
                                 bucket_cap_mb=defaults["bucket_cap_mb"], overlap_with_backward=overlap_with_backward,
                                 agree_every=agree_every, fused=fused,
                                 device=next((p.device for g in self.param_groups for p in g["params"]), None))
        self.last_step_bytes = 0
        self._bytes_after_last_step = 0
        # what the phases work with (context.py): the layout and buffers from the first step on
        self._context = self._new_context()
        self.last_step_skipped = False
        # a loaded state's checksum of this rank's parameters, for the next step to check
        self._resumed_parameters: Optional[int] = None
        # the state exists from the start, like the layout it follows, so that a state dict taken
        # before the first step is a complete template (DCP loads into one); rebuilt at the first
        # step if the parameters changed until then
        self._new_state(FlatLayout.of(self.param_groups, self._shards))

    def _check_sharded_setup(self, process_group: ProcessGroupLike, overlap_with_backward: bool) -> None:
        """What sharded parameters cannot be combined with, named at construction."""
        owner = type(self).__name__
        if not isinstance(process_group, (dist.ProcessGroup, type(None))):
            raise ValueError(f"{owner} over sharded parameters takes a plain process group, the replicate group "
                             f"(mesh['replicate'].get_group()), not {type(process_group).__name__}: FSDP already "
                             f"keeps the traffic inside a node on the shard group")
        if overlap_with_backward:
            raise ValueError(f"{owner}: overlap_with_backward=True with sharded parameters; FSDP2 produces each "
                             f"shard's gradient behind its own reduce-scatter, so the exchange runs in step()")
        if not self._phases[-1].takes_sharded_parameters:
            raise ValueError(f"{owner} does not take sharded parameters: {self._phases[-1].not_sharded_because}")
        self._shards.check_replicas(owner, process_group)

    def stats(self) -> Dict[str, Any]:
        """Where the optimizer stands, in one dict with the same keys on all four optimizers (as
        PowerSGD's ``compression_stats()``); the older attributes named below read the same values.

        - ``bytes_sent``, ``rounds``: what this rank sent to the other ranks of ``process_group``
          so far, and in how many collectives (``comm_stats``); ``bytes_by_op``, ``rounds_by_op``
          by kind of collective; ``last_step_bytes``: the last step's (``last_step_bytes``);
        - ``bytes_sent_in_shard_group``, ``rounds_in_shard_group``: with sharded parameters (HSDP),
          what the per-layer reductions sent to the other ranks of the node (``shard_comm_stats``);
          0 otherwise;
        - ``step``: steps taken; ``skipped_steps`` (``skipped_steps``), ``last_step_skipped``
          (``last_step_skipped``): steps skipped on every rank for a non-finite gradient;
        - ``stage``: the exchange the next step runs (``stage``); ``freeze_step``: the step at
          whose end the freeze came (None before, and always for ``Lamb``);
        - ``freeze``: the freeze schedule's record (``freeze_stats()``; None for ``Lamb``);
        - ``elements_waiting``, ``elements_born_after_freeze``: after the freeze, the elements that
          no rank's gradient has reached yet (they send nothing and do not move), and those first
          reached after it (docs/algorithm.md, "Elements born after the freeze"); with sharded
          parameters, of this rank's shards. None before the freeze (one pass over the state).
        """
        sent, node = self.comm_stats, self.shard_comm_stats
        flat = self.state.get("flat", {})
        freeze = getattr(self, "freeze_stats", None)
        mask = flat.get("momentum_mask") if flat.get("frozen_at") is not None else None
        return {"bytes_sent": sent.bytes_sent, "rounds": sent.calls, "bytes_by_op": dict(sent.bytes_by_op),
                "rounds_by_op": dict(sent.rounds_by_op), "last_step_bytes": self.last_step_bytes,
                "bytes_sent_in_shard_group": node.bytes_sent if node is not None else 0,
                "rounds_in_shard_group": node.calls if node is not None else 0,
                "step": flat.get("step", 0), "skipped_steps": self.skipped_steps,
                "last_step_skipped": self.last_step_skipped, "stage": self.stage,
                "freeze_step": flat.get("frozen_at"), "freeze": freeze() if freeze is not None else None,
                "elements_waiting": None if mask is None else int((~mask).sum()),
                "elements_born_after_freeze": None if mask is None else self._phases[-1].born_after_freeze(flat)}

    @property
    def shard_comm_stats(self) -> Optional[CommStats]:
        """With sharded parameters (HSDP), what the per-layer reductions sent inside the node (over
        the shard group); ``comm_stats`` counts what crossed to the other replicas. None otherwise."""
        return None if self._shards is None else self._shards.stats

    def _new_context(self) -> StepContext:
        """The step context of this optimizer. It reaches the state and the phase through a weak
        reference: an optimizer its user drops goes at once, and with it the hooks on its
        parameters (as the exchange holds the payload weakly)."""
        me = weakref.ref(self)
        return StepContext(me, phase=lambda: me()._phase())

    # the layout, the buffers and the last coefficient live in the step context (context.py)
    @property
    def _layout(self) -> Optional[FlatLayout]:
        return self._context.layout

    @_layout.setter
    def _layout(self, layout: Optional[FlatLayout]) -> None:
        self._context.layout = layout

    @property
    def _scratch(self) -> Optional[Scratch]:
        return self._context.buffers

    @property
    def _last_coeff(self) -> Optional[torch.Tensor]:
        return self._context.last_coeff

    def _phase(self) -> Phase:
        """The phase the next step runs: the first until the freeze (``frozen_at``), then the second."""
        return self._phases[0] if self._flat["frozen_at"] is None else self._phases[-1]

    @property
    def _stage2(self) -> Optional[OneBitMomentum]:
        """The 1-bit stage 2 that a freeze starts (1-bit LAMB, 1-bit Adam), else None."""
        last = self._phases[-1]
        return last if isinstance(last, OneBitMomentum) else None

    @property
    def process_group(self) -> ProcessGroupLike:
        """The group the exchange runs over (``exchange.process_group``)."""
        return self.exchange.process_group

    @property
    def comm_stats(self) -> CommStats:
        """Bytes sent and received and collectives called so far (``exchange.comm_stats``)."""
        return self.exchange.comm_stats

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context for the backwards of all micro-batches but the last of a gradient accumulation:
        with ``overlap_with_backward=True`` they start no exchange; otherwise it does nothing."""
        return self.exchange.no_sync()

    @property
    def parameters_synchronized(self) -> bool:
        """Whether every rank's parameters are alike now: always for ``Lamb``, ``OneBitLamb`` and
        ``OneBitAdam``; for ``ZeroOneAdam`` before its freeze and right after a sync or
        ``synchronize()``, not after a local step (a checkpoint then needs every rank's parameters)."""
        return "flat" not in self.state or self._phase().synchronized(self._context)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Bring every rank's parameters to the same values, as a sync step would: for
        ``ZeroOneAdam`` between its syncs, the ranks' moves since the last sync averaged with the
        1-bit all-reduce (one round trip, no step taken, the schedule unchanged); a no-op, with no
        communication, wherever ``parameters_synchronized`` is True (always for the other
        optimizers). Call it on every rank before saving the model from one rank, and at the end
        of a run: 0/1 Adam's last step is most often a local one, after which every rank holds
        other parameters. It changes the run as an extra sync would: a run resumed from a
        checkpoint taken after it continues bit for bit the run that called it there."""
        if self.parameters_synchronized:
            return
        if self._layout is None:  # the first call after a load: laid out and checked as a step would
            self._prepare()
        held = self._held_state()
        try:
            self._phase().synchronize(self._context)
        except Exception:
            self._restore_state(held)
            raise
        self._bytes_after_last_step = self.comm_stats.bytes_sent  # (last_step_bytes stays a step's)

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
        self.state["flat"] = new_flat_state(layout, type(self).__name__, world, rank, self.exchange.local_size,
                                            self.exchange.bucket_ranges(layout))
        for phase in self._phases:
            phase.init_state(self._context, layout)
        self.exchange.new_warmup_error_buffers(self._flat, layout.device)

    def _untouched(self) -> bool:
        flat = self._flat
        return flat["step"] == 0 and flat.get("skipped_steps", 0) == 0 and flat["frozen_at"] is None

    def prepare_state(self) -> None:
        """Lay out the state now where the next ``step()`` would (its first, or the first after a load):
        collective, as there. For an exchange that runs before ``step()`` and needs the state:
        ``register_ddp``'s quantised warm-up, in DDP's hook."""
        if self._layout is None:
            check_param_groups(type(self).__name__, self.param_groups, self.defaults)
            self._prepare()

    def _prepare(self) -> None:
        """The layout is built at the first step (or the first after a load), when the param groups
        are final; a loaded state is checked against it."""
        layout = FlatLayout.of(self.param_groups, self._shards)
        world, owner = world_size_of(self.process_group), type(self).__name__
        rank = rank_of(self.process_group)
        if self._untouched():
            self._new_state(layout)
        else:
            check_loaded_state(self._flat, layout, owner, world, rank, self.exchange.local_size, self.exchange.warmup_codec)
            for phase in self._phases:
                phase.check_state(self._context)
            has_errors = self._flat["frozen_at"] is not None or self._phases[0].compresses_from_start
            if not has_errors:  # the errors, made at the freeze, will follow them
                self._flat["buckets"] = self.exchange.bucket_ranges(layout)
            if has_errors and "worker_error" not in self._flat:
                self.exchange.new_error_buffers(self._flat, layout.device)  # saved on one process, resumed on several
            if "warmup_worker_error" not in self._flat:  # as above, or re-sharded
                self.exchange.new_warmup_error_buffers(self._flat, layout.device)
        self._agree(layout)
        if getattr(self, "_resumed_parameters", None) is not None:  # (agreed: every rank checks, or none)
            check_resumed_parameters(owner, self._resumed_parameters, layout.tensors,
                                     spanning_group(self.process_group), layout.device, self._flat["step"])
            self._resumed_parameters = None
        self._context.layout, self._context.buffers = layout, Scratch(layout.device, layout.numel)
        self.exchange.bind(layout, self._flat, self._scratch, self._payload, negate=self.defaults["maximize"],
                           waiting=self._waiting, born=self._born)

    def _agree(self, layout: FlatLayout, after_step: Optional[int] = None) -> None:
        """Every rank's ``_setup`` alike (``checks.agree_on_setup``), over the process group; with
        sharded parameters over every rank of the mesh, so that all of them raise alike: what each
        rank of a node holds of its own (its shards' sizes and values) is first gathered over the
        node, and the node's whole list is compared across the replicas."""
        setup, group = self._setup(layout), self._agreement_group()
        if layout.spans_shards:
            shards = layout.shards
            own: List[Any] = [None] * shards.size
            dist.all_gather_object(own, {k: setup.pop(k) for k in SHARD_OWN_SETUP if k in setup}, group=shards.group)
            setup["each shard's own (parameter sizes, values, buckets)"] = own
        agree_on_setup(setup, group, layout.device, after_step=after_step)

    def _setup(self, layout: FlatLayout) -> Dict[str, Any]:
        """What every rank must have alike (``checks.agree_on_setup``)."""
        setup = {"optimizer": type(self).__name__, "parameter sizes": layout.numels,
                "param groups (lr, weight_decay)": [(g["lr"], g["weight_decay"]) for g in self.param_groups],
                "parameters per group": [layout.groups.count(i) for i in range(len(self.param_groups))],
                "hyper-parameters": sorted((k, v) for k, v in self.defaults.items() if k not in ("lr", "weight_decay")),
                "freeze_step": repr(getattr(self._phases[0], "schedule", None)),
                **self.exchange.setup(),
                "shards (FSDP2)": repr(self._shards),
                **({"buckets of the state": self._flat["buckets"]} if self._flat["frozen_at"] is not None else {}),
                "state (step, frozen_at)": (self._flat["step"], self._flat["frozen_at"]),
                "parameters checked against the loaded state": getattr(self, "_resumed_parameters", None) is not None,
                "parameter values (crc32 of each tensor)": [parameter_checksum(p) for p in layout.tensors]}
        for phase in self._phases:
            phase.setup(self._context, layout, setup)
        return setup

    def _rank_entries(self, params: List[torch.Tensor]) -> Dict[str, Any]:
        """What the saved state keeps of this rank beside its compression errors: what the phases
        add. The state of LAMB and the 1-bit optimizers holds nothing of the parameters, which are
        alike on every rank: a model saved from rank 0 is right on every rank, and another model
        loaded with the state is the caller's choice, as with torch.optim (``LocalSteps`` records
        them)."""
        entries: Dict[str, Any] = {}
        for phase in self._phases:
            entries.update(phase.rank_entries(self._context, params))
        return entries

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because some rank's gradient was not finite (``step()``)."""
        return self._flat.get("skipped_steps", 0)

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim``'s form: ``{"state": {i: ...}, "param_groups": [...]}``, the whole state
        under the index of the first trainable parameter and an empty entry for each other one
        (``state_format.py``): what ``torch.distributed.checkpoint`` and the frameworks expect.
        What a state-dict pre-hook adds to ``optimizer.state`` is kept (and loaded back where it
        was put, beside a parameter or not), and the post-hooks see this form, as with any torch
        optimizer."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with _torch_hooks_paused(self, "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks"):
            state_dict = super().state_dict()
        packed = state_dict["state"]
        flat = packed.pop("flat")
        params = self._layout.params if self._layout is not None else FlatLayout.of(self.param_groups, self._shards).params
        held = {id(p) for p in params}
        every = [p for g in self.param_groups for p in g["params"]]
        indices = [i for i, p in enumerate(every) if id(p) in held]
        if indices:
            # entries someone else put in optimizer.state (a hook, a framework) stay beside ours,
            # named where they share the flat state's entry (a load gives them back to the parameter)
            ours = {i: dict(packed.get(i, {})) for i in indices}
            stage2 = self._stage2
            saved = to_saved(flat, stage2 is not None, stage2 is not None and stage2.keeps_fresh_variance,
                             self._rank_entries([local(p) for p in params]))
            if self._shards is not None:
                saved = shard_wrapped(saved, self._shards.rank, self._shards.size)
            ours[indices[0]] = beside(saved, ours[indices[0]])
            state_dict["state"] = {**ours, **{k: v for k, v in packed.items() if k not in ours}}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a ``state_dict()``; the state is checked here, before anything changes: the
        optimizer class, the parameters' sizes, the exchange's settings that change the numbers
        (``warmup_dtype``, ``bucket_cap_mb``) and, where it holds compression errors (a 1-bit
        optimizer after its freeze), this rank and world size (``reshard_state_dicts`` changes
        the latter). Load-state-dict pre-hooks run before the check, post-hooks after the load.

        On several ranks the verdict is collective (one all-gather of a flag; call it on every
        rank, as every framework does): where some rank refuses its state, that rank raises its
        own error and every other rank a ``ValueError`` naming that rank and its reason, nothing
        loaded anywhere. Why: a rank whose load was refused stops, and the others, which loaded
        theirs, would wait for it in their next step's collectives and end with an error that
        names the wrong cause."""
        refusal: Optional[Exception] = None
        try:
            state_dict, flat, others, resumed = self._checked_for_load(state_dict)
        except Exception as exc:  # (the pre-hooks' too: a rank file not found)
            refusal = exc
        refused = refusals_of_every_rank(None if refusal is None else f"{type(refusal).__name__}: {refusal}",
                                         self._agreement_group(), self._device())
        if refusal is not None:
            raise refusal
        if refused:
            ranks = ", ".join(map(str, refused))
            raise ValueError(f"{type(self).__name__}.load_state_dict refused the optimizer state on rank(s) {ranks}, "
                             f"so nothing was loaded on any rank: " + "; ".join(f"rank {r}: {why}"
                                                                               for r, why in refused.items()))
        self.exchange.unbind()  # what a backward started used the state being replaced
        # handed to torch.optim under "flat", which it keeps as it is: under a parameter's index it
        # would be cast to that parameter's dtype
        with _torch_hooks_paused(self, "_optimizer_load_state_dict_pre_hooks",
                                 "_optimizer_load_state_dict_post_hooks"):
            super().load_state_dict({**state_dict, "state": others if flat is None else {**others, "flat": flat}})
        if flat is None:
            self._new_state(FlatLayout.of(self.param_groups, self._shards))
        self._layout, self._resumed_parameters = None, resumed
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _checked_for_load(self, state_dict: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]],
                                                                      Dict[Any, Any], Optional[int]]:
        """``load_state_dict``'s pre-hooks and checks, on this rank alone: the state dict, its flat
        state (None: a template without one), the other entries and the parameters' checksum."""
        state_dict = state_dict.copy()  # shallow, as torch.optim: a pre-hook may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        flat, others = split_state(state_dict)  # first: another optimizer's state is named as such
        owner = type(self).__name__
        # this rank's parameters as the state was saved, where it records them (``_rank_entries``):
        # checked at the next step, when the caller has loaded the model too
        resumed = None if flat is None else flat.pop(PARAMETERS, None)
        if flat is not None:
            check_saved_by(flat, owner)
            self._check_loaded_shard(flat.pop("shard", None))
        state_dict["param_groups"] = self._exchange_settings_checked(state_dict["param_groups"])
        if flat is not None:
            check_loaded_state(flat, FlatLayout.of(self.param_groups, self._shards), owner, world_size_of(self.process_group),
                               rank_of(self.process_group), self.exchange.local_size, self.exchange.warmup_codec)
        return state_dict, flat, others, resumed

    def _agreement_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks that agree on the setup and on a load: the process group's (every rank of node
        groups); with sharded parameters the world, whose every rank the mesh spans."""
        if self._shards is not None and self._shards.size > 1:
            return None
        return spanning_group(self.process_group)

    def _device(self) -> torch.device:
        """The parameters' device (where the agreements' tensors go: NCCL's are CUDA tensors)."""
        return next((local(p).device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    def _check_loaded_shard(self, saved: Optional[Tuple[int, int]]) -> None:
        """A sharded state holds one shard's moments: it loads on the rank that holds that shard of
        a mesh with as many shards, and only a sharded optimizer loads it (and the reverse)."""
        owner = type(self).__name__
        here = None if self._shards is None else (self._shards.rank, self._shards.size)
        if saved == here:
            return
        said = "unsharded parameters" if saved is None else f"shard {saved[0]} of {saved[1]}"
        now = "unsharded parameters" if here is None else f"shard {here[0]} of {here[1]}"
        raise ValueError(f"the optimizer state was saved for {said} and is loaded into {owner} over {now}: its "
                         f"moments and errors are those of its shard. Resume on the mesh it was saved on (the "
                         f"same number of ranks per replica, each rank loading its own shard's state); "
                         f"a change of the shard size is not supported (the model itself reshards with "
                         f"torch.distributed.checkpoint, the optimizer state does not)")

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> Dict[str, Any]:
        """What ``copy.deepcopy`` and pickle keep: the parameters, the state, the hyper-parameters
        and the statistics; not what binds this object to a running job. Like torch.optim's, a
        copy has no hooks. Like PowerSGD's state, a copy holds no process group and uses the
        default one (an optimizer on a group that is not the whole world cannot be copied). A copy
        has no ``register_ddp`` link and exchanges in ``step()`` (``overlap_with_backward``'s hooks
        stay with the original), with the same buckets, so it steps as the original would
        (``Exchange.__getstate__``); its next step lays out its state again, as after
        ``load_state_dict`` (a collective, on every rank: the ranks agree on the setup and the
        state is checked against this rank)."""
        group = self.process_group
        if group is not None and not _spans_the_world(group):
            raise ValueError(f"{type(self).__name__} on a process group that is not the whole world cannot be "
                             f"copied (a copy uses the default group, as PowerSGD's state does): build a new "
                             f"optimizer on that group and load_state_dict(optimizer.state_dict()) into it")
        state = super().__getstate__()
        state.update({k: v for k, v in self.__dict__.items() if k not in state and not k.startswith("_optimizer_")})
        state.pop("_context", None)  # (its layout and buffers are made again at the next step)
        state["_last_coeff_copy"] = self._last_coeff
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        last_coeff = state.pop("_last_coeff_copy", state.pop("_last_coeff", None))
        state.pop("_layout", None), state.pop("_scratch", None)  # (copies pickled before the step context)
        super().__setstate__(state)
        self._context = self._new_context()
        self._context.last_coeff = last_coeff

    def _exchange_settings_checked(self, saved_groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The exchange's settings that change the numbers must be the state's: a run resumed with
        another would silently become another run. States saved before they were options had
        the defaults of then (float32, one bucket)."""
        groups = []
        checked = {k: v for k, v in CHECKED_SETTINGS_BEFORE.items() if k in self.defaults}
        for group in saved_groups:
            group = {**checked, **group}
            for key in checked:
                if group[key] != self.defaults[key]:
                    raise ValueError(f"the optimizer state was saved with {key}={group[key]!r} and is loaded into "
                                     f"{type(self).__name__} with {key}={self.defaults[key]!r}: build the optimizer "
                                     f"with {key}={group[key]!r} to resume this run (the setting changes its numbers)")
            groups.append(group)
        return groups

    @property
    def stage(self) -> str:
        """The exchange the next step runs (its phase's): ``"warmup"`` (the full-precision average)
        until the freeze (at the end of the step the freeze schedule chose), then ``"compression"``
        (the 1-bit all-reduce); 0/1 Adam's also ``"local"`` (``phases.py``)."""
        if "flat" not in self.state:
            return WARMUP
        return self._phase().stage(self._context)

    def layer_diagnostics(self) -> List[Dict[str, Optional[float]]]:
        """Per trainable parameter (flat order): the coefficient applied at the last step
        (``trust_ratio``; in stage 2, frozen coefficient x factor), and in stage 2 the frozen
        coefficient and 1-bit LAMB's factor."""
        if self._last_coeff is None:
            return []
        compressed = self.stage == COMPRESSION
        frozen = self._flat.get("frozen_coeff") if compressed else None
        has_factor = compressed and self._stage2 is not None and self._stage2.rule == "frozen"
        factor = self._flat.get("prev_factor") if has_factor else None
        return [{"trust_ratio": float(self._last_coeff[i]),
                 "frozen_coeff": None if frozen is None else float(frozen[i]),
                 "factor": None if factor is None else float(factor[i])}
                for i in range(len(self._last_coeff))]

    # ------------------------------------------------------------------ what the phases share
    def _payload(self, b: Bucket, out: torch.Tensor) -> None:
        """What bucket ``b`` sends through the 1-bit all-reduce (the current phase's ``payload``): the
        exchange asks for it once the bucket's gradients are in, in ``step()`` or behind the
        backward, and holds this method weakly."""
        self._phase().payload(self._context, b, out)

    def _waiting(self) -> Optional[Waiting]:
        """While some elements wait for their first gradient, the mask of those that do not (the
        current phase's ``waiting``)."""
        return self._phase().waiting(self._context)

    def _born(self, indices: torch.Tensor, mean_squares: Optional[torch.Tensor]) -> None:
        """Waiting elements some rank's gradient reached at this step (the current phase's ``born``)."""
        self._phase().born(self._context, indices, mean_squares)

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
            check_layout_unchanged(owner, self._layout.params, self.param_groups, self._layout.whole_numels)
        if self._layout.numel == 0:
            return loss
        grads = self._scratch.grad
        phase = self._phase()
        stage = phase.stage(self._context)  # decided by the steps completed so far
        held = self._held_state()
        try:
            received = self.exchange.run(grads, stage, first)
            finite = received is not None
            if self._layout.spans_shards:
                # the ranks of a node hold different shards and agree on the step only here
                finite = self._layout.shards.every_rank(finite, self._layout.device)
                if not finite and received is not None:
                    self._restore_state(held)  # this shard's exchange went ahead: its errors moved
            if finite:
                self._flat["step"] += 1
                phase.step(self._context, stage, grads, received)
                if phase.ends(self._context):
                    self._phases[-1].begin(self._context)  # the freeze, at the end of the phase's last step
        except Exception:  # a refused step (FloatingPointError, ValueError) or any other: it changed nothing
            self._restore_state(held)
            raise
        self.last_step_skipped = not finite
        if self.last_step_skipped:
            self._skip(warn=grad_scaler is None)
        if not self.last_step_skipped:
            self._flat["consecutive_skips"] = 0
        calls = self._flat["step"] + self.skipped_steps  # the same on every rank
        if not first and self.exchange.agree_every and calls % self.exchange.agree_every == 0:
            # what the first step agreed on, again: a rank whose parameters or lr were changed since
            self._agree(self._layout, after_step=calls)
        # with register_ddp the warm-up's bytes were recorded by DDP's hook during the backward
        self.last_step_bytes = self.comm_stats.bytes_sent - self._bytes_after_last_step
        self._bytes_after_last_step = self.comm_stats.bytes_sent
        for flag in found_inf.values():  # what the scaler's update() reads: the verdict of every rank
            flag.fill_(1.0 if self.last_step_skipped else 0.0)
        return loss

    def _held_state(self) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Optional[torch.Tensor]]:
        """What ``_restore_state`` needs to put the state back as it was before this step: the
        entries (a refused step may have replaced some), and a copy of each tensor the step may
        change in place before its last check (``_apply_``, a sync's). Why: a step is refused
        with ``FloatingPointError`` when its update is not finite or its step size is past
        float32's range (``context.MAX_STEP_SIZE``), on every rank alike; by then
        the moments, the update sum and the compression errors have taken that step's values, and
        one non-finite error would make every later exchange non-finite. Not copied: what never
        changes in place before that check (the frozen variance, the last sync's parameters)."""
        flat = self._flat
        kept = ("sync_params",) + (("exp_avg_sq",) if flat["frozen_at"] is not None else ())
        copies = {k: self._scratch.copy_of(k, v) for k, v in flat.items()
                  if isinstance(v, torch.Tensor) and k not in kept}
        return dict(flat), copies, self._last_coeff

    def _restore_state(self, held: Tuple[Dict[str, Any], Dict[str, torch.Tensor], Optional[torch.Tensor]]) -> None:
        """The state as ``_held_state`` found it: a refused step leaves nothing behind (the errors
        of buckets exchanged behind the backward from the exchange's own copies)."""
        entries, copies, self._context.last_coeff = held
        flat = self._flat
        flat.clear()
        flat.update(entries)
        for key, copy in copies.items():
            flat[key].copy_(copy)
        self.exchange.undo_backward_exchanges()
        self._phase().restored(self._context)
        self._scratch.derived.clear()  # caches of the state (the denominators, a sync's local update)

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
