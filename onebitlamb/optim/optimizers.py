"""The public optimizers: thin classes over ``StagedOptimizer``; each validates its
hyper-parameters up front and picks an update rule and a freeze schedule. Their docstrings share
the fragments below, as ``torch.optim``'s do, so that one argument reads the same everywhere."""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch

from onebitlamb.compression.wire import warmup_format
from onebitlamb.optim.exchange import ProcessGroupLike, check_bucket_cap
from onebitlamb.optim.freeze import FreezeStep, schedule_for
from onebitlamb.optim.phases import OneBitMomentum, Warmup
from onebitlamb.optim.staged import COMPRESSION_SPACES, TRUST_RATIOS_AFTER_FREEZE, StagedOptimizer, validate_common


def _validate_trust_bounds(min_coeff: float, max_coeff: float) -> None:
    if not 0 <= min_coeff <= max_coeff:
        raise ValueError(f"Invalid trust-ratio bounds: min_coeff={min_coeff!r}, max_coeff={max_coeff!r} "
                         f"(need 0 <= min_coeff <= max_coeff)")


class _OneBit(StagedOptimizer):
    """What the two 1-bit optimizers add to LAMB's machinery: a freeze, and its statistics."""

    def freeze_stats(self) -> Dict[str, Any]:
        """Where the freeze stands, as one dict (like PowerSGD's ``compression_stats()``):

        - ``stage``: the stage the next step runs; ``frozen_at``: the step at whose end the
          freeze happened (None before);
        - ``floor_step``, ``cap_step``: the earliest and latest freeze (both ``freeze_step`` for
          a fixed one);
        - with ``AutoFreeze``, at a step that ran the warm-up (the freeze's own step included):
          ``spread``, how far the least settled layer's ``log ||v_hat||`` moved over the window
          (None until a window is in), ``spread_peak``, its largest so far, and ``levels``, each
          layer's ``log ||v_hat||`` (``-inf`` before its first gradient); for ``OneBitLamb``
          ``trust_rise``, the median layer's rise of its log trust ratio over the window;
        - ``ready_step``, ``trust_peak_step`` (``OneBitLamb`` with ``AutoFreeze``): the step the
          variance criterion first held, and the step the wait for the trust peak then ended.
        """
        return self._phases[0].schedule.stats(self.state.get("flat"))



# ---------------------------------------------------------------------- shared docstring fragments
_PARAMS_DOC = """params: parameters or param groups; groups may differ in ``lr`` and ``weight_decay`` only.
        lr (float, default 1e-3): learning rate."""

_FREEZE_DOC = """freeze_step (int or AutoFreeze, required): an int: the freeze comes at the end of that
            step; ``AutoFreeze(total_steps=...)``: the warm-up decides, between a floor and a cap
            (the recommendation; ``docs/convergence.md``)."""

_ADAM_DOC = """betas (Tuple[float, float], default (0.9, 0.999)): Adam's moment decay rates.
        eps (float, default 1e-8): added to ``sqrt(v_hat)``.
        weight_decay (float, default 0): decoupled weight decay, added to the update
            ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * x`` (before the trust ratio in LAMB)."""

_TRUST_DOC = """max_coeff, min_coeff (float, defaults 10.0 and 0.01): the trust ratio ``||x|| / ||u||``
            is clipped to this range (the paper's scaling function)."""

_BOUND_DOC = """bound_direction (bool, default True): after the freeze, clip each element of Adam's
            direction ``m_hat / (sqrt(v_frozen) + eps)`` to the largest value Adam's own direction
            can take at that step (7.27 in the limit for betas (0.9, 0.999)), so that no element
            moves more than Adam or LAMB could move it. ``False``: the paper's and DeepSpeed's
            rule, under which an element with a tiny frozen variance can take steps thousands of
            times LAMB's. Changes the numbers; part of the state. ``docs/algorithm.md``, "A
            bounded stage 2"."""

