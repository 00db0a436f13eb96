"""The maths of LAMB, 1-bit LAMB and 1-bit Adam on flat buffers and per-layer vectors.

Pure functions: no process groups, no optimizer state. ``staged.py`` decides which of them a
step runs; the tests check them through the optimizers against a reference of the algorithm
written separately (``tests/reference.py``). Per-layer quantities are float32 vectors with one entry per parameter tensor.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from onebitlamb.optim import native


def update_moments_(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float) -> None:
    """Adam's moments in place: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``."""
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def adam_direction(m: torch.Tensor, denominator: torch.Tensor, bias_correction1: float,
                   out: torch.Tensor) -> torch.Tensor:
    """``out = (m / bias_correction1) / denominator``: Adam's update before weight decay."""
    torch.div(m, denominator, out=out)
    if bias_correction1 != 1.0:
        out.div_(bias_correction1)
    return out


def adam_denominator(v: torch.Tensor, bias_correction2: float, eps: float, out: torch.Tensor) -> torch.Tensor:
    """``out = sqrt(v / bias_correction2) + eps``."""
    torch.div(v, bias_correction2, out=out) if bias_correction2 != 1.0 else out.copy_(v)
    return out.sqrt_().add_(eps)


def adam_direction_bound(beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` Adam's moments can give at step ``step``, whatever
    the gradients were (``docs/algorithm.md``, "A bounded stage 2").

    With ``m_t = (1-b1) sum_k b1^k g_(t-k)`` and ``v_t = (1-b2) sum_k b2^k g_(t-k)^2`` (k < t),
    Cauchy-Schwarz on ``b1^k g = (b1^k / b2^(k/2)) (b2^(k/2) g)`` gives
    ``|m_t| <= (1-b1) / sqrt(1-b2) * sqrt((1 - r^t) / (1 - r)) * sqrt(v_t)`` with
    ``r = b1^2 / b2``; bias correction multiplies the ratio by ``sqrt(1-b2^t) / (1-b1^t)``. The
    bound is reached (by gradients growing as ``(b1/b2)^-k``), so it is Adam's own limit, not a
    tuning: with bias correction 1 at step 1, about 1.3 at step 30, 4.6 at 512 and 7.27 in the
    limit for ``(0.9, 0.999)``. Infinite where ``b1^2 >= b2``: no bound exists there.
    """
    if beta1 == 0.0:
        return 1.0 if bias_correction else 1.0 / math.sqrt(1 - beta2)
    r = beta1 * beta1 / beta2 if beta2 > 0 else math.inf
    if r >= 1.0:
        return math.inf
    bound = (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt((1 - r ** step) / (1 - r))
    if bias_correction:
        bound *= math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    return bound


def clip_direction_(update: torch.Tensor, bound: float) -> None:
    """Each element of Adam's direction into ``[-bound, bound]`` (stage 2's bounded step)."""
    if math.isfinite(bound):
        update.clamp_(-bound, bound)


def norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Euclidean norm of each tensor, computed and returned in float32, as one vector."""
    if not tensors:
        return torch.zeros(0)
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors])


def trust_ratios(param_norms: torch.Tensor, update_norms: torch.Tensor, min_coeff: float,
                 max_coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LAMB's layer-wise ``c = clip(||x|| / ||u||, min_coeff, max_coeff)``.

    Returns ``(c, defined)``: where either norm is 0 the ratio means nothing (a zero-initialised
    bias, a layer with no gradient yet), so ``c = 1`` there and ``defined`` is False, which keeps
    such steps out of the running average that becomes the frozen coefficient.
    """
    defined = (param_norms > 0) & (update_norms > 0)
    ratio = (param_norms / torch.where(defined, update_norms, torch.ones_like(update_norms)))
    ratio = ratio.clamp(min_coeff, max_coeff)
    return torch.where(defined, ratio, torch.ones_like(ratio)), defined


def update_ema_(ema: torch.Tensor, count: torch.Tensor, value: torch.Tensor, defined: torch.Tensor,
                beta: float) -> None:
    """Per-layer moving average over the steps where the value was defined (the trust ratio's
    becomes the frozen coefficient)."""
    blended = ema * beta + value * (1 - beta)
    ema.copy_(torch.where(defined, blended, ema))
    count.add_(defined.to(count.dtype))


def corrected_ema(ema: torch.Tensor, count: torch.Tensor, beta: float) -> torch.Tensor:
    """The average bias-corrected like Adam's moments (docs/algorithm.md); 1 with no update."""
    correction = 1 - torch.pow(torch.tensor(beta, dtype=ema.dtype), count.to(ema.dtype))
    return torch.where(count > 0, ema / torch.where(count > 0, correction, torch.ones_like(correction)),
                       torch.ones_like(ema))


def momentum_scales(momentum_norms: torch.Tensor, numels: torch.Tensor) -> torch.Tensor:
    """``k_l = s_bar / s_l`` with ``s_l = ||m_l|| / sqrt(numel_l)``; 1 where ``s_l = 0``.

    The compressor has one scale per buffer, so layers whose momentum differs by orders of
    magnitude are first brought to a common RMS ``s_bar`` (the mean of the non-zero ``s_l``).
    """
    rms = momentum_norms / numels.to(momentum_norms.dtype).sqrt()
    nonzero = rms > 0
    if not bool(nonzero.any()):
        return torch.ones_like(rms)
    mean_rms = rms[nonzero].mean()
    return torch.where(nonzero, mean_rms / torch.where(nonzero, rms, torch.ones_like(rms)), torch.ones_like(rms))


def scaling_factors(max_denominator_ratio: torch.Tensor, plain_update_norms: torch.Tensor,
                    update_norms: torch.Tensor, weight_decays: torch.Tensor, prev_factor: torch.Tensor,
                    factor_min: float, factor_max: float, factor_threshold: float) -> torch.Tensor:
    """1-bit LAMB's per-layer factor ("stabilized soft thresholds"), docs/algorithm.md, stage 2.

    ``max_denominator_ratio`` is ``max(den / (sqrt(v_fresh_hat) + eps))`` per layer: how much the
    frozen variance overstates the live one. With weight decay only the part of the update that
    comes from the momentum is rescaled (``rho``), and the factor may move at most
    ``factor_threshold`` per step so that one noisy step cannot swing a layer's learning rate.
    """
    r = max_denominator_ratio
    safe = torch.where(update_norms > 0, update_norms, torch.ones_like(update_norms))
    rho = torch.where(update_norms > 0, torch.clamp(plain_update_norms / safe, max=1.0), torch.ones_like(r))
    r = torch.where(weight_decays > 0, r * rho + (1 - rho), r)
    r = r.clamp(factor_min, factor_max)
    return torch.minimum(torch.maximum(r, (1 - factor_threshold) * prev_factor), (1 + factor_threshold) * prev_factor)


def update_fresh_variance_(v_fresh: torch.Tensor, m: torch.Tensor, m_prev: torch.Tensor, beta1: float,
                           beta2: float) -> None:
    """1-bit LAMB's fresh variance in place: ``v = b2 v + (1-b2) g^2`` with the averaged gradient
    reconstructed from two momenta, ``g = (m - b1 m_prev) / (1 - b1)``; its division is folded into
    the weight of ``g^2`` (one pass fewer). ``m_prev`` is overwritten."""
    g_scaled = torch.add(m, m_prev, alpha=-beta1, out=m_prev)
    v_fresh.mul_(beta2).addcmul_(g_scaled, g_scaled, value=(1 - beta2) / (1 - beta1) ** 2)


def late_directions_(update: torch.Tensor, m: torch.Tensor, m_prev: torch.Tensor, v_fresh: torch.Tensor,
                     index: torch.Tensor, beta1: float, beta2: float, bias_correction1: float,
                     bias_correction2: float, eps: float, update_variance: bool) -> None:
    """At the flat ``index`` of the elements born after the freeze: Adam's direction over their own
    variance, ``(m / bc1) / (sqrt(v_fresh / bc2) + eps)``, into ``update``, the step's global bias
    corrections as Adam's, which counts an element's steps from the start of the run, not from its
    first gradient. ``update_variance``: first bring ``v_fresh`` up to date there from the exchanged
    momenta (``update_fresh_variance_``'s rule), where no pass over every element did. Touches the
    born elements only: nothing per step over a cold table's untouched rows."""
    m_born = m[index]
    v_born = v_fresh[index]
    if update_variance:
        g_scaled = m_born - beta1 * m_prev[index]
        v_born.mul_(beta2).addcmul_(g_scaled, g_scaled, value=(1 - beta2) / (1 - beta1) ** 2)
        v_fresh[index] = v_born
    den = adam_denominator(v_born, bias_correction2, eps, out=torch.empty_like(v_born))
    update[index] = adam_direction(m_born, den, bias_correction1, out=torch.empty_like(m_born))


def max_denominator_ratios(frozen_denominator: torch.Tensor, v_fresh: torch.Tensor, bias_correction2: float,
                           eps: float, views_of: List[slice], out: torch.Tensor) -> torch.Tensor:
    """Per layer, ``max(frozen_denominator / (sqrt(v_fresh / bc2) + eps))`` (``out``: scratch of the
    flat size). Computed as ``sqrt(bc2) * den / (sqrt(v) + eps sqrt(bc2))``, a pass fewer."""
    root = math.sqrt(bias_correction2)
    torch.sqrt(v_fresh, out=out).add_(eps * root)
    torch.div(frozen_denominator, out, out=out)
    return segment_max(out, views_of) * root


def fresh_variance_statistics_(v_fresh: torch.Tensor, m: torch.Tensor, m_prev: torch.Tensor,
                                frozen_denominator: torch.Tensor, inverse_denominator: torch.Tensor,
                                bias_correction1: float, bias_correction2: float, beta1: float, beta2: float,
                                eps: float, views_of: List[slice], offsets: torch.Tensor, update: torch.Tensor,
                                scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All that 1-bit LAMB's stage 2 computes per element (docs/algorithm.md, stage 2), in one
    pass where the compiled loop applies (contiguous float32 on the CPU; ``optim/native.py``).

    Writes Adam's direction with the frozen denominator into ``update`` and updates ``v_fresh``
    (``update_fresh_variance_``); returns per layer the largest ratio of the frozen denominator to
    the fresh one (``max_denominator_ratios``) and the direction's norm, both float32 vectors.
    ``inverse_denominator`` is ``1 / frozen_denominator``, ``offsets`` the layers' bounds (int64,
    CPU), ``m_prev`` and ``scratch`` may be overwritten. The two paths agree up to float rounding.
    """
    lib = native.usable(v_fresh, m, m_prev, inverse_denominator, update)
    if lib is not None:
        root = math.sqrt(bias_correction2)
        min_quotient, sum_sq = native.fresh_variance_stats_(
            lib, v_fresh, m, m_prev, inverse_denominator, update, offsets, beta1, beta2,
            weight=(1 - beta2) / (1 - beta1) ** 2, shift=eps * root, inv_bc1=1 / bias_correction1)
        return root / min_quotient, sum_sq.sqrt().to(torch.float32)
    adam_direction(m, frozen_denominator, bias_correction1, out=update)
    update_fresh_variance_(v_fresh, m, m_prev, beta1, beta2)
    max_ratio = max_denominator_ratios(frozen_denominator, v_fresh, bias_correction2, eps, views_of, out=scratch)
    return max_ratio, norms([update[s] for s in views_of])


def segment_max(flat: torch.Tensor, views_of: List[slice]) -> torch.Tensor:
    """Maximum of each slice of ``flat`` (one per layer), as a float32 vector; 0 for an empty slice
    (a rank's empty shard of a layer: the values maximised here are ratios, all positive)."""
    return torch.stack([flat[s].max() if s.stop > s.start else flat.new_zeros(()) for s in views_of]).to(torch.float32)


def settled(spread: Optional[float], tolerance: float) -> bool:
    """The automatic freeze's criterion: has the warm-up left its early transient?

    ``spread`` is ``window_spread`` of the last ``W + 1`` warm-up steps' per-layer
    ``log ||v_hat||`` (synchronized, so every rank decides alike). Settled when every layer's has
    moved by at most ``tolerance`` over the window. A layer still on the early plateau, or leaving
    it, has a variance that grows by orders of magnitude and holds the freeze back; layers with no
    gradient yet (``log 0``) are ignored until they have one. The trust ratio is not part of the
    test: the most mobile layer's keeps moving long after the variance has settled.
    """
    return spread is not None and spread <= tolerance


def transient_passed(spread: Optional[float], peak: float, transient: float, end: float) -> bool:
    """The automatic freeze's second way out: the warm-up has been through its transient.

    Freezing before or during a plateau exit fails (the frozen variance cannot follow the jump);
    freezing once it is over works, long before every layer has settled to the tolerance. So:
    passed when the spread has once reached ``transient`` (``peak`` is the largest spread seen so
    far) and has since fallen to ``end``. An absolute end rather than a share of the peak: a
    one-step gradient spike makes a tall peak while the layers still move a lot.
    """
    return spread is not None and peak >= transient and spread <= end


def freeze_due(step: int, spread: Optional[float], peak: float, floor: int, cap: int, tolerance: float,
               transient: float, end: float) -> bool:
    """The automatic freeze's decision at the end of warm-up step ``step``: always at the cap,
    never before the floor, and in between once ``settled`` or ``transient_passed``."""
    if step >= cap:
        return True
    if step < floor:
        return False
    return settled(spread, tolerance) or transient_passed(spread, peak, transient, end)


def trust_rise(history: torch.Tensor, count: int) -> Optional[float]:
    """How far the layers' trust ratios rose over the window: the median over the layers of each
    one's rise (last row minus first; rows are each warm-up step's per-layer ``log`` of the trust
    ratio's running average, so 0.1 is about 10%), over the layers with a finite level throughout.
    At most 0 once half the layers have stopped rising. None until the window is full or while no
    layer has a finite level throughout it.

    Why a freeze waits for it: stage 2 keeps the trust ratio of the freeze, and LAMB's own ratios
    may keep rising well after the variance has settled; a freeze on that rise keeps ratios smaller
    than the ones LAMB soon uses. The median, not every layer: the most mobile layer's ratio keeps
    moving long after the rest.
    """
    if count < history.shape[0]:
        return None
    finite = torch.isfinite(history).all(dim=0)
    if not bool(finite.any()):
        return None
    first, last = history[0, finite], history[-1, finite]
    return float((last - first).median())


def trust_peak_passed(rise: Optional[float], tolerance: float) -> bool:
    """The trust ratios have stopped rising: the median layer's rose by at most ``tolerance`` (on
    the log scale) over the window. Not 0: after the criterion holds, the median rise wanders
    between -0.07 and 0.20 on the demo (95% of steps at most 0.15), so a test for 0 ends the wait
    at whichever dip rounding makes first; a sustained rise (0.25-0.30 a window on ``b1024``, the
    case the wait is for) still holds it."""
    return rise is not None and rise <= tolerance


def window_spread(history: torch.Tensor, count: int) -> Optional[float]:
    """How far the least settled layer statistic moved over the window (max minus min, log
    scale); None until the window is full or while no layer has a gradient."""
    if count < history.shape[0]:
        return None
    finite = torch.isfinite(history).all(dim=0)
    if not bool(finite.any()):
        return None
    window = history[:, finite]
    return float((window.max(dim=0).values - window.min(dim=0).values).max())


# ---------------------------------------------------------------------- 0/1 Adam (zero_one.py)
def interval_after(interval: int, counter: int, scaler: int, clipper: Optional[int] = None) -> tuple[int, int]:
    """0/1 Adam's two exponential schedules, after one more event (a variance update, or a step
    after the variance froze): ``counter`` counts the events at this ``interval``; after
    ``scaler`` of them the interval doubles (at most to ``clipper``) and the count restarts.
    Returns the new ``(interval, counter)``."""
    counter += 1
    if counter == scaler:
        counter, interval = 0, interval * 2
        if clipper is not None:
            interval = min(interval, clipper)
    return interval, counter


def accumulate_update_(update_sum: torch.Tensor, update: torch.Tensor, lrs: Sequence[float],
                       slices: List[slice]) -> None:
    """``update_sum += lr * u`` per layer: what the local steps moved the parameters by since the
    last sync (0/1 Adam's ``u``, with the sign of a descent)."""
    for s, lr in zip(slices, lrs):
        update_sum[s].add_(update[s], alpha=lr)


def synced_momentum_(m: torch.Tensor, averaged: torch.Tensor, lr_sums: torch.Tensor, slices: List[slice],
                     bias_correction1: float) -> None:
    """After a sync, each layer's momentum is the averaged accumulated update (in the momentum's
    units, times the denominator) divided by the sum of the learning rates it was taken with;
    times ``bias_correction1``, so that the next step's ``m / bias_correction1`` starts from it."""
    for s, total in zip(slices, lr_sums.tolist()):
        if total == 0:  # a layer whose learning rate was 0 since the sync did not move
            m[s].zero_()
        else:
            torch.div(averaged[s], total, out=m[s])
    if bias_correction1 != 1.0:
        m.mul_(bias_correction1)
