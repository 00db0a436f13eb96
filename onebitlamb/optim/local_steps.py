"""Local steps after a freeze, and the syncs that average them (0/1 Adam's second phase).

After the freeze each rank moves its own parameters with its own momentum (a *local step*, stage
``LOCAL``: only the agreed finite flag is exchanged) and sums what it moved them by. Every
``local_interval`` steps a *sync* (stage ``COMPRESSION``) averages those sums with the 1-bit
all-reduce; every rank's parameters become the last sync's minus the average, bit for bit alike,
and its momentum the average per unit of step size. The interval doubles every
``local_step_scaler`` steps, up to ``local_step_clipper`` (both in the optimizer's ``defaults``).
Each layer's step is ``lr * u``: Adam's, with the frozen variance (``ZeroOneAdam``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from onebitlamb.comm import world_size_of
from onebitlamb.optim import functional as F
from onebitlamb.optim.checks import Waiting, parameter_checksum, parameters_checksum
from onebitlamb.optim.layout import Bucket, FlatLayout
from onebitlamb.optim.context import StepContext
from onebitlamb.optim.phases import COMPRESSION, LOCAL, Phase
from onebitlamb.optim.state_format import PARAMETERS


class LocalSteps(Phase):
    """The local-step phase (see the module's docstring). It begins at the end of the variance
    phase, with the variance frozen and bias-corrected by that phase's count of its updates."""

    takes_sharded_parameters = False
    not_sharded_because = ("its local steps leave each replica's parameters its own between syncs, while FSDP2 and "
                           "torch.distributed.checkpoint keep one copy of each shard for every replica (a checkpoint "
                           "between syncs would lose the other replicas' parameters); use OneBitLamb or OneBitAdam")

    # ------------------------------------------------------------------ state
    def init_state(self, ctx: StepContext, layout: FlatLayout) -> None:
        """The phase's entries, present from the start (DCP loads into a template of the same
        entries); the momentum and the update sum differ between ranks from the freeze on and
        are saved under this rank's key (``"rank_local"``)."""
        d, layers = layout.numel, len(layout.params)
        f32 = dict(dtype=torch.float32, device=layout.device)
        ctx.state.update({
            "rank_local": ["exp_avg", "update_sum"],
            "local_interval": 1, "local_counter": 0,
            "update_sum": torch.zeros(d, **f32),  # sum of lr * c * u since the last sync
            "lr_sums": torch.zeros(layers, dtype=torch.float64, device=layout.device),  # sum of lr * c
            "sync_params": torch.zeros(d, **f32),  # the parameters at the last sync, alike on every rank
            "born_after_freeze": 0,  # elements first reached after the freeze (``born``)
        })

    def check_state(self, ctx: StepContext) -> None:
        # saved before elements could be born after the freeze: none was
        ctx.state.setdefault("born_after_freeze", 0)

    def setup(self, ctx: StepContext, layout: FlatLayout, setup: Dict[str, Any]) -> None:
        """What the ranks agree on after the freeze: not their parameters, which differ between
        syncs, but the last sync's, which do not."""
        flat = ctx.state
        if flat["frozen_at"] is not None:
            setup["parameter values (crc32 of each tensor)"] = [parameter_checksum(flat["sync_params"][s])
                                                                for s in layout.slices]

    def rank_entries(self, ctx: StepContext, params: List[torch.Tensor]) -> Dict[str, Any]:
        """After the freeze the state holds the last sync's parameters and what this rank moved its
        own by since, so it records a checksum of them (``PARAMETERS``), for the first step after a
        load to check that the rank has its own back: between syncs a model saved from rank 0 only is
        another run on the other ranks, and any other model would be put back at the next sync.
        Before the freeze the ranks' parameters agree and the state holds nothing of them, as the
        1-bit optimizers'; the entry is there (None), so that a template for DCP has it."""
        frozen = ctx.state["frozen_at"] is not None
        return {PARAMETERS: parameters_checksum(params) if frozen else None}

    def stage(self, ctx: StepContext) -> str:
        """A sync or a local step."""
        flat = ctx.state
        return COMPRESSION if (flat["step"] + 1) % flat["local_interval"] == 0 else LOCAL

    # ------------------------------------------------------------------ the phase
    @staticmethod
    def _rates(ctx: StepContext) -> List[float]:
        """Each layer's step size ``lr``: what the update sum and ``lr_sums`` add up."""
        return [float(ctx.param_groups[g]["lr"]) for g in ctx.layout.groups]

    def begin(self, ctx: StepContext) -> None:
        """The freeze: the variance frozen (bias-corrected by its updates so far), the errors
        restarted (they will hold another quantity), the scales set for the update sums (what a
        sync sends is about ``lr m`` per layer: a layer with another step size gets another
        scale), and the parameters kept as the first sync point."""
        flat, lay = ctx.state, ctx.layout
        beta2 = ctx.defaults["betas"][1]
        bc2 = 1 - beta2 ** flat["variance_updates"] if ctx.defaults["bias_correction"] else 1.0
        v = flat["exp_avg_sq"]
        flat["momentum_mask"] = v != 0
        v.div_(bc2)
        flat["frozen_at"] = flat["step"]  # from here the denominator is the frozen one
        rates = torch.tensor(self._rates(ctx), dtype=torch.float32, device=lay.device)
        sent = flat["exp_avg"]
        if ctx.compresses_update():
            sent = sent / ctx.frozen_denominators()[0]
        flat["momentum_scale"] = F.momentum_scales(lay.norms(sent) * rates, lay.per_layer(lay.whole_numels))
        for key in ("worker_error", "server_error"):
            if key in flat:
                flat[key].zero_()
        lay.gather_params(flat["sync_params"])
        flat["update_sum"].zero_()
        flat["lr_sums"].zero_()
        flat["local_interval"], flat["local_counter"] = 1, 0

    # ------------------------------------------------------------------ elements born after the freeze
    # An element without a gradient at any variance step has no variance at the freeze: it moves
    # with neither the local steps nor the syncs (its mask is off) until some rank's gradient
    # reaches it, which every rank agrees on in the step's finiteness check, a local step's too
    # (``Exchange``). It then takes the variance Adam's first step would give it, bias-corrected,
    # from the ranks' gradients of that step, the same on every rank: their mean square, frozen
    # from then on as the others' are, since each rank's own momentum is all a local step has
    # (docs/algorithm.md, "Elements born after the freeze"). A larger variance than the square of
    # the mean gradient where the ranks disagree, so never zero: a smaller first step, not ``1/eps``.
    def waiting(self, ctx: StepContext) -> Optional[Waiting]:
        derived, mask = ctx.buffers.derived, ctx.state["momentum_mask"]
        if derived.get("waiting_source") is not mask:  # after the freeze or a load: one pass, then kept by born
            derived["waiting"], derived["waiting_source"] = int((~mask).sum()), mask
        return Waiting(mask, mean_squares=True) if derived["waiting"] else None

    def born(self, ctx: StepContext, indices: torch.Tensor, mean_squares: Optional[torch.Tensor]) -> None:
        flat = ctx.state
        flat["exp_avg_sq"][indices] = mean_squares
        flat["momentum_mask"][indices] = True
        flat["born_after_freeze"] += indices.numel()
        ctx.buffers.derived["waiting"] -= indices.numel()
        ctx.denominators_born_(indices)
        layer = ctx.layout.layer_of(indices)
        inverse = ctx.frozen_denominators()[1][indices] if ctx.compresses_update() else None
        ctx.scales_born_(indices, layer, inverse)

    @staticmethod
    def born_after_freeze(flat: Dict[str, Any]) -> int:
        return flat["born_after_freeze"]

    def restored(self, ctx: StepContext) -> None:
        """The variance of elements born at a refused step back to none (the frozen variance is not
        held: it changes in place only here, and 0 where the restored mask is off)."""
        if ctx.state["frozen_at"] is not None:
            ctx.state["exp_avg_sq"].mul_(ctx.state["momentum_mask"])

    def step(self, ctx: StepContext, stage: str, grads: torch.Tensor, received: List[torch.Tensor]) -> None:
        """A local step or a sync, then the interval's schedule."""
        flat = ctx.state
        if stage == LOCAL:
            ctx.apply_(self._local_update_once(ctx, flat["step"]), ctx.layout.ones())
        else:
            self._sync(ctx, received)
        flat["local_interval"], flat["local_counter"] = F.interval_after(
            flat["local_interval"], flat["local_counter"], ctx.defaults["local_step_scaler"],
            ctx.defaults["local_step_clipper"])

    def payload(self, ctx: StepContext, b: Bucket, out: torch.Tensor) -> None:
        """What bucket ``b`` sends at a sync: this rank's update sum, with this step's local update,
        times the frozen denominator, each layer scaled (over the denominator again in the update
        space)."""
        self._local_update_once(ctx, ctx.state["step"] + 1)
        self._sent_sum(ctx, b, out)

    @staticmethod
    def _sent_sum(ctx: StepContext, b: Bucket, out: torch.Tensor) -> None:
        """Bucket ``b``'s update sum as a sync sends it (``payload``), into ``out``."""
        scale, _ = ctx.compression_scales()
        den, _ = ctx.frozen_denominators()
        torch.mul(ctx.state["update_sum"][b.start:b.end], den[b.start:b.end], out=out)
        out.mul_(scale[b.start:b.end])

    def synchronized(self, ctx: StepContext) -> bool:
        """Alike right after a sync (nothing moved since), apart after a local step."""
        return not bool(ctx.state["lr_sums"].any())

    def synchronize(self, ctx: StepContext) -> None:
        """A sync without a step: the update sums so far averaged as a sync averages them (the same
        1-bit all-reduce, with the same error feedback), no local update added, the step count
        and the interval's schedule left as they are; the next scheduled sync averages only what
        the ranks moved since."""
        received = ctx.exchange.compress(lambda b, out: self._sent_sum(ctx, b, out))
        self._average_sums(ctx, received)

    @staticmethod
    def _local_update_once(ctx: StepContext, step: int) -> torch.Tensor:
        """Step ``step``'s local update from this rank's gradient, once (a sync's payload asks for
        it before the step gets to it): the momentum, Adam's direction with the frozen variance,
        and the update sum. Returns the update (the parameters are not moved here)."""
        scratch, flat, lay = ctx.buffers, ctx.state, ctx.layout
        update = scratch.update
        if scratch.derived.get("local_update_of") == step:
            return update
        # before the sums take it: at a sync its payload goes through the 1-bit all-reduce
        ctx.checked_step_sizes(lay.ones(), step)
        beta1, _ = ctx.betas()
        m = flat["exp_avg"]
        m.mul_(beta1).add_(scratch.grad, alpha=1 - beta1).mul_(flat["momentum_mask"])
        den, _ = ctx.frozen_denominators()
        bc1 = 1 - beta1 ** step if ctx.defaults["bias_correction"] else 1.0
        F.adam_direction(m, den, bc1, out=update)
        ctx.bound_direction_(update, step)  # a rank's own momentum over the frozen variance
        lay.add_weight_decay_(update, ctx.param_groups)
        rates = LocalSteps._rates(ctx)
        F.accumulate_update_(flat["update_sum"], update, rates, lay.slices)
        flat["lr_sums"].add_(torch.tensor(rates, dtype=torch.float64, device=lay.device))
        scratch.derived["local_update_of"] = step
        return update

    def _sync(self, ctx: StepContext, received: List[torch.Tensor]) -> None:
        """A sync step: this step's local update into the sums, then the sums averaged
        (``_average_sums``)."""
        self._local_update_once(ctx, ctx.state["step"])  # one process: no payload asked for it
        self._average_sums(ctx, received)
        ctx.last_coeff = ctx.layout.ones()

    @staticmethod
    def _average_sums(ctx: StepContext, received: List[torch.Tensor]) -> None:
        """The ranks' update sums averaged (``received``: the buckets' 1-bit averages): every rank's
        parameters become the last sync's minus the average (over the frozen denominator), bit for
        bit alike, and its momentum the average per unit of step size."""
        flat, lay = ctx.state, ctx.layout
        den, _ = ctx.frozen_denominators()
        if world_size_of(ctx.process_group) > 1:
            averaged = ctx.unscaled(received, flat["update_sum"])
        else:
            averaged = ctx.unscaled(received, torch.mul(flat["update_sum"], den))
        synced = ctx.buffers.synced
        torch.div(averaged, den, out=synced)
        torch.sub(flat["sync_params"], synced, out=synced)
        if not bool(torch.isfinite(synced).all()):
            raise FloatingPointError(f"{ctx.owner}: the sync of step {flat['step']} is not finite although "
                                     f"every rank's gradient was; the parameters were left as they were. Resume from "
                                     f"an earlier checkpoint with a lower learning rate")
        flat["sync_params"].copy_(synced)
        lay.assign_(synced)
        beta1, _ = ctx.betas()
        bc1 = 1 - beta1 ** flat["step"] if ctx.defaults["bias_correction"] else 1.0
        F.synced_momentum_(flat["exp_avg"], averaged, flat["lr_sums"], lay.slices, bc1)
        flat["update_sum"].zero_()
        flat["lr_sums"].zero_()