_MAXIMIZE_DOC = """maximize (bool, default False): maximize the objective (the gradients' sign flipped),
            as in ``torch.optim``."""

_EXCHANGE_DOC = """How the ranks talk (keyword-only; ``optimizer.exchange`` holds them, ``docs/optimizers.md``):
        process_group (ProcessGroup or NodeGroups, default None: the world): the group to average
            over, or ``onebitlamb.comm.node_groups()`` for several ranks per node
            (``docs/hierarchy.md``).
        warmup_dtype (torch.dtype or name, default {warmup_dtype}): the wire format of the warm-up's
            gradient average: ``torch.bfloat16`` sends half the bytes and rounds the average;
            ``"int8"``, ``"int4"``, ``"int2"`` send blockwise codes (a float32 step per 256
            elements) with error feedback, 3.9x, 7.8x and 15x fewer bytes than float32, the
            rounding carried into the next step (``docs/algorithm.md``, "The warm-up's quantised
            average"; not with ``node_groups()``, ``overlap_with_backward`` or ``register_ddp``).
            ``docs/optimizers.md`` has the measurements. Part of the state: a resume with another
            is refused.
        bucket_cap_mb (float, default None: one bucket): cut the exchange into buckets of at most
            this many MiB of float32 gradient, last parameters first. Each bucket has its own
            compression scale, so the numbers depend on it; part of the state.
        overlap_with_backward (bool, default False): start each bucket's exchange on a thread of
            the optimizer's as soon as the backward has produced its gradients; ``step()`` waits
            for the last. The numbers are those of the serial step over the same buckets, bit for
            bit. The first step copies the process group (every rank's first step is
            collective anyway); with gradient
            accumulation run every backward but the last under ``with optimizer.no_sync():``.
            Not with ``register_ddp``, whose DDP buckets already overlap.
        agree_every (int or None, default 1000): every this many steps the ranks compare, as at
            the first step, a CRC-32 of every parameter and their hyper-parameters (one all-gather
            of about ten int64 per rank, one CRC pass over the parameters: ``docs/optimizers.md``),
            and raise on every rank, naming what differs, if some rank's parameters or lr were
            changed alone; None: at the first step only."""


FUSED_DOC = """fused (bool or None, default None): the 1-bit codec's kernels. None: the fused Triton
            kernels on CUDA parameters when Triton imports (the ``gpu`` extra), else torch ops
            (CPU: compiled loops or numpy); True: the Triton kernels (ValueError here where they
            cannot run); False: never. Same signs either way, scales equal up to rounding
            (``onebitlamb.compression.triton_codec``), so a run may resume with another."""


def _checked_bound_direction(bound_direction: bool) -> bool:
    if not isinstance(bound_direction, bool):
        raise ValueError(f"Invalid bound_direction: {bound_direction!r} (must be True or False)")
    return bound_direction


def _exchange_defaults(warmup_dtype: Union[str, torch.dtype], bucket_cap_mb: Optional[float]) -> Dict[str, Any]:
    """The exchange's settings that change the numbers, as hyper-parameters (``defaults``, saved)."""
    check_bucket_cap(bucket_cap_mb)
    return dict(warmup_dtype=warmup_format(warmup_dtype).name, bucket_cap_mb=bucket_cap_mb)


class Lamb(StagedOptimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, maximize: bool = False, *,
                 process_group: ProcessGroupLike = None, warmup_dtype: Union[torch.dtype, str] = torch.float32,
                 bucket_cap_mb: Optional[float] = None, overlap_with_backward: bool = False,
                 agree_every: Optional[int] = 1000) -> None:
        validate_common(lr, betas, eps, weight_decay, maximize)
        _validate_trust_bounds(min_coeff, max_coeff)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff,
                        maximize=maximize, **_exchange_defaults(warmup_dtype, bucket_cap_mb))
        super().__init__(params, defaults, [Warmup(trust_ratio=True)], process_group=process_group,
                         overlap_with_backward=overlap_with_backward, agree_every=agree_every)


