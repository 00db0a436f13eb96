"""The phases of a run: what each step of a phase sends, and how it applies what comes back.

An optimizer here is a schedule of phases over the machinery ``StagedOptimizer`` holds (the flat
layout, the state, the exchange, the checks). Its first phase runs until its :meth:`Phase.ends`
says so; then the second :meth:`Phase.begin`\\ s (the freeze) and runs to the end of the run:

============  =============================================  ====================================
optimizer     first phase                                    second phase (from the freeze)
============  =============================================  ====================================
Lamb          ``Warmup(trust_ratio=True)``, never ending     -
OneBitLamb    ``Warmup(trust_ratio=True, schedule)``         ``OneBitMomentum("frozen" | "live")``
OneBitAdam    ``Warmup(trust_ratio=False, schedule)``        ``OneBitMomentum("adam")``
ZeroOneAdam   ``VarianceThinning`` (``zero_one.py``)         ``LocalSteps`` (``local_steps.py``)
============  =============================================  ====================================

Each step of a phase runs one of three exchanges (its *stage*): ``"warmup"``, the full-precision
average of the gradients (in place); ``"compression"``, the error-compensated 1-bit all-reduce of
what :meth:`Phase.payload` puts in each bucket, whose averages come back per bucket; ``"local"``,
none (only the agreed check that every rank's gradient is finite). A phase works through the step
context (``context.StepContext``): it reads and writes the flat state (``ctx.state``), uses the
scratch buffers (``ctx.buffers``) and the helpers every phase shares, and moves the parameters with
``ctx.apply_``; it holds nothing of its own but its settings, so an optimizer is copied, pickled and saved as before phases were objects.
The state's form is the same as well: ``frozen_at`` (None before the freeze) says which phase runs.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

from onebitlamb.optim import functional as F
from onebitlamb.optim.checks import Waiting
from onebitlamb.optim.exchange import COMPRESSION, LOCAL, WARMUP  # noqa: F401 (the stages, named by the exchange)
from onebitlamb.optim.context import StepContext
from onebitlamb.optim.layout import Bucket, FlatLayout



class Phase:
    """One part of a run. Subclasses override what applies to them; the defaults are those of a
    phase that exchanges nothing compressed and adds nothing to the state."""

    # whether this phase's steps may run the 1-bit all-reduce from its first step, so that the
    # compression errors exist from the start of the run (0/1 Adam), not from the freeze
    compresses_from_start = False
    # whether the phase works on FSDP2's shards (``sharding.py``): every step's update from what is
    # alike on every replica, per-layer statistics through the layout
    takes_sharded_parameters = True
    not_sharded_because = ""

    def __repr__(self) -> str:  # the settings: part of what the ranks agree on, and of a test's view
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def init_state(self, ctx: StepContext, layout: FlatLayout) -> None:
        """Add the phase's entries to a new flat state (all of them from the start: DCP loads into a
        template of the same entries)."""

    def check_state(self, ctx: StepContext) -> None:
        """Check a loaded state's entries of this phase."""

    def setup(self, ctx: StepContext, layout: FlatLayout, setup: Dict[str, Any]) -> None:
        """Add what every rank must have alike for this phase (``checks.agree_on_setup``), over
        ``layout`` (the one being set up)."""

    def rank_entries(self, ctx: StepContext, params: List[torch.Tensor]) -> Dict[str, Any]:
        """What the saved state keeps of this rank's own beside its compression errors."""
        return {}

    def stage(self, ctx: StepContext) -> str:
        """The exchange the next step runs (``WARMUP``, ``COMPRESSION`` or ``LOCAL``)."""
        return WARMUP

    def payload(self, ctx: StepContext, b: Bucket, out: torch.Tensor) -> None:
        """What bucket ``b`` sends through the 1-bit all-reduce at a ``COMPRESSION`` step, into
        ``out`` (its ``b.numel`` elements; the exchange pads). Called in ``step()`` or, behind the
        backward, on the exchange's hook thread, once the bucket's gradients are in ``ctx``'s flat
        gradient buffer."""
        raise NotImplementedError(f"{type(self).__name__} sends nothing compressed")

    def step(self, ctx: StepContext, stage: str, grads: torch.Tensor, received: List[torch.Tensor]) -> None:
        """The update after the step's exchange (every rank's gradient finite): ``grads`` holds the
        average in the warm-up stage, this rank's own gradients otherwise; ``received`` the 1-bit
        averages of the buckets (``ctx.exchange.buckets``' order; empty with one process or when
        nothing compressed was exchanged)."""
        raise NotImplementedError

    def ends(self, ctx: StepContext) -> bool:
        """Whether the step just taken is this phase's last (then the next phase begins)."""
        return False

    def begin(self, ctx: StepContext) -> None:
        """Start this phase at the end of the previous one's last step (the freeze): set what its
        steps need and mark the state (``frozen_at``)."""
        raise NotImplementedError

    def synchronized(self, ctx: StepContext) -> bool:
        """Whether every rank's parameters are alike now: after every step of a phase whose update
        is the same on every rank (all but 0/1 Adam's local steps)."""
        return True

    def synchronize(self, ctx: StepContext) -> None:
        """Make every rank's parameters alike, as the phase's own sync would (collective; called on
        every rank, only where ``synchronized`` is False)."""
        raise NotImplementedError(f"{type(self).__name__} keeps every rank's parameters alike")

    def inverse_denominator(self, ctx: StepContext) -> torch.Tensor:
        """``1 / (sqrt(v_hat) + eps)`` as the update space divides what it sends: the frozen one."""
        return ctx.frozen_denominators()[1]

    def waiting(self, ctx: StepContext) -> Optional[Waiting]:
        """While some elements send nothing until a rank's gradient reaches them, the mask of the
        others (None: none waits, or the phase has no such elements); the exchange agrees on those
        reached before the payloads."""
        return None

    @staticmethod
    def born_after_freeze(flat: Dict[str, Any]) -> int:
        """How many elements of a frozen state were first reached after the freeze (``stats()``)."""
        return 0

    def restored(self, ctx: StepContext) -> None:
        """After a refused step put the state's entries and its held copies back: undo what the
        step changed in place beyond them (``StagedOptimizer._held_state``)."""

    def born(self, ctx: StepContext, indices: torch.Tensor, mean_squares: Optional[torch.Tensor]) -> None:
        """Waiting elements (flat indices) some rank's gradient reached at this step, alike on every
        rank; ``mean_squares``: the ranks' mean squared gradient at each, where ``waiting`` asked
        for it (else None)."""
        raise NotImplementedError

    def bias_corrections(self, ctx: StepContext) -> tuple[float, float]:
        """``1 - beta1^t`` and ``1 - beta2^t``, ``t`` the steps taken (1, 1 without bias correction)."""
        if not ctx.defaults["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = ctx.betas()
        t = ctx.state["step"]
        return 1 - beta1 ** t, 1 - beta2 ** t


class Warmup(Phase):
    """Stage 1, and all of LAMB: Adam's moments from the averaged gradients and, with
    ``trust_ratio``, LAMB's layer-wise trust ratio (else Adam's step, coefficient 1). With a freeze
    ``schedule`` (``freeze.py``) it also keeps what the freeze will keep (the trust ratio's running
    average) and records what the automatic freeze reads, and ends at the step the schedule names;
    without one it never ends (plain LAMB)."""

    def __init__(self, trust_ratio: bool, schedule: Any = None) -> None:
        self.trust_ratio = trust_ratio
        self.schedule = schedule

    def init_state(self, ctx: StepContext, layout: FlatLayout) -> None:
        if self.schedule is not None:
            self.schedule.init_state(ctx.state, len(layout.params), layout.device)

    def check_state(self, ctx: StepContext) -> None:
        if self.schedule is not None:
            self.schedule.check_state(ctx.state)

    def ends(self, ctx: StepContext) -> bool:
        return self.schedule is not None and self.schedule.due(ctx.state)

    def step(self, ctx: StepContext, stage: str, grads: torch.Tensor, received: List[torch.Tensor]) -> None:
        flat, lay, defaults = ctx.state, ctx.layout, ctx.defaults
        beta1, beta2 = ctx.betas()
        F.update_moments_(flat["exp_avg"], flat["exp_avg_sq"], grads, beta1, beta2)
        bc1, bc2 = self.bias_corrections(ctx)
        update = ctx.buffers.update
        den = F.adam_denominator(flat["exp_avg_sq"], bc2, defaults["eps"], out=update)
        F.adam_direction(flat["exp_avg"], den, bc1, out=update)
        lay.add_weight_decay_(update, ctx.param_groups)
        if self.trust_ratio:
            param_norms, update_norms = lay.trust_norms(update)
            coeff, defined = F.trust_ratios(param_norms, update_norms, defaults["min_coeff"], defaults["max_coeff"])
            if self.schedule is not None:  # the running average becomes the frozen coefficient
                F.update_ema_(flat["coeff_ema"], flat["coeff_ema_count"], coeff, defined, defaults["coeff_beta"])
        else:
            coeff = lay.ones()
        if self.schedule is not None and self.schedule.watches:
            self.schedule.record(flat, self._variance_levels(ctx, bc2), self._trust_levels(ctx))
        ctx.apply_(update, coeff)

    @staticmethod
    def _variance_levels(ctx: StepContext, bias_correction2: float) -> torch.Tensor:
        """Each layer's ``log ||v_hat||``, the statistic whose settling the automatic freeze reads."""
        return torch.log(ctx.layout.norms(ctx.state["exp_avg_sq"]) / bias_correction2)

    def _trust_levels(self, ctx: StepContext) -> Optional[torch.Tensor]:
        """Each layer's ``log`` of the trust ratio a freeze now would keep; ``-inf`` (left out of the
        median) for a layer whose ratio was never defined."""
        if not self.trust_ratio:
            return None
        flat = ctx.state
        kept = F.corrected_ema(flat["coeff_ema"], flat["coeff_ema_count"], ctx.defaults["coeff_beta"])
        return torch.where(flat["coeff_ema_count"] > 0, torch.log(kept), torch.full_like(kept, -math.inf))


# stage 2's layer-wise coefficient: 1-bit LAMB's frozen trust ratio times its per-layer factor
# (from a variance kept fresh after the freeze), LAMB's own ratio recomputed every step, or none
STAGE2_RULES = ("frozen", "live", "adam")  # the first two: trust_ratio_after_freeze's values


class OneBitMomentum(Phase):
    """Stage 2 of 1-bit LAMB and 1-bit Adam: the variance frozen; each step sends this rank's
    momentum (``b1 m + (1 - b1) g``, each layer scaled to a common RMS, over the frozen denominator
    in the update space) through the 1-bit all-reduce, and steps with the average. ``rule``
    (``STAGE2_RULES``) sets each layer's coefficient."""

    def __init__(self, rule: str) -> None:
        if rule not in STAGE2_RULES:
            raise ValueError(f"Invalid stage 2 rule: {rule!r} (must be one of {STAGE2_RULES})")
        self.rule = rule

    # the state keeps a variance fresh after the freeze under every rule: the factor's (rule
    # "frozen", every element), and the denominator of the elements born after the freeze
    keeps_fresh_variance = True

    def stage(self, ctx: StepContext) -> str:
        return COMPRESSION

    def check_state(self, ctx: StepContext) -> None:
        flat = ctx.state
        if flat["frozen_at"] is not None and "exp_avg_sq_fresh" not in flat:
            # saved before the rules other than "frozen" kept one: no element was born after the
            # freeze then (none could be), so the fresh variance it would hold is zero
            flat["exp_avg_sq_fresh"] = torch.zeros_like(flat["exp_avg_sq"])

    def begin(self, ctx: StepContext) -> None:
        """The freeze: the variance (bias-corrected) and the trust ratio frozen, the per-layer
        momentum scaling and the mask of never-updated elements fixed, the errors made."""
        flat, lay = ctx.state, ctx.layout
        _, bc2 = self.bias_corrections(ctx)
        v = flat["exp_avg_sq"]
        flat["momentum_mask"] = v != 0
        # the factor's fresh variance starts from the frozen one; under the other rules only the
        # elements born after the freeze use it, and they start from nothing
        flat["exp_avg_sq_fresh"] = v.clone() if self.rule == "frozen" else torch.zeros_like(v)
        v.div_(bc2)  # now v_frozen = v_hat
        flat["frozen_at"] = flat["step"]
        flat["frozen_coeff"] = (F.corrected_ema(flat["coeff_ema"], flat["coeff_ema_count"], ctx.defaults["coeff_beta"])
                                if self.rule != "adam" else lay.ones())
        flat["prev_factor"] = lay.ones()
        sent = flat["exp_avg"]
        if ctx.compresses_update():  # the layers' scales are those of what is sent: m / den
            sent = sent / ctx.frozen_denominators()[0]
        flat["momentum_scale"] = F.momentum_scales(lay.norms(sent), lay.per_layer(lay.whole_numels))
        ctx.exchange.new_error_buffers(flat, lay.device)

    # ------------------------------------------------------------------ elements born after the freeze
    # An element without a gradient before the freeze has v = 0: it sends nothing (its momentum
    # mask is off) until some rank's gradient reaches it, which every rank agrees on before the
    # payloads (``Exchange``); from then on it is exchanged like the others, and its denominator
    # is its own variance, kept fresh from the exchanged momentum (docs/algorithm.md, "Elements
    # born after the freeze"). An element no rank's gradient ever reaches (a padding row) never
    # moves, as under LAMB.
    def inverse_denominator(self, ctx: StepContext) -> torch.Tensor:
        """What the update space divides what it sends by: the frozen denominator's inverse, and for
        the elements without a variance at the freeze the inverse of their layer's typical one
        (``_provisional_inverse``), so that what they send stands beside the rest of their chunk."""
        _, inverse = ctx.frozen_denominators()
        provisional = self._provisional_inverse(ctx)
        numels = torch.tensor(ctx.layout.numels, device=ctx.layout.device)
        return torch.where(ctx.state["exp_avg_sq"] == 0, torch.repeat_interleave(provisional, numels), inverse)

    @staticmethod
    def _provisional_inverse(ctx: StepContext) -> torch.Tensor:
        """Per layer, ``1 / rms(sqrt(v_frozen) + eps)`` over the elements that had a variance at the
        freeze; a layer without any takes the mean of the others' RMS (1 if none has one). Only the
        scale of what those elements send: their updates divide by their own variance. With sharded
        parameters, over this rank's shard of the layer: alike on the shard's replicas, and no
        collective, since a rank may rebuild its caches alone (after a step refused on its shard)."""
        derived, v = ctx.buffers.derived, ctx.state["exp_avg_sq"]
        if derived.get("provisional_source") is not v:
            den, _ = ctx.frozen_denominators()
            had = (v != 0).to(den.dtype)
            rms = ctx.layout.local_norms(den * had) / ctx.layout.local_norms(had)
            defined = ~torch.isnan(rms)  # 0 / 0: no element of the layer had a variance
            fallback = rms[defined].mean() if bool(defined.any()) else rms.new_tensor(1.0)
            derived["provisional_inverse"] = torch.reciprocal(torch.where(defined, rms, fallback))
            derived["provisional_source"] = v
        return derived["provisional_inverse"]

    def waiting(self, ctx: StepContext) -> Optional[Waiting]:
        self._count_waiting(ctx)
        return Waiting(ctx.state["momentum_mask"]) if ctx.buffers.derived["waiting"] else None

    @staticmethod
    def _count_waiting(ctx: StepContext) -> None:
        """How many elements wait, and the indices of those born after the freeze: counted after a
        freeze or a load (one pass), then kept by ``born``."""
        derived, mask = ctx.buffers.derived, ctx.state["momentum_mask"]
        if derived.get("waiting_source") is not mask:
            derived["waiting"] = int((~mask).sum())
            derived["born_late"] = torch.nonzero(mask & (ctx.state["exp_avg_sq"] == 0)).flatten()
            derived["waiting_source"] = mask

    @staticmethod
    def born_after_freeze(flat: Dict[str, Any]) -> int:
        """How many elements were first reached after the freeze (one pass over the state): those
        that send (their mask set) without a frozen variance."""
        return int((flat["momentum_mask"] & (flat["exp_avg_sq"] == 0)).sum())

    def born(self, ctx: StepContext, indices: torch.Tensor, mean_squares: Optional[torch.Tensor]) -> None:
        derived = ctx.buffers.derived
        ctx.state["momentum_mask"][indices] = True
        derived["waiting"] -= indices.numel()
        derived["born_late"] = torch.cat([derived["born_late"], indices])
        layer = ctx.layout.layer_of(indices)
        inverse = self._provisional_inverse(ctx)[layer] if ctx.compresses_update() else None
        ctx.scales_born_(indices, layer, inverse)

    def _born_late(self, ctx: StepContext) -> torch.Tensor:
        self._count_waiting(ctx)
        return ctx.buffers.derived["born_late"]

    def _late_directions_(self, ctx: StepContext, update: torch.Tensor, m: torch.Tensor, m_prev: torch.Tensor,
                          bc1: float, bc2: float) -> bool:
        """Adam's direction of the elements born after the freeze, over their own fresh variance
        (``F.late_directions_``), written into ``update``; whether there were any. Under the rule
        "frozen" the step's pass over every element already brought their variance up to date."""
        late = self._born_late(ctx)
        if late.numel() == 0:
            return False
        beta1, beta2 = ctx.betas()
        F.late_directions_(update, m, m_prev, ctx.state["exp_avg_sq_fresh"], late, beta1, beta2, bc1, bc2,
                           ctx.defaults["eps"], update_variance=self.rule != "frozen")
        return True

    def payload(self, ctx: StepContext, b: Bucket, out: torch.Tensor) -> None:
        """This rank's new momentum of bucket ``b`` (from its own gradient), each layer scaled."""
        beta1, _ = ctx.betas()
        scale, _ = ctx.compression_scales()
        torch.mul(ctx.state["exp_avg"][b.start:b.end], beta1, out=out)
        out.add_(ctx.buffers.grad[b.start:b.end], alpha=1 - beta1)
        out.mul_(scale[b.start:b.end])
        ctx.bound_sent_(out, b)

    def step(self, ctx: StepContext, stage: str, grads: torch.Tensor, received: List[torch.Tensor]) -> None:
        """The averaged momentum, the frozen variance and the rule's coefficient."""
        flat, lay, defaults = ctx.state, ctx.layout, ctx.defaults
        beta1, beta2 = ctx.betas()
        d = lay.numel
        m = flat["exp_avg"]
        m_prev = ctx.buffers.momentum_prev
        m_prev.copy_(m)
        if received:  # the buckets' averages, scaled: undone, and masked, in one pass
            _, unscale = ctx.compression_scales()
            for b, avg in zip(ctx.exchange.buckets, received):
                torch.mul(avg, unscale[b.start:b.end], out=m[b.start:b.end])
        else:  # one process
            m.mul_(beta1).add_(grads, alpha=1 - beta1).mul_(flat["momentum_mask"])
        den, inverse_den = ctx.frozen_denominators()
        bc1, bc2 = self.bias_corrections(ctx)
        update = ctx.buffers.update
        coeff = flat["frozen_coeff"]
        if self.rule == "frozen":
            max_ratio, plain_norms = F.fresh_variance_statistics_(
                flat["exp_avg_sq_fresh"], m, m_prev, den, inverse_den, bc1, bc2, beta1, beta2,
                defaults["eps"], lay.slices, lay.offsets, update, scratch=ctx.buffers.ratio)
            late = self._late_directions_(ctx, update, m, m_prev, bc1, bc2)
            if ctx.bound_direction_(update) or late:
                plain_norms = lay.local_norms(update)
            lay.add_weight_decay_(update, ctx.param_groups)
            update_norms = lay.decayed_update_norms(update, plain_norms, ctx.param_groups)
            # of this rank's shards so far: the whole layers' in one reduction (nothing when whole)
            plain_norms, update_norms, max_ratio = lay.whole([plain_norms, update_norms], [max_ratio])
            factor = F.scaling_factors(max_ratio, plain_norms, update_norms,
                                       lay.hyper(ctx.param_groups, "weight_decay"), flat["prev_factor"],
                                       defaults["factor_min"], defaults["factor_max"], defaults["factor_threshold"])
            flat["prev_factor"] = factor
            coeff = coeff * factor
        else:
            F.adam_direction(m, den, bc1, out=update)
            self._late_directions_(ctx, update, m, m_prev, bc1, bc2)
            ctx.bound_direction_(update)
            lay.add_weight_decay_(update, ctx.param_groups)
            if self.rule == "live":  # LAMB's own ratio, on the exchanged momentum and the frozen variance
                param_norms, update_norms = lay.trust_norms(update)
                coeff, _ = F.trust_ratios(param_norms, update_norms, defaults["min_coeff"], defaults["max_coeff"])
        ctx.apply_(update, coeff)

