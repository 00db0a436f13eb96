"""When the warm-up ends: a fixed step, or ``AutoFreeze``, the automatic policy.

The optimizers take either as ``freeze_step``. ``AutoFreeze`` is a plain, immutable description
(what a user writes); the decisions it implies run in ``AutomaticSchedule``, whose whole memory
lives in the optimizer's flat state, so a checkpoint resumes a half-watched warm-up exactly and
every rank, reading only synchronized values, decides alike. ``docs/convergence.md`` tells when
to use which; ``docs/algorithm.md`` states the rule.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import torch

from onebitlamb._stack import user_stacklevel
from onebitlamb.docs import pointer
from onebitlamb.optim import functional as F


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class AutoFreeze:
    """Freeze once the warm-up has settled, between a floor and a cap given as fractions of the run.

    Args:
        total_steps: the number of optimizer steps of the whole run (what the fractions refer to).
        min_fraction: the floor: no freeze before this share of the steps. ``None``: 0.3 for
            ``OneBitLamb`` (measured with its wait for the trust ratios' peak), 0.05 for
            ``OneBitAdam`` (which has no trust ratio to wait for).
        max_fraction: the cap: the freeze comes at this share of the steps at the latest.
        window: steps over which the warm-up must have settled.
        tolerance: settled when every layer's ``log ||v_hat||`` moved by at most this over the window.
        transient: a window spread this large marks a plateau exit (layers whose variance jumps by
            orders of magnitude as they start to learn) ...
        transient_end: ... after which the freeze may come once the spread is back to this.
        trust_tolerance: ``OneBitLamb`` only: the trust ratios have stopped rising when the median
            layer's ``log`` ratio rose by at most this over the window (0.15: about 16%).

    With ``OneBitLamb`` the freeze then waits, up to the cap, until the median layer's trust ratio
    has stopped rising over a window, so that stage 2 keeps the ratios LAMB reaches at their peak.
    Why a tolerance and not 0: on the demo the median rise wandered between -0.07 and 0.20 after
    the criterion held (95% of steps at most 0.15), so a wait for 0 ended wherever rounding put a
    dip (``docs/algorithm.md``, "1-bit LAMB then waits").
    """

    total_steps: int
    min_fraction: Optional[float] = None
    max_fraction: float = 0.75
    window: int = 20
    tolerance: float = 0.3
    transient: float = 5.0
    transient_end: float = 2.5
    trust_tolerance: float = 0.15

    def __post_init__(self) -> None:
        if not _is_int(self.total_steps) or self.total_steps < 1:
            raise ValueError(f"Invalid total_steps: {self.total_steps!r} (must be an integer >= 1)")
        if not _is_number(self.max_fraction) or not 0 < self.max_fraction <= 1:
            raise ValueError(f"Invalid max_fraction: {self.max_fraction!r} (must be in (0, 1])")
        if self.min_fraction is not None and (not _is_number(self.min_fraction)
                                              or not 0 < self.min_fraction <= self.max_fraction):
            raise ValueError(f"Invalid min_fraction: {self.min_fraction!r} (None, or in (0, max_fraction="
                             f"{self.max_fraction}])")
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"Invalid window: {self.window!r} (must be an integer >= 1)")
        if not _is_number(self.tolerance) or self.tolerance <= 0:
            raise ValueError(f"Invalid tolerance: {self.tolerance!r} (must be a finite number > 0)")
        if not _is_number(self.transient) or self.transient <= 0:
            raise ValueError(f"Invalid transient: {self.transient!r} (must be a finite number > 0)")
        if not _is_number(self.transient_end) or not 0 < self.transient_end < self.transient:
            raise ValueError(f"Invalid transient_end: {self.transient_end!r} (must be in (0, transient="
                             f"{self.transient}))")
        if not _is_number(self.trust_tolerance) or self.trust_tolerance < 0:
            raise ValueError(f"Invalid trust_tolerance: {self.trust_tolerance!r} (must be a finite number >= 0)")

    def cap_step(self) -> int:
        return max(1, round(self.max_fraction * self.total_steps))

    def floor_step(self, waits_for_trust_peak: bool) -> int:
        fraction = self.min_fraction
        if fraction is None:
            fraction = 0.3 if waits_for_trust_peak else 0.05
        return min(self.cap_step(), max(1, round(fraction * self.total_steps)))


FreezeStep = Union[int, AutoFreeze]


def schedule_for(owner: str, freeze_step: Any, waits_for_trust_peak: bool) -> "FixedSchedule | AutomaticSchedule":
    """The schedule behind an optimizer's ``freeze_step`` argument, validated."""
    if isinstance(freeze_step, AutoFreeze):
        return AutomaticSchedule(freeze_step, waits_for_trust_peak)
    if _is_int(freeze_step) and freeze_step >= 1:
        return FixedSchedule(freeze_step, owner)
    raise ValueError(f"Invalid freeze_step for {owner}: {freeze_step!r}. Pass the number of warm-up steps "
                     f"with full communication (an integer >= 1; the paper suggests 15-25% of the run, small "
                     f"models may need more) or onebitlamb.AutoFreeze(total_steps=...) to let the warm-up decide")


class EarlyFreezeWarning(UserWarning):
    """A fixed ``freeze_step`` came while the variance was still moving (``FixedSchedule``)."""


class FixedSchedule:
    """``freeze_step=N``: the freeze comes at the end of step N, whatever the warm-up shows.

    It watches what ``AutoFreeze`` watches, each layer's ``log ||v_hat||`` over the last warm-up
    steps (up to ``AutoFreeze``'s window), and at the freeze warns (``EarlyFreezeWarning``) when
    ``AutoFreeze`` would not have frozen on those statistics, where they are clear: within
    ``AutoFreeze``'s first window a layer whose variance moves by more than its tolerance (without
    the end of a transient), and at any step a layer still in a transient (a spread above
    ``transient_end``). Stage 2 keeps the frozen variance,
    and a variance caught in its early fall gives elements steps that the bound on stage 2's
    direction limits but cannot make right. Advice, not state: the window is not saved, so a run
    resumed a step or two before its freeze checks only the steps it has seen.
    """

    watches = True

    def __init__(self, step: int, owner: str = "the optimizer") -> None:
        self.step = step
        self.owner = owner
        self.floor_step = self.cap_step = step
        self._levels: List[torch.Tensor] = []
        self._peak = 0.0

    def __repr__(self) -> str:
        return f"freeze_step={self.step}"

    def init_state(self, flat: Dict[str, Any], layers: int, device: torch.device) -> None:
        pass

    def check_state(self, flat: Dict[str, Any]) -> None:
        pass

    def record(self, flat: Dict[str, Any], variance_levels: torch.Tensor,
               trust_levels: Optional[torch.Tensor]) -> None:
        self._levels = (self._levels + [variance_levels.detach().float().cpu()])[-(AutoFreeze.window + 1):]
        spread = self._spread()
        if spread is not None:
            self._peak = max(self._peak, spread)

    def _spread(self) -> Optional[float]:
        """``F.window_spread`` over the steps seen (fewer than a window in a short warm-up)."""
        if len(self._levels) < 2:
            return None
        return F.window_spread(torch.stack(self._levels), len(self._levels))

    def _least_settled_layer(self) -> int:
        rows = torch.stack(self._levels)
        moves = rows.max(dim=0).values - rows.min(dim=0).values
        return int(torch.where(torch.isfinite(moves), moves, torch.zeros_like(moves)).argmax())

    def due(self, flat: Dict[str, Any]) -> bool:
        if flat["step"] != self.step:
            return False
        spread = self._spread()
        if spread is not None:
            # AutoFreeze's own test on a short warm-up (no full window yet), and on any warm-up a
            # transient still under way (a spread AutoFreeze never freezes in); a longer warm-up that
            # merely drifts more than the tolerance is the user's informed choice
            moving = not (F.settled(spread, AutoFreeze.tolerance) or F.transient_passed(
                spread, self._peak, AutoFreeze.transient, AutoFreeze.transient_end))
            if (moving and self.step <= AutoFreeze.window) or spread > AutoFreeze.transient_end:
                warnings.warn(
                    f"{self.owner}: freeze_step={self.step} freezes a variance that has not settled: parameter "
                    f"{self._least_settled_layer()} (in the optimizer's order) moved its log ||v_hat|| by "
                    f"{spread:.2f} over the "
                    f"last {len(self._levels) - 1} warm-up steps, where AutoFreeze waits for {AutoFreeze.tolerance}. "
                    f"Stage 2 keeps this variance, and the loss may jump after the freeze. Use "
                    f"freeze_step=onebitlamb.AutoFreeze(total_steps=...) or a later step "
                    f"({pointer('algorithm', 'A freeze that comes too early')})", EarlyFreezeWarning,
                    stacklevel=user_stacklevel())
        return True

    def stats(self, flat: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        return _stats(flat, self.floor_step, self.cap_step)


class AutomaticSchedule:
    """The decisions of ``AutoFreeze`` for one optimizer. Every warm-up step ``record``s each
    layer's ``log ||v_hat||`` (and, when waiting for the trust peak, the log of each layer's
    running-average trust ratio, the value a freeze now would keep); ``due`` then says whether the
    freeze comes at the end of this step."""

    watches = True

    def __init__(self, config: AutoFreeze, waits_for_trust_peak: bool) -> None:
        self.config = config
        self.waits = waits_for_trust_peak
        self.floor_step = config.floor_step(waits_for_trust_peak)
        self.cap_step = config.cap_step()

    def __repr__(self) -> str:
        return f"freeze_step={self.config!r}"

    def init_state(self, flat: Dict[str, Any], layers: int, device: torch.device) -> None:
        rows = dict(dtype=torch.float32, device=device)
        flat["freeze_history"] = torch.zeros(self.config.window + 1, layers, **rows)
        flat["freeze_history_count"] = 0
        flat["freeze_spread_peak"] = 0.0
        if self.waits:
            flat["trust_history"] = torch.zeros(self.config.window + 1, layers, **rows)
            flat["trust_history_count"] = 0
            flat["freeze_ready_at"] = None  # the step at whose end the variance criterion first held
            flat["trust_peak_at"] = None  # the step at whose end the trust ratios had then stopped rising

    def check_state(self, flat: Dict[str, Any]) -> None:
        """A loaded state must carry this policy's history, over a window of the same length."""
        for history in ("freeze_history", "trust_history") if self.waits else ("freeze_history",):
            rows = flat.get(history)
            if rows is None or rows.shape[0] != self.config.window + 1:
                found = "none" if rows is None else f"a window of {rows.shape[0] - 1} steps"
                raise ValueError(f"the loaded optimizer state has {found} for {history}, this optimizer's "
                                 f"AutoFreeze watches {self.config.window} steps: load it with the freeze_step "
                                 f"it was saved with")

    def record(self, flat: Dict[str, Any], variance_levels: torch.Tensor,
               trust_levels: Optional[torch.Tensor]) -> None:
        _push(flat, "freeze_history", variance_levels)
        spread = F.window_spread(flat["freeze_history"], flat["freeze_history_count"])
        if spread is not None:
            flat["freeze_spread_peak"] = max(flat.get("freeze_spread_peak", 0.0), spread)
        if self.waits:
            _push(flat, "trust_history", trust_levels)

    def due(self, flat: Dict[str, Any]) -> bool:
        c, step = self.config, flat["step"]
        spread = F.window_spread(flat["freeze_history"], flat["freeze_history_count"])
        # With the wait the floor bounds the freeze, not the criterion: a floor on the criterion
        # would restart the wait's window there and push the freeze a window or more later.
        criterion = F.freeze_due(step, spread, flat.get("freeze_spread_peak", 0.0),
                                 1 if self.waits else self.floor_step, self.cap_step, c.tolerance,
                                 c.transient, c.transient_end)
        if not self.waits:
            return criterion
        if criterion and flat["freeze_ready_at"] is None:
            # Kept, since the spread may rise again while the ratios still climb. The window restarts
            # here: one reaching back before this step sees the dip a plateau exit makes in the ratios.
            flat["freeze_ready_at"] = step
            flat["trust_history_count"] = 1
        if step >= self.cap_step:
            return True
        if (flat["freeze_ready_at"] is not None and flat.get("trust_peak_at") is None
                and F.trust_peak_passed(self._trust_rise(flat), c.trust_tolerance)):
            flat["trust_peak_at"] = step  # kept: the ratios may rise again before the floor
        return flat.get("trust_peak_at") is not None and step >= self.floor_step

    def _trust_rise(self, flat: Dict[str, Any]) -> Optional[float]:
        return F.trust_rise(flat["trust_history"], flat["trust_history_count"])

    def stats(self, flat: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        out = _stats(flat, self.floor_step, self.cap_step)
        # what decided the last step, while it ran the warm-up (the freeze's own step included)
        if flat is None or flat["frozen_at"] not in (None, flat["step"]):
            return out
        out["spread"] = F.window_spread(flat["freeze_history"], flat["freeze_history_count"])
        out["spread_peak"] = flat.get("freeze_spread_peak", 0.0)
        if flat["freeze_history_count"] > 0:
            out["levels"] = flat["freeze_history"][-1].tolist()
        if self.waits:
            out["trust_rise"] = self._trust_rise(flat)
        return out


def _stats(flat: Optional[Dict[str, Any]], floor_step: int, cap_step: int) -> Dict[str, Any]:
    frozen_at = None if flat is None else flat["frozen_at"]
    return {"stage": "warmup" if frozen_at is None else "compression", "frozen_at": frozen_at,
            "floor_step": floor_step, "cap_step": cap_step, "spread": None, "spread_peak": None,
            "ready_step": None if flat is None else flat.get("freeze_ready_at"),
            "trust_rise": None, "trust_peak_step": None if flat is None else flat.get("trust_peak_at"),
            "levels": None}


def _push(flat: Dict[str, Any], history: str, levels: torch.Tensor) -> None:
    """Append one step's per-layer levels to a window kept in the state (its oldest row drops
    out; ``flat[history + "_count"]`` counts the rows ever pushed)."""
    rows = flat[history]
    rows.copy_(torch.roll(rows, -1, dims=0))
    rows[-1] = levels
    flat[history + "_count"] += 1