Lamb.__doc__ = fr"""LAMB (You et al., "Large Batch Optimization for Deep Learning", arXiv 1904.00962), with the
    gradients averaged over the process group inside ``step()`` (one all-reduce of one flat buffer,
    or one per bucket; do not wrap the model in DDP without ``register_ddp``).

    Args:
        {_PARAMS_DOC}
        {_ADAM_DOC}
        bias_correction (bool, default True): bias-correct the moments like Adam, as the paper does.
        {_TRUST_DOC}
        {_MAXIMIZE_DOC}

    {_EXCHANGE_DOC.format(warmup_dtype="torch.float32")}

    Deviation from the paper: the trust ratio is 1 where either norm is 0 (a zero-initialised bias,
    a layer without a gradient yet).
    """


class OneBitLamb(_OneBit):
    def __init__(self, params: Iterable, lr: float = 1e-3, *, freeze_step: FreezeStep,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, compression_space: str = "update",
                 trust_ratio_after_freeze: str = "frozen", bound_direction: bool = True, maximize: bool = False,
                 process_group: ProcessGroupLike = None, warmup_dtype: Union[torch.dtype, str] = torch.float32,
                 bucket_cap_mb: Optional[float] = None, overlap_with_backward: bool = False,
                 agree_every: Optional[int] = 1000, fused: Optional[bool] = None) -> None:
        schedule = schedule_for(type(self).__name__, freeze_step, waits_for_trust_peak=True)
        validate_common(lr, betas, eps, weight_decay, maximize)
        _validate_trust_bounds(min_coeff, max_coeff)
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"Invalid coeff_beta: {coeff_beta!r} (must be in [0, 1))")
        if not 0 < factor_min <= factor_max:
            raise ValueError(f"Invalid factor bounds: factor_min={factor_min!r}, factor_max={factor_max!r} "
                             f"(need 0 < factor_min <= factor_max)")
        if not 0.0 <= factor_threshold < 1.0:
            raise ValueError(f"Invalid factor_threshold: {factor_threshold!r} (must be in [0, 1))")
        if compression_space not in COMPRESSION_SPACES:
            raise ValueError(f"Invalid compression_space: {compression_space!r} (must be one of {COMPRESSION_SPACES})")
        if trust_ratio_after_freeze not in TRUST_RATIOS_AFTER_FREEZE:
            raise ValueError(f"Invalid trust_ratio_after_freeze: {trust_ratio_after_freeze!r} "
                             f"(must be one of {TRUST_RATIOS_AFTER_FREEZE})")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff,
                        coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min,
                        factor_threshold=factor_threshold, compression_space=compression_space,
                        trust_ratio_after_freeze=trust_ratio_after_freeze,
                        bound_direction=_checked_bound_direction(bound_direction), maximize=maximize,
                        **_exchange_defaults(warmup_dtype, bucket_cap_mb))
        stage2 = OneBitMomentum(trust_ratio_after_freeze)
        super().__init__(params, defaults, [Warmup(trust_ratio=True, schedule=schedule), stage2],
                         process_group=process_group,
                         overlap_with_backward=overlap_with_backward, agree_every=agree_every, fused=fused)


