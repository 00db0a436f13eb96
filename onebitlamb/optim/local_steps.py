"""Local steps after a freeze, and the syncs that average them (0/1 Adam's second phase).

After the freeze each rank moves its own parameters with its own momentum (a *local step*, stage
``LOCAL``: only the agreed finite flag is exchanged) and sums what it moved them by. Every
``local_interval`` steps a *sync* (stage ``COMPRESSION``) averages those sums with the 1-bit
all-reduce; every rank's parameters become the last sync's minus the average, bit for bit alike,
and its momentum the average per unit of step size. The interval doubles every
``local_step_scaler`` steps, up to ``local_step_clipper``.

``LocalSteps`` holds this phase for ``ZeroOneAdam`` (Adam's step, coefficient 1). The host keeps
``local_step_scaler`` and ``local_step_clipper`` in its ``defaults`` and calls these methods from its
own ``_new_state``, ``_setup``, ``stage``, ``_take_step``, ``_bucket_momentum`` and ``_freeze``.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from onebitlamb.comm import world_size_of
from onebitlamb.optim import functional as F
from onebitlamb.optim.checks import parameter_checksum, parameters_checksum
from onebitlamb.optim.layout import Bucket, FlatLayout
from onebitlamb.optim.staged import COMPRESSION, LOCAL
from onebitlamb.optim.state_format import PARAMETERS


class LocalSteps:
    """The local-step phase, mixed into a ``StagedOptimizer`` (see the module's docstring)."""

    # ------------------------------------------------------------------ state
    def _new_local_state(self, layout: FlatLayout) -> None:
        """The phase's entries, present from the start (DCP loads into a template of the same
        entries); the momentum and the update sum differ between ranks from the freeze on and
        are saved under this rank's key (``"rank_local"``)."""
        d, layers = layout.numel, len(layout.params)
        f32 = dict(dtype=torch.float32, device=layout.device)
        self._flat.update({
            "rank_local": ["exp_avg", "update_sum"],
            "local_interval": 1, "local_counter": 0,
            "update_sum": torch.zeros(d, **f32),  # sum of lr * c * u since the last sync
            "lr_sums": torch.zeros(layers, dtype=torch.float64, device=layout.device),  # sum of lr * c
            "sync_params": torch.zeros(d, **f32),  # the parameters at the last sync, alike on every rank
        })

    def _local_setup(self, setup: Dict[str, Any], layout: FlatLayout) -> None:
        """What the ranks agree on after the freeze: not their parameters, which differ between
        syncs, but the last sync's, which do not."""
        flat = self._flat
        if flat["frozen_at"] is not None:
            setup["parameter values (crc32 of each tensor)"] = [parameter_checksum(flat["sync_params"][s])
                                                                for s in layout.slices]

    def _rank_entries(self, params: List[torch.Tensor]) -> Dict[str, Any]:
        """After the freeze the state holds the last sync's parameters and what this rank moved its
        own by since, so it records a checksum of them (``PARAMETERS``), for the first step after a
        load to check that the rank has its own back: between syncs a model saved from rank 0 only is
        another run on the other ranks, and any other model would be put back at the next sync.
        Before the freeze the ranks' parameters agree and the state holds nothing of them, as the
        1-bit optimizers'; the entry is there (None), so that a template for DCP has it."""
        frozen = self._flat["frozen_at"] is not None
        return {PARAMETERS: parameters_checksum(params) if frozen else None}

    def _local_stage(self) -> str:
        """The next step's stage after the freeze: a sync or a local step."""
        flat = self._flat
        return COMPRESSION if (flat["step"] + 1) % flat["local_interval"] == 0 else LOCAL

    @property
    def parameters_synchronized(self) -> bool:
        """Whether every rank's parameters are alike now: before the freeze and after a sync; not
        after a local step (a checkpoint then needs each rank's parameters)."""
        flat = self.state.get("flat")
        return flat is None or flat["frozen_at"] is None or not bool(flat["lr_sums"].any())

    # ------------------------------------------------------------------ the coefficients
    def _local_coefficients(self) -> torch.Tensor:
        """Each layer's coefficient of a local step's update (its step is ``lr * c * u``): 1, Adam."""
        return self._layout.ones()

    def _local_rates(self) -> List[float]:
        """Each layer's step size ``lr * c``: what the update sum and ``lr_sums`` add up."""
        lay = self._layout
        return [float(self.param_groups[g]["lr"]) * c for g, c in zip(lay.groups, self._local_coefficients().tolist())]

    # ------------------------------------------------------------------ the phase
    def _start_local_phase(self) -> None:
        """At the end of the freeze (the variance frozen and bias-corrected, ``frozen_at`` set): the
        errors restarted (they will hold another quantity), the scales set for the update sums
        (what a sync sends is about ``lr c m`` per layer: a layer with another step size gets
        another scale), and the parameters kept as the first sync point."""
        flat, lay = self._flat, self._layout
        rates = torch.tensor(self._local_rates(), dtype=torch.float32, device=lay.device)
        sent = flat["exp_avg"]
        if self._compresses_update():
            sent = sent / self._frozen_denominators()[0]
        flat["momentum_scale"] = F.momentum_scales(lay.norms(sent) * rates, lay.per_layer(lay.numels))
        for key in ("worker_error", "server_error"):
            if key in flat:
                flat[key].zero_()
        lay.gather_params(flat["sync_params"])
        flat["update_sum"].zero_()
        flat["lr_sums"].zero_()
        flat["local_interval"], flat["local_counter"] = 1, 0

    def _local_phase_step(self, stage: str) -> None:
        """A step after the freeze: a local step or a sync, then the interval's schedule."""
        flat = self._flat
        if stage == LOCAL:
            self._apply_(self._local_update_once(flat["step"]), self._local_coefficients())
        else:
            self._sync()
        flat["local_interval"], flat["local_counter"] = F.interval_after(
            flat["local_interval"], flat["local_counter"], self.defaults["local_step_scaler"],
            self.defaults["local_step_clipper"])

    def _sync_payload(self, b: Bucket, mine: torch.Tensor) -> None:
        """What bucket ``b`` sends at a sync, into ``mine``: this rank's update sum times the frozen
        denominator, each layer scaled (over the denominator again in the update space)."""
        self._local_update_once(self._flat["step"] + 1)
        scale, _ = self._compression_scales()
        den, _ = self._frozen_denominators()
        torch.mul(self._flat["update_sum"][b.start:b.end], den[b.start:b.end], out=mine)
        mine.mul_(scale[b.start:b.end])

    def _averaged(self, local: torch.Tensor) -> torch.Tensor:
        """The 1-bit average the buckets' exchanges left in the communication buffer, unscaled and
        masked; with one process, ``local`` masked."""
        _, unscale = self._compression_scales()
        out = self._scratch.buffer("averaged", self._layout.numel)
        if world_size_of(self.process_group) > 1:
            buf = self._scratch.buffers["comm"]
            for b in self.exchange.buckets:
                torch.mul(buf[b.comm][:b.numel], unscale[b.start:b.end], out=out[b.start:b.end])
        else:
            torch.mul(local, self._flat["momentum_mask"], out=out)
        return out

    def _local_update_once(self, step: int) -> torch.Tensor:
        """Step ``step``'s local update from this rank's gradient, once (a sync's exchange asks for
        it before ``step()`` gets to it): the momentum, Adam's direction with the frozen variance,
        and the update sum. Returns the update (the parameters are not moved here)."""
        scratch, flat, lay = self._scratch, self._flat, self._layout
        update = scratch.buffer("update", lay.numel)
        if scratch.derived.get("local_update_of") == step:
            return update
        beta1, _ = self._betas()
        m = flat["exp_avg"]
        m.mul_(beta1).add_(scratch.buffers["grad"], alpha=1 - beta1).mul_(flat["momentum_mask"])
        den, _ = self._frozen_denominators()
        bc1 = 1 - beta1 ** step if self.defaults["bias_correction"] else 1.0
        F.adam_direction(m, den, bc1, out=update)
        self._bound_direction_(update, step)  # a rank's own momentum over the frozen variance
        lay.add_weight_decay_(update, self.param_groups)
        rates = self._local_rates()
        F.accumulate_update_(flat["update_sum"], update, rates, lay.slices)
        flat["lr_sums"].add_(torch.tensor(rates, dtype=torch.float64, device=lay.device))
        scratch.derived["local_update_of"] = step
        return update

    def _sync(self) -> None:
        """The ranks' update sums averaged: every rank's parameters become the last sync's minus the
        average (over the frozen denominator), bit for bit alike, and its momentum the average
        per unit of step size."""
        flat, lay = self._flat, self._layout
        self._local_update_once(flat["step"])  # one process: no exchange asked for it
        den, _ = self._frozen_denominators()
        if world_size_of(self.process_group) > 1:
            averaged = self._averaged(flat["update_sum"])
        else:
            averaged = self._averaged(torch.mul(flat["update_sum"], den))
        synced = self._scratch.buffer("synced", lay.numel)
        torch.div(averaged, den, out=synced)
        torch.sub(flat["sync_params"], synced, out=synced)
        if not bool(torch.isfinite(synced).all()):
            raise FloatingPointError(f"{type(self).__name__}: the sync of step {flat['step']} is not finite although "
                                     f"every rank's gradient was; the parameters were left as they were. Resume from "
                                     f"an earlier checkpoint with a lower learning rate")
        flat["sync_params"].copy_(synced)
        lay.assign_(synced)
        beta1, _ = self._betas()
        bc1 = 1 - beta1 ** flat["step"] if self.defaults["bias_correction"] else 1.0
        F.synced_momentum_(flat["exp_avg"], averaged, flat["lr_sums"], lay.slices, bc1)
        flat["update_sum"].zero_()
        flat["lr_sums"].zero_()
        self._last_coeff = self._local_coefficients().clone()
