"""What a phase works with: the step context, public and typed.

A phase (``phases.py``, ``zero_one.py``, ``local_steps.py``) reads and changes the optimizer's flat
state and moves the parameters; it does so through a :class:`StepContext`, never through the
optimizer's own members. The optimizer (``staged.py``) holds one context and keeps it current: the
state (replaced by a load), the flat layout and the scratch buffers (made at the first step, or the
first after a load). What every phase shares is here once: the step's betas and bias corrections,
the frozen denominators and the compression scales derived from the state, the bound on Adam's
direction, and the one place the parameters move (:meth:`StepContext.apply_`).

A new phase uses these members and nothing else of the optimizer; adding one touches its own
module and the optimizer class that lists it.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from onebitlamb.optim import functional as F
from onebitlamb.optim.layout import Bucket, FlatLayout, Scratch

# The largest step size (``lr`` times a layer's coefficient) a step may take: the square root of
# float32's largest value, 1.84e19. Adam's direction, which the step size multiplies, has elements
# of about 1 (at most ``F.adam_direction_bound``: 1 at the first step, 7.27 in the limit), so a
# larger step takes parameters where their squares overflow: the layer norms of LAMB's trust
# ratio, of the weight decay and of the agreed gradient check become ``inf``, and no later step of
# a sane size moves a parameter that large at all (its float32 spacing is larger than the step).
MAX_STEP_SIZE = math.sqrt(torch.finfo(torch.float32).max)


class StepContext:
    """The optimizer as its phases see it.

    - ``owner``: the optimizer class's name (for messages); ``defaults``, ``param_groups``: its
      hyper-parameters, as ``torch.optim`` holds them; ``exchange``: its ``Exchange`` (the process
      group, the buckets, the error buffers);
    - ``state``: the flat state (``layout.py``), the dict ``state_dict()`` saves;
    - ``layout``, ``buffers``: the flat layout and the float32 scratch buffers of the step (None
      until the first step lays them out); ``last_coeff``: the per-layer coefficient the last step
      applied.
    """

    def __init__(self, optimizer: Callable[[], Any], phase: Callable[[], Any]) -> None:
        # the optimizer (a weak reference's call): its state, param groups and defaults are read
        # through it, as torch.optim's load_state_dict replaces them
        self._optimizer = optimizer
        self._phase_of = phase  # the phase the next step runs
        self.layout: Optional[FlatLayout] = None
        self.buffers: Optional[Scratch] = None
        self.last_coeff: Optional[torch.Tensor] = None

    @property
    def owner(self) -> str:
        return type(self._optimizer()).__name__

    @property
    def defaults(self) -> Dict[str, Any]:
        return self._optimizer().defaults

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self._optimizer().param_groups

    @property
    def exchange(self) -> Any:
        return self._optimizer().exchange

    @property
    def state(self) -> Dict[str, Any]:
        return self._optimizer().state["flat"]

    @property
    def process_group(self) -> Any:
        return self.exchange.process_group

    # ------------------------------------------------------------------ the step's constants
    def betas(self) -> Tuple[float, float]:
        """beta1 as the param groups hold it now (a momentum schedule, such as OneCycleLR's
        ``cycle_momentum``, moves it alike in every group: ``check_param_groups``), beta2 the
        optimizer's own (after the freeze it is frozen with the variance)."""
        return self.param_groups[0]["betas"][0], self.defaults["betas"][1]

    def bias_correction1(self, step: Optional[int] = None) -> float:
        """``1 - beta1^t`` at step ``t`` (the steps taken so far by default); 1 without bias correction."""
        if not self.defaults["bias_correction"]:
            return 1.0
        return 1 - self.betas()[0] ** (self.state["step"] if step is None else step)

    def compresses_update(self) -> bool:
        """Whether stage 2 sends ``m / den`` (``compression_space="update"``, OneBitLamb's and
        ZeroOneAdam's default); optimizers without the setting (OneBitAdam) send the momentum."""
        return self.defaults.get("compression_space") == "update"

    # ------------------------------------------------------------------ derived from the state
    def frozen_denominators(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``sqrt(v_frozen) + eps`` and its inverse, derived from the state once after a freeze or load."""
        derived, v_frozen = self.buffers.derived, self.state["exp_avg_sq"]
        if derived.get("denominator_source") is not v_frozen:
            den = self.buffers.frozen_denominator
            torch.sqrt(v_frozen, out=den).add_(self.defaults["eps"])
            derived["denominator"], derived["inverse_denominator"] = den, torch.reciprocal(den)
            derived["denominator_source"] = v_frozen
        return derived["denominator"], derived["inverse_denominator"]

    def denominators_born_(self, indices: torch.Tensor) -> None:
        """The frozen denominators of elements just given a variance (``LocalSteps.born``), written
        where ``frozen_denominators`` already derived them, by the same arithmetic, so that a state
        loaded later derives the same bits."""
        derived = self.buffers.derived
        if derived.get("denominator_source") is not self.state["exp_avg_sq"]:  # derived later, from the state
            return
        den = torch.sqrt(self.state["exp_avg_sq"][indices]).add_(self.defaults["eps"])
        derived["denominator"][indices] = den
        derived["inverse_denominator"][indices] = torch.reciprocal(den)

    def compression_scales(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per element, what the local momentum is multiplied by before compression: ``k_l`` (each
        layer's momentum brought to one common RMS, since the compressor has one scale per chunk),
        divided by the denominator where the update space is compressed (the phase's
        ``inverse_denominator``); and what the decompressed result is multiplied by: its inverse
        times the momentum mask, so one pass both undoes the scaling and masks.

        The mask applies to what is sent as well: an element no rank's gradient has reached since
        before the freeze sends nothing, since a 1-bit code has no zero. Once born (``scales_born_``)
        it is sent over the phase's wire denominator for it (``OneBitMomentum.inverse_denominator``:
        its layer's typical one, not ``eps``, which would put it into the buffer ``1e8`` times too
        large and set the 1-bit magnitude of its whole chunk)."""
        derived, flat = self.buffers.derived, self.state
        source = (flat["momentum_scale"], flat["exp_avg_sq"], flat["momentum_mask"])
        held = derived.get("scale_source")  # the tensors themselves: they stay alive, so `is` cannot mistake them
        if held is None or any(a is not b for a, b in zip(held, source)):
            numels = torch.tensor(self.layout.numels, device=self.layout.device)
            layer_scale = torch.repeat_interleave(flat["momentum_scale"], numels)
            scale = (layer_scale * self._phase_of().inverse_denominator(self) if self.compresses_update()
                     else layer_scale.clone())
            mask = flat["momentum_mask"]
            derived["unscale"] = torch.reciprocal(scale).mul_(mask)
            derived["scale"], derived["layer_scale"] = scale.mul_(mask), layer_scale.mul_(mask)
            derived["scale_source"] = source
        return derived["scale"], derived["unscale"]

    def scales_born_(self, indices: torch.Tensor, layer: torch.Tensor, inverse: Optional[torch.Tensor]) -> None:
        """The compression scales of elements just born (their mask set: ``OneBitMomentum.born``),
        written where ``compression_scales`` already derived them, by the same arithmetic, so that
        a state loaded later derives the same bits; ``layer``: each element's layer, ``inverse``:
        its wire denominator's inverse (None in the momentum space)."""
        derived = self.buffers.derived
        if "scale" not in derived:  # derived later, from the state, mask included
            return
        layer_scale = self.state["momentum_scale"][layer]
        scale = layer_scale * inverse if inverse is not None else layer_scale.clone()
        derived["scale"][indices] = scale
        derived["unscale"][indices] = torch.reciprocal(scale)
        derived["layer_scale"][indices] = layer_scale

    def unscaled(self, received: List[torch.Tensor], local: torch.Tensor) -> torch.Tensor:
        """The buckets' 1-bit averages ``received`` with their scales undone and masked, as one flat
        tensor; with one process (nothing received), ``local`` masked."""
        _, unscale = self.compression_scales()
        out = self.buffers.averaged
        if received:
            for b, avg in zip(self.exchange.buckets, received):
                torch.mul(avg, unscale[b.start:b.end], out=out[b.start:b.end])
        else:
            torch.mul(local, self.state["momentum_mask"], out=out)
        return out

    # ------------------------------------------------------------------ the bound on Adam's direction
    def bound_direction_(self, update: torch.Tensor, step: Optional[int] = None) -> bool:
        """Stage 2's direction ``m_hat / (sqrt(v_frozen) + eps)`` clipped, element by element, to the
        largest value Adam's own direction can take at this step (``F.adam_direction_bound``), unless
        built with ``bound_direction=False`` (the paper's and DeepSpeed's rule). Returns whether it
        clipped. Why: after the freeze an element's momentum is what the 1-bit code gives it (about
        its chunk's magnitude), or in local steps its own rank's, while its variance stays the
        frozen one; where that variance is tiny (a bias whose gradient is zero in exact arithmetic,
        a rare embedding row) the quotient is thousands of times what LAMB or Adam would take."""
        if not self.defaults.get("bound_direction", False):
            return False
        beta1, beta2 = self.betas()
        F.clip_direction_(update, F.adam_direction_bound(beta1, beta2, self.state["step"] if step is None else step,
                                                         self.defaults["bias_correction"]))
        return True

    def bound_sent_(self, sent: torch.Tensor, b: Bucket) -> None:
        """In the update space, what a rank sends (its momentum over the frozen denominator, times
        ``k_l``) clipped like the direction it stands for (``bound_direction_``): a gradient that
        an element meets after the freeze, against a variance that was tiny until then, would
        otherwise enter the buffer millions of times larger than the rest and set the 1-bit
        magnitude of its whole chunk, moving every element of the chunk by that much."""
        if not (self.defaults.get("bound_direction", False) and self.compresses_update()):
            return
        beta1, beta2 = self.betas()
        step = self.state["step"] + 1  # the step being taken: its exchange comes before the count
        limit = F.adam_direction_bound(beta1, beta2, step, self.defaults["bias_correction"]) * self.bias_correction1(step)
        if math.isfinite(limit):
            bound = self.buffers.derived["layer_scale"][b.start:b.end] * limit
            torch.clamp(sent, -bound, bound, out=sent)

    # ------------------------------------------------------------------ the parameters move
    def apply_(self, update: torch.Tensor, coeff: torch.Tensor) -> None:
        """``x -= lr * coeff * u`` per layer (``FlatLayout.apply_``), once the update is known finite.

        The agreed check before the step (checks.locally_finite: the gradient's squares) keeps the
        moments finite; this is the guard that the parameters never become non-finite either
        (parameters already near float32's limit). The update and coefficients follow from what is
        the same on every rank (the averaged gradient, or the exchanged momentum, and the shared
        state), so every rank reaches this verdict alike, without a collective; with sharded
        parameters the ranks of a node hold other shards of the update and agree on it."""
        finite = bool(torch.isfinite(update).all()) and bool(torch.isfinite(coeff).all())
        if self.layout.spans_shards:
            finite = self.layout.shards.every_rank(finite, self.layout.device)
        if not finite:
            raise FloatingPointError(f"{self.owner}: the update of step {self.state['step']} is not finite "
                                     f"although every rank's gradient was (the parameters or their weight decay "
                                     f"are at float32's limit); the parameters were left as they were. Resume "
                                     f"from an earlier checkpoint with a lower learning rate")
        step_sizes = self.checked_step_sizes(coeff)
        self.last_coeff = coeff.clone()
        self.layout.apply_(update, step_sizes)

    def checked_step_sizes(self, coeff: torch.Tensor, step: Optional[int] = None) -> List[float]:
        """Each layer's step size ``lr * coeff`` at step ``step`` (the steps taken so far by
        default), refused with ``FloatingPointError`` past ``MAX_STEP_SIZE`` before any parameter
        moves (the optimizer then puts its state back: the step changes nothing). Decided from the learning rates and the coefficients, which every
        rank holds alike in every stage (0/1 Adam's local steps too, whose updates are each rank's
        own, and whose coefficient is 1), so every rank refuses alike without a collective. Why: a
        learning rate wrong by orders of magnitude (a schedule's peak, a unit's factor) would
        otherwise overflow float32 in the middle of the step (a raw ``RuntimeError`` after the
        first layers had moved), or move every parameter to about 1e38, silently, after which
        the run could no longer move them."""
        sizes = self.layout.step_sizes(coeff, self.param_groups)
        worst = max(range(len(sizes)), key=lambda i: abs(sizes[i]), default=None)
        if worst is not None and not abs(sizes[worst]) <= MAX_STEP_SIZE:
            group = self.layout.groups[worst]
            lr, c = self.param_groups[group]["lr"], float(coeff[worst])
            raise FloatingPointError(
                f"{self.owner}: step {self.state['step'] if step is None else step} refused on every rank, nothing "
                f"changed: the learning rate lr={lr!r} (param group {group}) times the layer's coefficient {c:.4g} "
                f"is a step size of {sizes[worst]:.4g} for parameter {worst} (in the optimizer's order, shape "
                f"{tuple(self.layout.params[worst].shape)}), past {MAX_STEP_SIZE:.3g} (the square root of float32's "
                f"largest value): it would move the parameters where their squares, and every norm of them, "
                f"overflow, and no later step could move them back. Lower the learning rate")
        return sizes