OneBitLamb.__doc__ = fr"""1-bit LAMB (Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
    with LAMB's Convergence Speed", arXiv 2104.06069).

    Steps ``1..freeze`` are LAMB with full-precision gradient averaging, during which a running
    average of each layer's trust ratio is kept. Then the variance and trust ratio are frozen and
    each step sends only this rank's momentum through the error-compensated 1-bit all-reduce
    (``D/8`` bytes each way instead of ``4d``). A per-layer factor, computed from a variance
    reconstructed from the synchronized momentum, lets each layer's learning rate follow what
    LAMB's trust ratio would have done.

    Args:
        {_PARAMS_DOC}
        {_FREEZE_DOC}
        {_ADAM_DOC}
        bias_correction (bool, default True): bias-correct the moments; ``False`` reproduces
            DeepSpeed's numerics.
        {_TRUST_DOC}
        coeff_beta (float, default 0.9): decay rate of the trust ratio's running average that the
            freeze keeps.
        factor_max, factor_min (float, defaults 4.0 and 0.5): bounds of stage 2's per-layer factor.
        factor_threshold (float, default 0.1): how far the factor may move in one step (relative).
        compression_space (str, default "update"): what stage 2 sends through the 1-bit
            all-reduce: ``"update"`` (the momentum divided by the frozen ``sqrt(v) + eps``, undone
            after the exchange; the same bytes), so that the 1-bit code's one magnitude per chunk
            lands on Adam's direction, whose elements are alike, rather than on the momentum, where
            it gives elements with a small variance large steps; or ``"momentum"`` (the paper's
            and DeepSpeed's: each layer's momentum, scaled to a common RMS). Changes the numbers;
            part of the state. ``docs/algorithm.md``, "Stage 2's fidelity to LAMB".
        {_BOUND_DOC}
        trust_ratio_after_freeze (str, default "frozen"): the layer-wise coefficient of stage 2:
            ``"frozen"`` (the paper's: the trust ratio kept at the freeze times the per-layer
            factor) or ``"live"`` (LAMB's ``clip(||x|| / ||u||)`` every step, ``u`` from the
            exchanged momentum and the frozen variance; no factor). Changes
            the numbers; part of the state.
        {_MAXIMIZE_DOC}

    {_EXCHANGE_DOC.format(warmup_dtype="torch.float32")}
        {FUSED_DOC}

    Deviations from the paper and from DeepSpeed's ``OnebitLamb``: no discarded first step;
    ``bias_correction`` honoured; the trust ratio's running average is bias-corrected; each
    layer's momentum is scaled to a common RMS before compression; elements that never had a
    gradient are masked; the error buffers are part of ``state_dict()``; parameters may be
    bf16/fp16 (the state is fp32); the freeze step may be automatic. ``docs/algorithm.md``.
    """


class OneBitAdam(_OneBit):
    def __init__(self, params: Iterable, lr: float = 1e-3, *, freeze_step: FreezeStep,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, bound_direction: bool = True, maximize: bool = False,
                 process_group: ProcessGroupLike = None, warmup_dtype: Union[torch.dtype, str] = torch.float32,
                 bucket_cap_mb: Optional[float] = None, overlap_with_backward: bool = False,
                 agree_every: Optional[int] = 1000, fused: Optional[bool] = None) -> None:
        schedule = schedule_for(type(self).__name__, freeze_step, waits_for_trust_peak=False)
        validate_common(lr, betas, eps, weight_decay, maximize)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, bound_direction=_checked_bound_direction(bound_direction),
                        maximize=maximize, **_exchange_defaults(warmup_dtype, bucket_cap_mb))
        super().__init__(params, defaults, [Warmup(trust_ratio=False, schedule=schedule), OneBitMomentum("adam")],
                         process_group=process_group,
                         overlap_with_backward=overlap_with_backward, agree_every=agree_every, fused=fused)


OneBitAdam.__doc__ = fr"""1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
    Adam's Convergence Speed", arXiv 2102.02888) on the same machinery as ``OneBitLamb``: Adam with
    full-precision gradient averaging until the freeze, then a frozen variance and the momentum
    sent through the error-compensated 1-bit all-reduce.

    Args:
        {_PARAMS_DOC}
        {_FREEZE_DOC}
        {_ADAM_DOC}
        bias_correction (bool, default True): bias-correct the moments.
        {_BOUND_DOC}
        {_MAXIMIZE_DOC}

    {_EXCHANGE_DOC.format(warmup_dtype="torch.float32")}
        {FUSED_DOC}

    Deviations from the paper: those of ``OneBitLamb`` that apply (no discarded step, per-layer
    momentum scaling, masking, saved error buffers, fp32 state, automatic freeze).
    """
