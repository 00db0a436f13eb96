"""The machinery LAMB, 1-bit LAMB and 1-bit Adam share: one fused buffer, two stages.

Every trainable parameter (param-group order, then order within the group; empty ones and those
with ``requires_grad=False`` left out) owns a slice of one flat float32 buffer per moment. That
flat layout is what one all-reduce averages in warm-up and what one compressed all-reduce sends
afterwards, and it is identical on every rank, whichever ranks happen to have ``None`` gradients.

The whole optimizer state is that flat state (``self.state["flat"]``): moments, frozen values,
factors, the step count and this rank's compression errors, so ``state_dict()`` continues a run
bit-identically, and it stays float32 whatever the parameters' dtype. (``torch.optim``'s usual
per-parameter state would be cast to a bf16 parameter's dtype on load.)
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from onebitlamb.comm import CommStats, allreduce_mean_, compressed_allreduce, padded_size, world_size_of
from onebitlamb.optim import functional as F

WARMUP, COMPRESSION = "warmup", "compression"

# Hyper-parameters that may differ between param groups; the others are the optimizer's own.
PER_GROUP = ("lr", "weight_decay")

# Averaging horizon (steps) of the warm-up relative step that the stage-2 guard compares with.
_STEP_RATIO_BETA = 0.9


def _check_finite_nonneg(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number >= 0)")


def validate_common(lr: float, betas, eps: float, weight_decay: float) -> None:
    _check_finite_nonneg("learning rate", lr)
    _check_finite_nonneg("weight_decay", weight_decay)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas!r} (must be a pair (beta1, beta2))")
    for i, b in enumerate(betas):
        if not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta{i + 1}: {b!r} (must be in [0, 1))")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"Invalid eps: {eps!r} (must be > 0)")


class StagedOptimizer(Optimizer):
    """Base of the three optimizers. Subclasses set the update rule with two switches:

    - ``_layerwise``: LAMB's trust ratio ``c`` (else ``c = 1``: Adam);
    - ``_fresh_variance``: 1-bit LAMB's factor from a variance kept fresh after the freeze.

    ``freeze_step=None`` means warm-up forever (plain LAMB or Adam, full communication);
    ``"auto"`` freezes once the warm-up has settled or has been through its transient (see
    ``functional.settled`` and ``functional.transient_passed``), with ``freeze_after_trust_peak``
    not before the trust ratios have then stopped rising (``functional.trust_rise``), and with
    ``unfreeze_rise`` undoes a freeze that a later plateau exit shows to have come too early
    (``functional.window_rise``).
    """

    _layerwise = True
    _fresh_variance = True

    def __init__(self, params: Iterable, defaults: Dict[str, Any], freeze_step: Union[int, str, None],
                 process_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            for key, value in group.items():
                if key == "params":
                    continue
                if key in PER_GROUP:
                    _check_finite_nonneg(f"{key} in a param group", value)
                elif key in defaults and value != defaults[key]:
                    raise ValueError(f"{key}={value!r} in a param group: only {', '.join(PER_GROUP)} may "
                                     f"differ between groups")
        self.freeze_step = freeze_step
        self.process_group = process_group
        self.comm_stats = CommStats()
        self.last_step_bytes = 0
        self._layout: Optional[Dict[str, Any]] = None
        self._scratch: Dict[str, torch.Tensor] = {}
        self._last_coeff: Optional[torch.Tensor] = None
        self._last_guarded: Optional[torch.Tensor] = None
        self._last_rise: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ layout and state
    def _build_layout(self) -> Dict[str, Any]:
        params, groups = [], []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if p.requires_grad and p.numel() > 0:
                    params.append(p)
                    groups.append(gi)
        numels = [p.numel() for p in params]
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        return {
            "params": params, "groups": groups, "numels": numels,
            "slices": [slice(offsets[i], offsets[i + 1]) for i in range(len(params))],
            "offsets": torch.tensor(offsets, dtype=torch.int64),
            "numel": offsets[-1],
            "device": params[0].device if params else torch.device("cpu"),
        }

    @property
    def _flat(self) -> Dict[str, Any]:
        return self.state["flat"]

    def _init_state(self) -> None:
        lay = self._layout
        d, L, dev = lay["numel"], len(lay["params"]), lay["device"]
        f32 = dict(dtype=torch.float32, device=dev)
        self.state["flat"] = flat = {
            "step": 0,
            "world_size": world_size_of(self.process_group),
            "layer_numels": list(lay["numels"]),
            "exp_avg": torch.zeros(d, **f32),
            "exp_avg_sq": torch.zeros(d, **f32),  # v; after the freeze, v_frozen (= v_hat then)
            "coeff_ema": torch.zeros(L, **f32),
            "coeff_ema_count": torch.zeros(L, **f32),
            "frozen_at": None,  # the step at whose end the freeze happened
        }
        if self.freeze_step is not None:
            flat["step_ratio_ema"] = torch.zeros(L, **f32)
            flat["step_ratio_count"] = torch.zeros(L, **f32)
            flat["guard_hits"] = 0
        if self.freeze_step == "auto":
            flat["freeze_history"] = torch.zeros(self.defaults["freeze_window"] + 1, L, **f32)
            flat["freeze_history_count"] = 0
            flat["freeze_spread_peak"] = 0.0
        if self._waiting_for_trust_peak():
            flat["trust_history"] = torch.zeros(self.defaults["freeze_window"] + 1, L, **f32)
            flat["trust_history_count"] = 0
            flat["freeze_ready_at"] = None  # the step at whose end the variance criterion first held
            flat["trust_peak_at"] = None  # the step at whose end the trust ratios had then stopped rising
        if self._watching_rise():
            flat["local_variance"] = torch.zeros(L, **f32)
            # the local levels of the freeze's step and the frozen steps since, the last window of them
            flat["rise_history"] = torch.zeros(self.defaults["freeze_window"] + 1, L, **f32)
            flat["rise_history_count"] = 0
            flat["unfrozen_at"] = []  # the steps at whose end a freeze was undone

    def _check_loaded_state(self) -> None:
        flat = self._flat
        lay = self._layout
        if list(flat["layer_numels"]) != list(lay["numels"]):
            raise ValueError(f"the optimizer state holds {len(flat['layer_numels'])} parameters of sizes "
                             f"{flat['layer_numels'][:8]}..., the model has {len(lay['numels'])} of sizes "
                             f"{lay['numels'][:8]}...: not the same model or param groups")
        n = world_size_of(self.process_group)
        if flat["world_size"] != n:
            raise ValueError(f"the optimizer state was saved with world size {flat['world_size']} and is "
                             f"loaded with world size {n}; its compression errors are per rank, so resume "
                             f"on {flat['world_size']} ranks")
        for key, value in flat.items():
            if isinstance(value, torch.Tensor) and value.device != lay["device"]:
                flat[key] = value.to(lay["device"])

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "flat" in self.state:
            # own copies: the caller's dict must not alias the live state
            self.state["flat"] = {k: (v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list)
                                      else v) for k, v in self.state["flat"].items()}
        self._layout = None
        self._scratch = {}

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        """A scratch float32 buffer reused across steps (not part of the state)."""
        buf = self._scratch.get(name)
        if buf is None or buf.numel() != numel:
            buf = torch.zeros(numel, dtype=torch.float32, device=self._layout["device"])
            self._scratch[name] = buf
        return buf

    # ------------------------------------------------------------------ observability
    @property
    def stage(self) -> str:
        """The stage the next step runs: ``"warmup"`` until the freeze (at the end of step
        ``freeze_step``, or of the step where ``"auto"`` decided), then ``"compression"`` (with
        ``unfreeze_rise``, ``"warmup"`` again from a step at whose end the freeze was undone)."""
        if self.freeze_step is None or "flat" not in self.state:
            return WARMUP
        return WARMUP if self._flat["frozen_at"] is None else COMPRESSION

    @property
    def freeze_spread(self) -> Optional[float]:
        """With ``freeze_step="auto"``, if the last step ran the warm-up (the freeze's own step
        included): how far (log scale) the least settled layer's variance moved over the last
        ``freeze_window`` steps; the freeze comes when this is at most ``freeze_tolerance``, or at
        most ``freeze_transient_end`` (None: half its peak) once that peak has reached
        ``freeze_transient``. None otherwise, and until a window of levels is in."""
        if not self._auto_freeze_watching():
            return None
        return F.window_spread(self._flat["freeze_history"], self._flat["freeze_history_count"])

    @property
    def freeze_levels(self) -> Optional[List[float]]:
        """With ``freeze_step="auto"``, if the last step ran the warm-up (the freeze's own step
        included): each parameter's ``log ||v_hat||`` at that step (flat order; ``-inf`` for one
        with no gradient yet), the statistic whose spread over the window decides the freeze.
        Recorded per step, it shows which layers hold the freeze back and how far their plateau
        exit still has to go. None otherwise."""
        if not self._auto_freeze_watching() or self._flat["freeze_history_count"] == 0:
            return None  # the count is 0 after an undone freeze: that step ran frozen
        return self._flat["freeze_history"][-1].tolist()

    @property
    def variance_rise(self) -> Optional[List[float]]:
        """With ``unfreeze_rise``, if the last step ran frozen: per parameter (flat order), how far
        (log scale) the variance of the workers' local gradients had risen within the last
        ``freeze_window`` steps since the freeze (above its lowest level there; ``nan`` for one
        without a gradient), the numbers that step decided on; the freeze is undone when the
        largest is above ``unfreeze_rise``. None otherwise."""
        return None if self._last_rise is None else self._last_rise.tolist()

    @property
    def trust_rise(self) -> Optional[float]:
        """With ``freeze_after_trust_peak``, if the last step ran the warm-up (the freeze's own step
        included): how far (log scale) the layers' trust ratios (their running averages, the ones
        stage 2 would keep) rose over the last ``freeze_window`` steps, as ``trust_peak_measure``
        judges it (``functional.trust_rise``). Once the variance criterion has held, the window
        restarts from that step and the freeze waits for this to be at most 0, so the earliest
        freeze is ``freeze_window`` steps later. None otherwise, and until a window is in."""
        if not self._waiting_for_trust_peak() or not self._auto_freeze_watching():
            return None
        return self._trust_rise_now()

    @property
    def freeze_ready_step(self) -> Optional[int]:
        """With ``freeze_after_trust_peak``: the step at whose end the variance criterion (or the
        cap) first held, from which the freeze waited for the trust ratios; None before (and after
        an undone freeze, until it holds again)."""
        if not self._waiting_for_trust_peak() or "flat" not in self.state:
            return None
        return self._flat["freeze_ready_at"]

    @property
    def trust_peak_step(self) -> Optional[int]:
        """With ``freeze_after_trust_peak``: the step at whose end the wait ended (the trust ratios
        had stopped rising since ``freeze_ready_step``). The freeze comes there, or at
        ``min_freeze_step`` when that is later. None before (and after an undone freeze)."""
        if not self._waiting_for_trust_peak() or "flat" not in self.state:
            return None
        return self._flat.get("trust_peak_at")

    def _waiting_for_trust_peak(self) -> bool:
        return self.freeze_step == "auto" and bool(self.defaults.get("freeze_after_trust_peak"))

    def _trust_rise_now(self) -> Optional[float]:
        flat = self._flat  # trust_peak_measure: only OneBitLamb has the option
        return F.trust_rise(flat["trust_history"], flat["trust_history_count"],
                            self.defaults.get("trust_peak_measure", "median_rise"))

    def _watching_rise(self) -> bool:
        return self.freeze_step == "auto" and self.defaults.get("unfreeze_rise") is not None

    def _auto_freeze_watching(self) -> bool:
        """``freeze_step="auto"``, stepped at least once (every warm-up step records), and the last
        step ran the warm-up: not frozen yet, or frozen at that step's end (the numbers that
        decided the freeze)."""
        if self.freeze_step != "auto" or "flat" not in self.state:
            return False
        return self._flat["frozen_at"] in (None, self._flat["step"])

    def layer_diagnostics(self) -> List[Dict[str, Optional[float]]]:
        """Per trainable parameter (flat order): the coefficient applied at the last step
        (``trust_ratio``), and after the freeze the frozen coefficient, the factor, and whether
        the update guard bounded the step (``guarded``)."""
        if self._last_coeff is None:
            return []
        frozen = self._flat.get("frozen_coeff")
        factor = self._flat.get("prev_factor")
        compressed = self.stage == COMPRESSION
        return [{
            "trust_ratio": float(self._last_coeff[i]),
            "frozen_coeff": float(frozen[i]) if compressed and frozen is not None else None,
            "factor": float(factor[i]) if compressed and factor is not None and self._fresh_variance else None,
            "guarded": bool(self._last_guarded[i]) if compressed and self._last_guarded is not None else False,
        } for i in range(len(self._last_coeff))]

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._layout is None:
            self._layout = self._build_layout()
            if "flat" in self.state:
                self._check_loaded_state()
            else:
                self._init_state()
        if self._layout["numel"] == 0:
            return loss
        bytes_before = self.comm_stats.bytes_sent
        self._last_rise = None
        grads = self._gather_grads()
        flat = self._flat
        compressing = self.stage == COMPRESSION  # decided by the steps completed so far
        flat["step"] += 1
        if self._watching_rise() and flat["step"] < self.defaults["max_freeze_step"]:
            self._track_local_variance(grads)  # before anything is averaged: the local gradients
        if not compressing:
            self._warmup_step(grads)
            if self._freeze_now():
                self._freeze()
        else:
            self._compression_step(grads)
            if self._unfreeze_now():
                self._unfreeze()
        self.last_step_bytes = self.comm_stats.bytes_sent - bytes_before
        return loss

    def _gather_grads(self) -> torch.Tensor:
        """This rank's gradients in the flat layout, float32; ``None`` counts as zero."""
        lay = self._layout
        g = self._buffer("grad", lay["numel"])
        for p, s in zip(lay["params"], lay["slices"]):
            if p.grad is None:
                g[s].zero_()
            elif p.grad.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients "
                                 f"(parameter of shape {tuple(p.shape)}); use a dense embedding")
            else:
                g[s].copy_(p.grad.reshape(-1))
        return g

    def _hyper(self, key: str) -> torch.Tensor:
        """A per-group hyper-parameter expanded to one value per layer."""
        return self._per_layer([float(self.param_groups[gi][key]) for gi in self._layout["groups"]])

    def _per_layer(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self._layout["device"])

    def _bias_corrections(self) -> tuple[float, float]:
        if not self.defaults["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = self.defaults["betas"]
        t = self._flat["step"]
        return 1 - beta1 ** t, 1 - beta2 ** t

    def _add_weight_decay_(self, update: torch.Tensor) -> None:
        lay = self._layout
        for p, s, gi in zip(lay["params"], lay["slices"], lay["groups"]):
            wd = self.param_groups[gi]["weight_decay"]
            if wd != 0:
                update[s].add_(p.reshape(-1), alpha=wd)

    def _apply_(self, update: torch.Tensor, coeff: torch.Tensor) -> None:
        """``x -= lr * coeff * u`` per layer, with each group's learning rate."""
        lay = self._layout
        self._last_coeff = coeff.clone()
        for p, s, gi, c in zip(lay["params"], lay["slices"], lay["groups"], coeff.tolist()):
            step_size = self.param_groups[gi]["lr"] * c
            u = update[s].view(p.shape)
            if p.dtype == torch.float32:
                p.add_(u, alpha=-step_size)
            else:  # low-precision parameter: update in float32, round once
                p.copy_(p.float().add_(u, alpha=-step_size))

    def _update_norms(self, update: torch.Tensor) -> torch.Tensor:
        return F.norms([update[s] for s in self._layout["slices"]])

    def _decayed_update_norms(self, update: torch.Tensor, plain_norms: torch.Tensor) -> torch.Tensor:
        """The update's norms after weight decay, given those before: only the layers with weight
        decay changed (biases and LayerNorms usually have none)."""
        lay = self._layout
        decayed = [i for i, gi in enumerate(lay["groups"]) if self.param_groups[gi]["weight_decay"] != 0]
        if not decayed:
            return plain_norms
        norms = plain_norms.clone()
        norms[decayed] = F.norms([update[lay["slices"][i]] for i in decayed]).to(norms.device)
        return norms

    def _param_norms(self) -> torch.Tensor:
        return F.norms(self._layout["params"])

    def _freeze_now(self) -> bool:
        flat = self._flat
        if self.freeze_step is None:
            return False
        if self.freeze_step != "auto":
            return flat["step"] == self.freeze_step
        d = self.defaults
        waiting = self._waiting_for_trust_peak()
        # With the wait the floor bounds the freeze, not the criterion: the criterion and the wait
        # are watched from the start, so a floor below the step they call for changes nothing (on
        # b1024 the wait ends after 30% of the steps at every seed measured), and one above it
        # freezes at the floor (docs/convergence.md, "A floor under the wait")
        due = F.freeze_due(flat["step"], F.window_spread(flat["freeze_history"], flat["freeze_history_count"]),
                           flat.get("freeze_spread_peak", 0.0), 1 if waiting else d["min_freeze_step"],
                           d["max_freeze_step"], d["freeze_tolerance"], d["freeze_transient"],
                           d["freeze_transient_end"])
        if not waiting:
            return due
        if due and flat["freeze_ready_at"] is None:
            # kept: the spread may move above the tolerance again while the trust ratios still rise
            flat["freeze_ready_at"] = flat["step"]
            # The window restarts here, with this step's level as its first row: judged on a window
            # that reached back before this step, the freeze came at the bottom of the dip that the
            # plateau exit makes in the trust ratios (b1024 seed 1235: flat at step 81, then rising
            # until step 128), not after their peak.
            flat["trust_history_count"] = 1
        if flat["step"] >= d["max_freeze_step"]:
            return True
        if (flat["freeze_ready_at"] is not None and flat.get("trust_peak_at") is None
                and F.trust_peak_passed(self._trust_rise_now())):
            flat["trust_peak_at"] = flat["step"]  # kept: the ratios may rise again before the floor
        return flat.get("trust_peak_at") is not None and flat["step"] >= d["min_freeze_step"]

    def _track_local_variance(self, grads: torch.Tensor) -> None:
        """Each layer's mean squared *local* gradient, averaged over the ranks (one all-reduce of
        one float per layer) and then over time like Adam's ``v``. After the freeze it is what
        still shows how each layer's variance moves: the 1-bit momentum cannot (every element of a
        chunk comes back with the same magnitude, whichever layer it belongs to). Local rather than
        averaged gradients on both sides of the freeze, so the two levels compare like with like."""
        flat, lay = self._flat, self._layout
        mean_squares = F.norms([grads[s] for s in lay["slices"]]).pow_(2).div_(self._per_layer(lay["numels"]))
        allreduce_mean_(mean_squares, self.process_group, self.comm_stats)
        beta2 = self.defaults["betas"][1]
        flat["local_variance"].mul_(beta2).add_(mean_squares, alpha=1 - beta2)

    def _local_levels(self) -> torch.Tensor:
        """``log`` of the bias-corrected ``local_variance`` (``-inf`` for a layer with no gradient)."""
        beta2 = self.defaults["betas"][1]
        return torch.log(self._flat["local_variance"] / (1 - beta2 ** self._flat["step"]))

    def _push_levels_(self, history: str, levels: torch.Tensor) -> None:
        """Append one step's per-layer levels to a window kept in the state (``flat[history]``, its
        oldest row dropping out; ``flat[history + "_count"]`` counts the rows ever pushed)."""
        flat = self._flat
        hist = flat[history]
        hist.copy_(torch.roll(hist, -1, dims=0))
        hist[-1] = levels
        flat[history + "_count"] += 1

    def _unfreeze_now(self) -> bool:
        """Undo the freeze when some layer's variance rises within a window as fast as a plateau
        exit does (an exit that began after the freeze: the frozen variance no longer fits), but
        only before the cap, which bounds the steps with full communication. A slow creep,
        however far it goes in the end, is not an exit and does not undo it."""
        if not self._watching_rise() or self._flat["step"] >= self.defaults["max_freeze_step"]:
            return False  # from the cap on the freeze is final, and nothing is watched (or sent)
        self._push_levels_("rise_history", self._local_levels())
        flat = self._flat
        self._last_rise = rise = F.window_rise(flat["rise_history"], flat["rise_history_count"])
        rise = rise[torch.isfinite(rise)]
        return rise.numel() > 0 and float(rise.max()) > self.defaults["unfreeze_rise"]

    def _unfreeze(self) -> None:
        """Back to the warm-up: the variance continues from its frozen value (so ``v_hat`` is where
        it was frozen) and learns the new gradients again with full communication; the automatic
        criterion decides the next freeze after a full window of new levels (the transient's peak
        is kept: the run has been through one). The compression errors, at most one step's
        rounding, are dropped with the rest of stage 2's state."""
        flat = self._flat
        _, bc2 = self._bias_corrections()
        flat["exp_avg_sq"].mul_(bc2)
        for key in ("frozen_coeff", "prev_factor", "momentum_scale", "momentum_mask", "exp_avg_sq_fresh",
                    "worker_error", "server_error"):
            flat.pop(key, None)
        flat["frozen_at"] = None
        flat["freeze_history_count"] = 0
        if self._waiting_for_trust_peak():
            flat["trust_history_count"] = 0
            flat["freeze_ready_at"] = None
            flat["trust_peak_at"] = None
        flat["unfrozen_at"].append(flat["step"])
        self._scratch = {}  # the caches derived from the frozen variance

    def _record_warmup(self, coeff: torch.Tensor, param_norms: torch.Tensor, update_norms: torch.Tensor) -> None:
        """What the freeze and the guard need from a warm-up step, all from synchronized state:
        the relative step per unit learning rate (the guard's yardstick), and for ``"auto"`` each
        layer's variance level (whose settling triggers the freeze) and, with
        ``freeze_after_trust_peak``, the level of the trust ratio that a freeze now would keep."""
        flat = self._flat
        step_ratio, defined = F.relative_steps(coeff, param_norms, update_norms)
        F.update_ema_(flat["step_ratio_ema"], flat["step_ratio_count"], step_ratio, defined, _STEP_RATIO_BETA)
        if self.freeze_step == "auto":
            _, bc2 = self._bias_corrections()
            v_norms = F.norms([flat["exp_avg_sq"][s] for s in self._layout["slices"]]) / bc2
            self._push_levels_("freeze_history", torch.log(v_norms))
            spread = F.window_spread(flat["freeze_history"], flat["freeze_history_count"])
            if spread is not None:
                flat["freeze_spread_peak"] = max(flat.get("freeze_spread_peak", 0.0), spread)
        if self._waiting_for_trust_peak():
            kept = F.corrected_ema(flat["coeff_ema"], flat["coeff_ema_count"], self.defaults["coeff_beta"])
            # a layer whose trust ratio was never defined has no level (-inf): left out of the median
            levels = torch.where(flat["coeff_ema_count"] > 0, torch.log(kept), torch.full_like(kept, -math.inf))
            if self.defaults.get("trust_peak_layers") == "unclipped":
                # LAMB's clip pins a ratio at min_coeff or max_coeff, and its running average then
                # stands still (or creeps towards the bound) whatever the layer does: a rise of exactly
                # 0 that counts as a layer past its peak. On the main job 6 of the 42 layers were
                # clipped at step 96 (demo seed 1238; 20 at step 32), and the median rise that ended
                # the wait at step 120 was exactly 0. So a layer clipped at a step of the window has
                # no level there and is left out of the median, as a layer without a ratio is.
                clipped = (coeff <= self.defaults["min_coeff"]) | (coeff >= self.defaults["max_coeff"])
                levels = torch.where(clipped, torch.full_like(levels, -math.inf), levels)
            self._push_levels_("trust_history", levels)

    def _warmup_step(self, grads: torch.Tensor) -> None:
        """Stage 1 (all of LAMB): average the gradients, Adam moments, layer-wise trust ratio."""
        flat = self._flat
        allreduce_mean_(grads, self.process_group, self.comm_stats)
        beta1, beta2 = self.defaults["betas"]
        F.update_moments_(flat["exp_avg"], flat["exp_avg_sq"], grads, beta1, beta2)
        bc1, bc2 = self._bias_corrections()
        update = self._buffer("update", self._layout["numel"])
        den = F.adam_denominator(flat["exp_avg_sq"], bc2, self.defaults["eps"], out=update)
        F.adam_direction(flat["exp_avg"], den, bc1, out=update)
        self._add_weight_decay_(update)
        param_norms, update_norms = self._param_norms(), self._update_norms(update)
        if self._layerwise:
            coeff, defined = F.trust_ratios(param_norms, update_norms,
                                            self.defaults["min_coeff"], self.defaults["max_coeff"])
            if self.freeze_step is not None:
                F.update_ema_(flat["coeff_ema"], flat["coeff_ema_count"], coeff, defined,
                              self.defaults["coeff_beta"])
        else:
            coeff = self._per_layer([1.0] * len(self._layout["params"]))
        if self.freeze_step is not None:
            self._record_warmup(coeff, param_norms, update_norms)
        self._apply_(update, coeff)

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
        if self._watching_rise():
            flat["rise_history_count"] = 0
            self._push_levels_("rise_history", self._local_levels())  # the level at the freeze: the window's first
        flat["frozen_coeff"] = (F.corrected_ema(flat["coeff_ema"], flat["coeff_ema_count"],
                                                self.defaults["coeff_beta"])
                                if self._layerwise else self._per_layer([1.0] * len(lay["params"])))
        flat["prev_factor"] = self._per_layer([1.0] * len(lay["params"]))
        momentum_norms = F.norms([flat["exp_avg"][s] for s in lay["slices"]])
        flat["momentum_scale"] = F.momentum_scales(momentum_norms, self._per_layer(lay["numels"]))
        n = world_size_of(self.process_group)
        if n > 1:
            D = padded_size(lay["numel"], n)
            flat["worker_error"] = torch.zeros(D, dtype=torch.float32, device=lay["device"])
            flat["server_error"] = torch.zeros(D // n, dtype=torch.float32, device=lay["device"])

    def _frozen_denominator(self) -> torch.Tensor:
        """``sqrt(v_frozen) + eps`` (derived from the state, cached)."""
        v_frozen = self._flat["exp_avg_sq"]
        den = self._buffer("frozen_denominator", v_frozen.numel())
        if self._scratch.get("den_source") is not v_frozen:
            torch.sqrt(v_frozen, out=den).add_(self.defaults["eps"])
            self._scratch["den_source"] = v_frozen
        return den

    def _inverse_frozen_denominator(self) -> torch.Tensor:
        """``1 / (sqrt(v_frozen) + eps)`` (derived from the state, cached)."""
        den = self._frozen_denominator()
        if self._scratch.get("inverse_source") is not self._flat["exp_avg_sq"]:
            self._scratch["inverse_denominator"] = torch.reciprocal(den)
            self._scratch["inverse_source"] = self._flat["exp_avg_sq"]
        return self._scratch["inverse_denominator"]

    def _compression_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per element, what the momentum is multiplied by before compression, and what the
        decompressed result is multiplied by after (its inverse, times the momentum mask, so one
        pass both undoes the scaling and masks). ``"momentum"`` space: ``k_l``, one common RMS for
        every layer (the paper's). ``"update"`` space: ``1 / (sqrt(v_frozen) + eps)``, so the 1-bit
        code's equal magnitudes land on the preconditioned update rather than on the raw
        momentum, whose elements the frozen variance would otherwise rescale by orders of
        magnitude within one layer. Derived from the state and cached."""
        flat = self._flat
        if self.defaults["compression_space"] == "update":
            source = self._frozen_denominator()
        else:
            source = flat["momentum_scale"]
        scratch = self._scratch
        if scratch.get("scale_source") is not source or scratch.get("mask_source") is not flat["momentum_mask"]:
            if self.defaults["compression_space"] == "update":
                scale = self._inverse_frozen_denominator()
                unscale = source * flat["momentum_mask"]
            else:
                numels = torch.tensor(self._layout["numels"], device=self._layout["device"])
                scale = torch.repeat_interleave(source, numels)
                unscale = torch.reciprocal(scale).mul_(flat["momentum_mask"])
            scratch["scale"], scratch["unscale"] = scale, unscale
            scratch["scale_source"], scratch["mask_source"] = source, flat["momentum_mask"]
        return scratch["scale"], scratch["unscale"]

    def _guard_(self, coeff: torch.Tensor, update_norms: torch.Tensor) -> torch.Tensor:
        """Bound each layer's relative step ``|dx| / |x|`` (per unit learning rate) to
        ``update_guard`` times its warm-up average: a frozen variance that no longer fits the
        gradients makes ``m / sqrt(v_frozen)`` explode, and a bounded step lets the error feedback
        and the factor catch up instead of diverging. Costs no communication."""
        flat = self._flat
        guard = self.defaults.get("update_guard")
        if guard is None:
            return coeff
        step_ratio, defined = F.relative_steps(coeff, self._param_norms(), update_norms)
        reference = F.corrected_ema(flat["step_ratio_ema"], flat["step_ratio_count"], _STEP_RATIO_BETA)
        known = defined & (flat["step_ratio_count"] > 0)
        limit = guard * reference
        over = known & (step_ratio > limit)
        flat["guard_hits"] += int(over.sum())
        self._last_guarded = over
        return torch.where(over, coeff * limit / torch.where(over, step_ratio, torch.ones_like(step_ratio)), coeff)

    def _compression_step(self, grads: torch.Tensor) -> None:
        """Stage 2: local momentum, one compressed all-reduce, frozen variance and trust ratio."""
        flat, lay = self._flat, self._layout
        beta1, beta2 = self.defaults["betas"]
        eps = self.defaults["eps"]
        d = lay["numel"]
        m = flat["exp_avg"]
        m_prev = self._buffer("momentum_prev", d)
        m_prev.copy_(m)
        m.mul_(beta1).add_(grads, alpha=1 - beta1)  # this rank's momentum, from its local gradient
        n = world_size_of(self.process_group)
        den = self._frozen_denominator()
        if n > 1:
            scale, unscale = self._compression_scales()
            buf = self._buffer("comm", flat["worker_error"].numel())
            torch.mul(m, scale, out=buf[:d])
            buf[d:].zero_()  # the padding: the previous result left values there
            compressed_allreduce(buf, flat["worker_error"], flat["server_error"], self.process_group,
                                 self.comm_stats)
            torch.mul(buf[:d], unscale, out=m)
        else:
            m.mul_(flat["momentum_mask"])
        bc1, bc2 = self._bias_corrections()
        update = self._buffer("update", d)
        coeff = flat["frozen_coeff"]
        if self._fresh_variance:
            max_ratio, plain_norms = F.fresh_variance_statistics_(
                flat["exp_avg_sq_fresh"], m, m_prev, den, self._inverse_frozen_denominator(), bc1, bc2, beta1,
                beta2, eps, lay["slices"], lay["offsets"], update, scratch=self._buffer("ratio", d))
            self._add_weight_decay_(update)
            update_norms = self._decayed_update_norms(update, plain_norms)
            factor = F.scaling_factors(max_ratio, plain_norms, update_norms,
                                       self._hyper("weight_decay"), flat["prev_factor"],
                                       self.defaults["factor_min"], self.defaults["factor_max"],
                                       self.defaults["factor_threshold"])
            flat["prev_factor"] = factor
            coeff = coeff * factor
        else:
            F.adam_direction(m, den, bc1, out=update)
            self._add_weight_decay_(update)
            update_norms = self._update_norms(update) if self.defaults.get("update_guard") else None
        self._apply_(update, self._guard_(coeff, update_norms))
