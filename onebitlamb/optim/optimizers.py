"""The public optimizers: thin classes over ``StagedOptimizer``; each validates its
hyper-parameters up front and picks an update rule."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch.distributed as dist

from onebitlamb.optim.staged import StagedOptimizer, validate_common


COMPRESSION_SPACES = ("momentum", "update")
# which layers' trust ratios the wait for their peak reads (StagedOptimizer._record_warmup)
TRUST_PEAK_LAYERS = ("all", "unclipped")
# how it judges that they have stopped rising (functional.trust_rise)
TRUST_PEAK_MEASURES = ("median_rise", "median_level")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _onebit_options(cls_name: str, freeze_step, min_freeze_step, max_freeze_step, freeze_window,
                    freeze_tolerance, freeze_transient, freeze_transient_end, compression_space,
                    update_guard, unfreeze_rise) -> Dict[str, Any]:
    """Validate what 1-bit LAMB and 1-bit Adam share: when to freeze, where to compress, the guard."""
    if freeze_step is None:
        raise ValueError(
            f"{cls_name} needs freeze_step: the number of warm-up steps with full communication "
            f"before the variance and trust ratio are frozen and the momentum is sent in 1 bit. "
            f"The paper's guidance is 15-25% of the total steps (small models may need more, see "
            f"docs/optimizers.md), or freeze_step='auto' with max_freeze_step")
    if freeze_step == "auto":
        if not _is_int(max_freeze_step) or max_freeze_step < 1:
            raise ValueError(f"freeze_step='auto' needs max_freeze_step, the latest step to freeze at "
                             f"(an integer >= 1, e.g. 35% of the total steps), got {max_freeze_step!r}")
        if not _is_int(min_freeze_step) or not 1 <= min_freeze_step <= max_freeze_step:
            raise ValueError(f"Invalid min_freeze_step: {min_freeze_step!r} (must be an integer in "
                             f"[1, max_freeze_step={max_freeze_step}])")
        if not _is_int(freeze_window) or freeze_window < 1:
            raise ValueError(f"Invalid freeze_window: {freeze_window!r} (must be an integer >= 1)")
        if not isinstance(freeze_tolerance, (int, float)) or not freeze_tolerance > 0:
            raise ValueError(f"Invalid freeze_tolerance: {freeze_tolerance!r} (must be > 0)")
        if freeze_transient is not None and (not isinstance(freeze_transient, (int, float))
                                             or not freeze_transient > 0):
            raise ValueError(f"Invalid freeze_transient: {freeze_transient!r} (None, or a number > 0)")
        if freeze_transient_end is not None and (
                not isinstance(freeze_transient_end, (int, float)) or not freeze_transient_end > 0
                or (freeze_transient is not None and not freeze_transient_end < freeze_transient)):
            raise ValueError(f"Invalid freeze_transient_end: {freeze_transient_end!r} (None, or a number > 0 "
                             f"and below freeze_transient={freeze_transient!r})")
    elif not _is_int(freeze_step) or freeze_step < 1:
        raise ValueError(f"Invalid freeze_step: {freeze_step!r} (must be an integer >= 1 or 'auto')")
    if unfreeze_rise is not None:
        if freeze_step != "auto":
            raise ValueError(f"unfreeze_rise={unfreeze_rise!r} needs freeze_step='auto' (after an undone freeze "
                             f"the automatic criterion decides the next one), got freeze_step={freeze_step!r}")
        if not isinstance(unfreeze_rise, (int, float)) or not unfreeze_rise > 0 or not math.isfinite(unfreeze_rise):
            raise ValueError(f"Invalid unfreeze_rise: {unfreeze_rise!r} (None, or a finite number > 0)")
    if compression_space not in COMPRESSION_SPACES:
        raise ValueError(f"Invalid compression_space: {compression_space!r} (one of {COMPRESSION_SPACES})")
    if update_guard is not None and (not isinstance(update_guard, (int, float)) or not update_guard >= 1):
        raise ValueError(f"Invalid update_guard: {update_guard!r} (None, or a number >= 1)")
    return dict(min_freeze_step=min_freeze_step, max_freeze_step=max_freeze_step, freeze_window=freeze_window,
                freeze_tolerance=freeze_tolerance, freeze_transient=freeze_transient,
                freeze_transient_end=freeze_transient_end,
                compression_space=compression_space, update_guard=update_guard, unfreeze_rise=unfreeze_rise)


def _validate_lamb(min_coeff: float, max_coeff: float) -> None:
    if not 0 <= min_coeff <= max_coeff:
        raise ValueError(f"Invalid trust-ratio bounds: min_coeff={min_coeff!r}, max_coeff={max_coeff!r} "
                         f"(need 0 <= min_coeff <= max_coeff)")


class Lamb(StagedOptimizer):
    r"""LAMB (You et al., arXiv 1904.00962): Adam's direction scaled per layer by the trust ratio
    ``clip(||x|| / ||u||, min_coeff, max_coeff)``, with the gradients averaged over the process
    group inside ``step()`` (one all-reduce of one flat buffer; do not wrap the model in DDP).

    Weight decay is added to the update before the trust ratio (decoupled, as in the paper). With
    ``bias_correction=True`` the moments are bias-corrected like Adam's.
    """

    _layerwise, _fresh_variance = True, False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_coeff: float = 10.0, min_coeff: float = 0.01,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        validate_common(lr, betas, eps, weight_decay)
        _validate_lamb(min_coeff, max_coeff)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, freeze_step=None, process_group=process_group)


class OneBitLamb(StagedOptimizer):
    r"""1-bit LAMB (Li et al., arXiv 2104.06069), as specified in ALGORITHM.md.

    Steps ``1..freeze_step`` are LAMB with full-precision gradient averaging, during which a
    moving average of each layer's trust ratio is kept. Then the variance and trust ratio are
    frozen and each step sends only this rank's momentum through the error-compensated 1-bit
    all-reduce (``D/8`` bytes each way instead of ``4d``). A per-layer factor, computed from a
    variance reconstructed from the synchronized momentum, lets each layer's learning rate
    follow what LAMB's trust ratio would have done.

    Differences from DeepSpeed's ``OnebitLamb``: no discarded first step; ``bias_correction`` is
    honoured (``False`` reproduces DeepSpeed's numerics); the coefficient average is
    bias-corrected; elements that never had a gradient are masked automatically; the error
    buffers are saved in ``state_dict()``; parameters may be bf16/fp16 (the state is fp32).
    """

    _layerwise, _fresh_variance = True, True

    def __init__(self, params: Iterable, lr: float = 1e-3, *, freeze_step: Union[int, str, None] = None,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, compression_space: str = "momentum",
                 update_guard: Optional[float] = None, min_freeze_step: int = 1,
                 max_freeze_step: Optional[int] = None, freeze_window: int = 20,
                 freeze_tolerance: float = 0.3, freeze_transient: Optional[float] = 5.0,
                 freeze_transient_end: Optional[float] = 2.5, unfreeze_rise: Optional[float] = None,
                 freeze_after_trust_peak: Optional[bool] = None, trust_peak_layers: str = "all",
                 trust_peak_measure: str = "median_rise",
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        onebit = _onebit_options(type(self).__name__, freeze_step, min_freeze_step, max_freeze_step,
                                 freeze_window, freeze_tolerance, freeze_transient, freeze_transient_end,
                                 compression_space, update_guard, unfreeze_rise)
        if freeze_after_trust_peak is not None and not isinstance(freeze_after_trust_peak, bool):
            raise ValueError(f"Invalid freeze_after_trust_peak: {freeze_after_trust_peak!r} (None, True or False)")
        if freeze_after_trust_peak and freeze_step != "auto":
            raise ValueError(f"freeze_after_trust_peak=True needs freeze_step='auto' (it delays the automatic "
                             f"freeze), got freeze_step={freeze_step!r}")
        if freeze_after_trust_peak is None:  # on wherever it can act: with the automatic freeze
            freeze_after_trust_peak = freeze_step == "auto"
        if trust_peak_layers not in TRUST_PEAK_LAYERS:
            raise ValueError(f"Invalid trust_peak_layers: {trust_peak_layers!r} (one of {', '.join(TRUST_PEAK_LAYERS)})")
        if trust_peak_measure not in TRUST_PEAK_MEASURES:
            raise ValueError(f"Invalid trust_peak_measure: {trust_peak_measure!r} "
                             f"(one of {', '.join(TRUST_PEAK_MEASURES)})")
        validate_common(lr, betas, eps, weight_decay)
        _validate_lamb(min_coeff, max_coeff)
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"Invalid coeff_beta: {coeff_beta!r} (must be in [0, 1))")
        if not 0 < factor_min <= factor_max:
            raise ValueError(f"Invalid factor bounds: factor_min={factor_min!r}, factor_max={factor_max!r} "
                             f"(need 0 < factor_min <= factor_max)")
        if not 0.0 <= factor_threshold < 1.0:
            raise ValueError(f"Invalid factor_threshold: {factor_threshold!r} (must be in [0, 1))")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff,
                        coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min,
                        factor_threshold=factor_threshold, freeze_after_trust_peak=freeze_after_trust_peak,
                        trust_peak_layers=trust_peak_layers, trust_peak_measure=trust_peak_measure,
                        **onebit)
        super().__init__(params, defaults, freeze_step=freeze_step, process_group=process_group)


class OneBitAdam(StagedOptimizer):
    r"""1-bit Adam (Tang et al., arXiv 2102.02888) in the same framework as ``OneBitLamb``:
    Adam with full-precision gradient averaging for ``freeze_step`` steps, then a frozen
    variance and the momentum sent through the error-compensated 1-bit all-reduce. Weight decay
    is added to the update (``u = m_hat / (sqrt(v) + eps) + wd * x``), as in LAMB.
    """

    _layerwise, _fresh_variance = False, False

    def __init__(self, params: Iterable, lr: float = 1e-3, *, freeze_step: Union[int, str, None] = None,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 bias_correction: bool = True, compression_space: str = "momentum",
                 update_guard: Optional[float] = None, min_freeze_step: int = 1,
                 max_freeze_step: Optional[int] = None, freeze_window: int = 20,
                 freeze_tolerance: float = 0.3, freeze_transient: Optional[float] = 5.0,
                 freeze_transient_end: Optional[float] = 2.5, unfreeze_rise: Optional[float] = None,
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        onebit = _onebit_options(type(self).__name__, freeze_step, min_freeze_step, max_freeze_step,
                                 freeze_window, freeze_tolerance, freeze_transient, freeze_transient_end,
                                 compression_space, update_guard, unfreeze_rise)
        validate_common(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, **onebit)
        super().__init__(params, defaults, freeze_step=freeze_step, process_group=process_group)
