"""0/1 Adam (Lu, Li, Zhang, De Sa, He, "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", arXiv 2202.06009) on the staged machinery: fewer rounds, not only fewer bits.

Two phases, each counted from the optimizer's own first step ``s`` (``docs/algorithm.md``):

- the variance phase, ``s <= var_freeze_step``: a step is a *variance step* (``s`` a multiple of
  the variance interval) that averages the gradients in full precision and updates both moments,
  or a *1-bit step* that averages the ranks' momenta with the error-compensated 1-bit all-reduce
  (DeepSpeed's rule: their gradients, into the momentum) and leaves the variance. The interval
  doubles after every ``var_update_scaler`` variance updates.
- after it (the variance frozen, the compression errors restarted): *local steps*, each rank
  moving its own parameters with its own momentum and summing what it moved them by; every
  ``local_interval`` steps a *sync* averages that sum with the 1-bit all-reduce, sets the
  parameters to the last sync's plus the average, the same on every rank, and the momentum to
  the average per unit of learning rate. The interval doubles every ``local_step_scaler``
  steps, up to ``local_step_clipper`` (``local_steps.py``).

The stages of ``StagedOptimizer`` name what a step exchanges: ``WARMUP`` (a full-precision
average: the variance steps), ``COMPRESSION`` (a 1-bit all-reduce: the 1-bit steps and the syncs)
and ``LOCAL`` (only the agreed check that every rank's gradient is finite).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from onebitlamb.comm import rank_of, world_size_of
from onebitlamb.optim import functional as F
from onebitlamb.optim.context import StepContext
from onebitlamb.optim.exchange import ProcessGroupLike
from onebitlamb.optim.layout import Bucket, FlatLayout
from onebitlamb.optim.local_steps import LocalSteps
from onebitlamb.optim.phases import COMPRESSION, WARMUP, Phase
from onebitlamb.optim.optimizers import (_ADAM_DOC, _BOUND_DOC, _EXCHANGE_DOC, _MAXIMIZE_DOC, _PARAMS_DOC, FUSED_DOC,
                                         _checked_bound_direction, _exchange_defaults)
from onebitlamb.optim.staged import COMPRESSION_SPACES, StagedOptimizer, validate_common

StepsOrFraction = Union[int, float]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def steps_of(name: str, value: Any, total_steps: Optional[int]) -> int:
    """A schedule value as a number of steps: an int >= 1 as it is, a float in (0, 1] as that
    fraction of ``total_steps`` (rounded, at least 1)."""
    if _is_int(value):
        if value < 1:
            raise ValueError(f"Invalid {name}: {value!r} (must be a number of steps >= 1, or a fraction of "
                             f"total_steps in (0, 1] given as a float)")
        return value
    if isinstance(value, float) and math.isfinite(value):
        if not 0 < value <= 1:
            raise ValueError(f"Invalid {name}: {value!r} (a fraction of total_steps must be in (0, 1]; pass an "
                             f"int for a number of steps)")
        if total_steps is None:
            raise ValueError(f"Invalid {name}: {value!r} is a fraction of the run; pass total_steps=... as well")
        return max(1, round(value * total_steps))
    raise ValueError(f"Invalid {name}: {value!r} (must be a number of steps >= 1, or a fraction of total_steps in "
                     f"(0, 1] given as a float)")


class VarianceThinning(Phase):
    """0/1 Adam's first phase: variance steps (the gradients averaged in full precision into both
    moments) on an interval that doubles every ``var_update_scaler`` updates, and between them
    1-bit steps (the ranks' momenta averaged by the 1-bit all-reduce, or in DeepSpeed's rule their
    gradients, into the momentum) over the variance as it stands. It ends at ``var_freeze_step``."""

    compresses_from_start = True

    def init_state(self, ctx: StepContext, layout: FlatLayout) -> None:
        # those entries that differ between ranks from the freeze on are saved under the rank's key
        d, layers = layout.numel, len(layout.params)
        ctx.state.update({
            "variance_updates": 0, "var_interval": 1, "var_counter": 0,
            "momentum_scale": torch.ones(layers, dtype=torch.float32, device=layout.device),
            "momentum_mask": torch.zeros(d, dtype=torch.bool, device=layout.device),
        })
        ctx.exchange.new_error_buffers(ctx.state, layout.device)

    def setup(self, ctx: StepContext, layout: FlatLayout, setup: Dict[str, Any]) -> None:
        flat = ctx.state
        setup["schedule (var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)"] = tuple(
            ctx.defaults[k] for k in ("var_freeze_step", "var_update_scaler", "local_step_scaler",
                                      "local_step_clipper"))
        setup["0/1 Adam schedule (var_interval, var_counter, variance_updates, local_interval, local_counter)"] = (
            flat["var_interval"], flat["var_counter"], flat["variance_updates"], flat["local_interval"],
            flat["local_counter"])

    def stage(self, ctx: StepContext) -> str:
        """A variance step (the full-precision average) or a 1-bit step."""
        flat = ctx.state
        return WARMUP if (flat["step"] + 1) % flat["var_interval"] == 0 else COMPRESSION

    def ends(self, ctx: StepContext) -> bool:
        return ctx.state["step"] == ctx.defaults["var_freeze_step"]

    def bias_corrections(self, ctx: StepContext) -> tuple[float, float]:
        """``1 - beta1^s`` and ``1 - beta2^k``, ``k`` the variance updates so far: the variance is an
        average over those alone."""
        if not ctx.defaults["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = ctx.betas()
        return 1 - beta1 ** ctx.state["step"], 1 - beta2 ** ctx.state["variance_updates"]

    def _adam_denominator(self, ctx: StepContext) -> torch.Tensor:
        """``sqrt(v_hat) + eps`` as the next update will use it: the variance as it stands (it
        changes at variance steps only)."""
        _, bc2 = self.bias_corrections(ctx)
        return F.adam_denominator(ctx.state["exp_avg_sq"], bc2, ctx.defaults["eps"],
                                  out=ctx.buffers.variance_denominator)

    def inverse_denominator(self, ctx: StepContext) -> torch.Tensor:
        """The denominator moves with every variance step, and the update space divides by it as it
        stands (the staged optimizers' scales are rebuilt then: the layer scales are replaced at
        every variance step)."""
        return torch.reciprocal(self._adam_denominator(ctx))

    def _layer_scales(self, ctx: StepContext, sent: torch.Tensor) -> torch.Tensor:
        """Each layer's ``k_l`` from the size of what a 1-bit step will send (the momentum, or the
        gradient), over Adam's denominator in the update space."""
        lay = ctx.layout
        if ctx.compresses_update():
            sent = sent / self._adam_denominator(ctx)
        return F.momentum_scales(lay.norms(sent), lay.per_layer(lay.whole_numels))

    def payload(self, ctx: StepContext, b: Bucket, out: torch.Tensor) -> None:
        """At a 1-bit step this rank's momentum (or its gradient in DeepSpeed's rule), each layer
        scaled, and in the update space divided by Adam's denominator."""
        flat = ctx.state
        scale, _ = ctx.compression_scales()
        grad = ctx.buffers.grad[b.start:b.end]
        if ctx.compresses_update():
            beta1, _ = ctx.betas()
            torch.mul(flat["exp_avg"][b.start:b.end], beta1, out=out)
            out.add_(grad, alpha=1 - beta1).mul_(scale[b.start:b.end])
            ctx.bound_sent_(out, b)
        else:
            torch.mul(grad, scale[b.start:b.end], out=out)

    # ------------------------------------------------------------------ the errors across a variance step
    @staticmethod
    def _scales_of_the_errors(ctx: StepContext) -> Optional[torch.Tensor]:
        """Per element, the scale the carried compression errors are in: what the last 1-bit step
        multiplied its values by (``k_l``, over Adam's denominator in the update space); None with
        one process (no errors)."""
        if "worker_error" not in ctx.state:
            return None
        return ctx.compression_scales()[0].clone()

    @staticmethod
    def _rescale_errors_(ctx: StepContext, before: Optional[torch.Tensor]) -> None:
        """After a variance step changed the scales (``k_l``, and the denominator in the update
        space), the errors the 1-bit steps carry are brought into the new ones: each element's times
        its new scale over its old. An error is what an earlier exchange left unsent of the scaled
        values; the next exchange adds it to values scaled anew and divides the result by the new
        scale, so left as it was it would come back in another unit: the error feedback would no
        longer return what was left out (DeepSpeed compresses each tensor's gradient unscaled, and
        its errors keep their unit). A masked element (scale 0) keeps its error, as does any element
        whose scale was not finite. The padding has no scale of its own: its error is what the
        bucket's 1-bit scale left there, in the unit of the bucket's values, so it takes the mean
        ratio of the bucket's elements (exactly their unit when the bucket holds one layer, as
        DeepSpeed's tensors are compressed). With a hierarchical group a rank holds the errors of
        its local rank's chunk of each bucket (worker) and of its node's part of that chunk
        (server)."""
        if before is None:
            return
        after, _ = ctx.compression_scales()
        # (before the first variance update the update space's scale is not finite: 0 / 0)
        kept = torch.isfinite(before) & torch.isfinite(after) & (before != 0) & (after != 0)
        ratio = torch.where(kept, after / torch.where(kept, before, torch.ones_like(before)), torch.ones_like(after))
        flat, group = ctx.state, ctx.process_group
        n, local = world_size_of(group), ctx.exchange.local_size
        chunk_of_worker, chunk_of_server = (group.local_rank, group.node) if local > 1 else (0, rank_of(group))
        for b in ctx.exchange.buckets:
            padded = b.comm.stop - b.comm.start
            full = torch.ones(padded, dtype=ratio.dtype, device=ratio.device)
            full[:b.numel] = ratio[b.start:b.end]
            mine = kept[b.start:b.end]
            full[b.numel:] = torch.where(mine.any(), (ratio[b.start:b.end] * mine).sum() / mine.sum().clamp(min=1),
                                         torch.ones((), dtype=ratio.dtype, device=ratio.device))
            worker = full.view(local, -1)[chunk_of_worker]
            flat["worker_error"][b.worker].mul_(worker)
            flat["server_error"][b.server].mul_(worker.view(n // local, -1)[chunk_of_server])

    def step(self, ctx: StepContext, stage: str, grads: torch.Tensor, received: List[torch.Tensor]) -> None:
        """A variance step (the averaged gradient into both moments) or a 1-bit step (the 1-bit
        average of the ranks' momenta, or in DeepSpeed's rule of the gradients into the momentum),
        then Adam's update with the variance as it stands."""
        flat, lay = ctx.state, ctx.layout
        beta1, beta2 = ctx.betas()
        m, v = flat["exp_avg"], flat["exp_avg_sq"]
        if stage == WARMUP:
            carried = self._scales_of_the_errors(ctx)
            F.update_moments_(m, v, grads, beta1, beta2)
            flat["variance_updates"] += 1
            flat["var_interval"], flat["var_counter"] = F.interval_after(
                flat["var_interval"], flat["var_counter"], ctx.defaults["var_update_scaler"])
            # the per-layer scales follow what the 1-bit steps send: the momentum, or DeepSpeed's
            # gradient (whose layers are in other proportions: the noise averages out of the
            # momentum); elements that never had a gradient at a variance step stay masked (1-bit
            # signs cannot send a 0)
            flat["momentum_scale"] = self._layer_scales(ctx, m if ctx.compresses_update() else grads)
            flat["momentum_mask"] = v != 0
            self._rescale_errors_(ctx, carried)  # the errors the 1-bit steps carry, into the new scales
        elif ctx.compresses_update():  # each rank's momentum, averaged as 1-bit Adam's stage 2 does
            local = ctx.buffers.local_momentum
            torch.mul(m, beta1, out=local).add_(grads, alpha=1 - beta1)
            m.copy_(ctx.unscaled(received, local))
        else:  # DeepSpeed's: the 1-bit average of the gradients into the momentum
            m.mul_(beta1).add_(ctx.unscaled(received, grads), alpha=1 - beta1)
        bc1, bc2 = self.bias_corrections(ctx)
        update = ctx.buffers.update
        den = F.adam_denominator(v, bc2, ctx.defaults["eps"], out=update)
        F.adam_direction(m, den, bc1, out=update)
        if stage != WARMUP:  # the 1-bit average over a variance that is not this step's
            ctx.bound_direction_(update)
        lay.add_weight_decay_(update, ctx.param_groups)
        ctx.apply_(update, lay.ones())


class ZeroOneAdam(StagedOptimizer):

    def __init__(self, params: Iterable, lr: float = 1e-3, *, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 var_freeze_step: StepsOrFraction, var_update_scaler: int = 16,
                 local_step_scaler: StepsOrFraction = 32678, local_step_clipper: int = 16,
                 total_steps: Optional[int] = None, compression_space: str = "update", bound_direction: bool = True,
                 maximize: bool = False,
                 process_group: ProcessGroupLike = None, warmup_dtype: Union[torch.dtype, str] = torch.float32,
                 bucket_cap_mb: Optional[float] = None, overlap_with_backward: bool = False,
                 agree_every: Optional[int] = 1000, fused: Optional[bool] = None) -> None:
        validate_common(lr, betas, eps, weight_decay, maximize)
        if not isinstance(bias_correction, bool):
            raise ValueError(f"Invalid bias_correction: {bias_correction!r} (must be True or False)")
        if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
            raise ValueError(f"Invalid total_steps: {total_steps!r} (must be None or an integer >= 1)")
        freeze = steps_of("var_freeze_step", var_freeze_step, total_steps)
        if total_steps is not None and freeze > total_steps:
            raise ValueError(f"Invalid var_freeze_step: {var_freeze_step!r} is beyond the run of total_steps="
                             f"{total_steps} steps (the variance would never freeze and no local step be taken)")
        for name, value in (("var_update_scaler", var_update_scaler), ("local_step_clipper", local_step_clipper)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= 1)")
        scaler = steps_of("local_step_scaler", local_step_scaler, total_steps)
        if compression_space not in COMPRESSION_SPACES:
            raise ValueError(f"Invalid compression_space: {compression_space!r} (must be one of {COMPRESSION_SPACES})")
        if overlap_with_backward:
            raise ValueError("Invalid overlap_with_backward: True (ZeroOneAdam exchanges in step(); its local steps "
                             "send nothing to overlap, and its syncs need the step's update first)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, var_freeze_step=freeze, var_update_scaler=var_update_scaler,
                        local_step_scaler=scaler, local_step_clipper=local_step_clipper,
                        compression_space=compression_space,
                        bound_direction=_checked_bound_direction(bound_direction), maximize=maximize,
                        **_exchange_defaults(warmup_dtype, bucket_cap_mb))
        super().__init__(params, defaults, [VarianceThinning(), LocalSteps()], process_group=process_group,
                         overlap_with_backward=overlap_with_backward, agree_every=agree_every, fused=fused)

    def freeze_stats(self) -> Dict[str, Any]:
        """Where the schedules stand: ``stage`` (the next step's), ``frozen_at`` (the step at whose
        end the variance froze, None before), ``floor_step`` and ``cap_step`` (both
        ``var_freeze_step``), ``variance_updates``, ``var_interval`` and ``local_interval``."""
        flat = self.state.get("flat")
        step = self.defaults["var_freeze_step"]
        out = {"stage": self.stage, "frozen_at": None, "floor_step": step, "cap_step": step}
        if flat is not None:
            out.update(frozen_at=flat["frozen_at"], variance_updates=flat["variance_updates"],
                       var_interval=flat["var_interval"], local_interval=flat["local_interval"])
        return out


ZeroOneAdam.__doc__ = fr"""0/1 Adam (Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1
    Adam", arXiv 2202.06009), with DeepSpeed's argument names. Fewer rounds as well as fewer bits:
    the variance is refreshed with a full-precision average on an exponentially thinning
    schedule only, every other step sends the error-compensated 1-bit average of the gradients,
    and after ``var_freeze_step`` the ranks take local steps and synchronise what they moved by
    with the 1-bit all-reduce every ``local_interval`` steps (between syncs the ranks'
    parameters differ; each rank's state and parameters are its own). ``docs/algorithm.md`` has
    the rule and each departure from DeepSpeed's ``ZeroOneAdam``.

    Args:
        {_PARAMS_DOC}
        {_ADAM_DOC}
        bias_correction (bool, default True): bias-correct the momentum by the steps taken and the
            variance by its updates; ``False`` reproduces DeepSpeed's numerics.
        var_freeze_step (int or float, required): the variance phase's last step; a float in
            (0, 1]: that fraction of ``total_steps``.
        var_update_scaler (int, default 16): variance updates between two doublings of the
            variance interval (the paper's kappa).
        local_step_scaler (int or float, default 32678): steps after the freeze between two
            doublings of the local-step interval; a float in (0, 1]: that fraction of
            ``total_steps`` (DeepSpeed's default is sized for runs of ~10^5 steps).
        local_step_clipper (int, default 16): the largest local-step interval (the paper's H).
        total_steps (int, default None): the run's length, which fractional schedule values refer
            to and ``var_freeze_step`` must not exceed.
        compression_space (str, default "update"): what the 1-bit all-reduce compresses:
            ``"update"`` (at a 1-bit step each rank's momentum ``b1 m + (1-b1) g_i``, at a sync its
            update sum, divided by Adam's denominator as it stands, undone after the exchange; the
            same bytes), so that the 1-bit code's one magnitude per chunk lands on Adam's
            direction rather than giving the elements with a small variance large steps; or
            ``"momentum"`` (DeepSpeed's rule: the gradient, whose 1-bit average goes into the
            momentum, and the update sum times the denominator). Changes the numbers; part of the
            state. ``docs/algorithm.md``.
        {_BOUND_DOC}
        {_MAXIMIZE_DOC}

    {_EXCHANGE_DOC.format(warmup_dtype="torch.float32")}
        {FUSED_DOC}
        ``overlap_with_backward=True`` is refused: a sync needs the step's update first.
    """
