"""1-bit LAMB with local steps after its freeze (issue 50, item 3): an experiment, not an option.

    python -m benchmarks.local_lamb --seeds 3     # 6 demo runs beyond the convergence benchmark's, ~5 min each
    python -m benchmarks.local_lamb --seeds 3 --preset b1024     # the same rows on b1024, ~10 min each

After 1-bit LAMB's freeze every step sends 1 bit per element; what is left to save is rounds.
Here the workers take local steps after the freeze, as 0/1 Adam does after its variance freeze
(the same code: ``onebitlamb/optim/local_steps.py``): each rank moves its own parameters by
``lr * c * u`` (``u`` Adam's direction from its own momentum and the frozen variance, ``c`` each
layer's trust ratio frozen at the freeze), and every ``H`` steps the ranks average what they moved
by with the 1-bit all-reduce and restart from the average. ``H`` starts at 1 and doubles every
``local_step_scaler`` steps up to ``local_step_clipper``: the main job's 0/1 Adam schedule, a
tenth of the run and 16. 1-bit LAMB's per-layer factor is left out (it reads the averaged
momentum of every step, which local steps do not have), so the row "every step a sync" (H = 1
throughout: the same rule without local steps) separates what the local steps cost from what
leaving the factor out costs.

Rows: LAMB and 1-bit LAMB with the main job's defaults (the convergence benchmark's runs, reused
from the same folders), then the two rows above, each ``python -m benchmarks.local_lamb
--local-step-clipper H pretrain ...``: the main job (``onebitlamb pretrain`` with 1-bit LAMB's
flags) with this module's optimizer in place of ``OneBitLamb``, the rest of the job unchanged.
Writes the "local-lamb" section of BENCHMARKS.md ("local-lamb-b1024" with ``--preset b1024``).
The issue's rule: the option is added to ``OneBitLamb`` only if it holds the loss within 1% of
LAMB's at fewer whole-run bytes than 1-bit LAMB's. Run from the repository root.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

import onebitlamb
from benchmarks import convergence
from benchmarks.variants import DEFAULT, LAMB, Variant, main_for
from onebitlamb.optim.layout import Bucket, FlatLayout
from onebitlamb.optim.local_steps import LocalSteps
from onebitlamb.optim.staged import WARMUP
from onebitlamb.optim.zero_one import steps_of
from onebitlamb.train import loop

LOCAL_STEP_SCALER = 0.1  # a tenth of the run at each interval, as the main job's 0/1 Adam
LOCAL_STEP_CLIPPER = 16


class LocalStepOneBitLamb(LocalSteps, onebitlamb.OneBitLamb):
    """``OneBitLamb`` until its freeze (the same warm-up, the same freeze), then local steps with
    its frozen trust ratio, synchronised every ``local_interval`` steps (``LocalSteps``)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, *, total_steps: int, local_step_scaler: float = 0.1,
                 local_step_clipper: int = 16, **kwargs: Any) -> None:
        if kwargs.get("overlap_with_backward"):
            raise ValueError("Invalid overlap_with_backward: True (a sync needs the step's update first)")
        super().__init__(params, lr, **kwargs)
        if not isinstance(local_step_clipper, int) or local_step_clipper < 1:
            raise ValueError(f"Invalid local_step_clipper: {local_step_clipper!r} (must be an integer >= 1)")
        self.defaults.update(local_step_scaler=steps_of("local_step_scaler", local_step_scaler, total_steps),
                             local_step_clipper=local_step_clipper)
        # the factor reads the averaged momentum of every step, which local steps do not have
        self._fresh_variance = False

    def _new_state(self, layout: FlatLayout) -> None:
        super()._new_state(layout)
        self._new_local_state(layout)

    def _setup(self, layout: FlatLayout) -> Dict[str, Any]:
        setup = super()._setup(layout)
        self._local_setup(setup, layout)
        return setup

    @property
    def stage(self) -> str:
        if "flat" not in self.state or self._flat["frozen_at"] is None:
            return WARMUP
        return self._local_stage()

    def _local_coefficients(self) -> torch.Tensor:
        return self._flat["frozen_coeff"]

    def _take_step(self, stage: str, grads: torch.Tensor) -> None:
        if self._flat["frozen_at"] is None:
            super()._take_step(stage, grads)  # the warm-up, and the freeze at its end
        else:
            self._local_phase_step(stage)

    def _freeze(self) -> None:
        super()._freeze()
        self._start_local_phase()

    def _bucket_momentum(self, b: Bucket) -> torch.Tensor:
        """At a sync (the only exchange after the freeze), this rank's update sum."""
        buf = self._comm_region(b)
        self._sync_payload(b, buf[:b.numel])
        return buf


def _make_optimizer(cfg, groups) -> torch.optim.Optimizer:
    """The main job's optimizer (``onebitlamb.train.loop.make_optimizer``), with this module's in
    place of ``OneBitLamb``, built from the same settings."""
    if cfg.optimizer != "onebitlamb":
        return _library_make_optimizer(cfg, groups)
    if cfg.local_size is not None or cfg.bucket_cap_mb is not None:
        raise ValueError("benchmarks.local_lamb: one process group and one bucket only (--local-size, "
                         "--bucket-cap-mb are not part of the experiment)")
    return LocalStepOneBitLamb(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                               weight_decay=cfg.weight_decay, freeze_step=cfg.freeze_step(),
                               compression_space=cfg.compression_space,
                               trust_ratio_after_freeze=cfg.trust_ratio_after_freeze,
                               warmup_dtype=getattr(torch, cfg.warmup_dtype), total_steps=cfg.steps,
                               local_step_scaler=LOCAL_STEP_SCALER, local_step_clipper=_split(sys.argv[1:])[0])


def _split(argv: Sequence[str]) -> Tuple[int, List[str]]:
    """``--local-step-clipper H`` before the main job's command line: ``(H, the rest)``, H 16 without it."""
    argv = list(argv)
    if argv[:1] == ["--local-step-clipper"]:
        return int(argv[1]), argv[2:]
    return LOCAL_STEP_CLIPPER, argv


def _training(argv: Sequence[str]) -> bool:
    """Whether ``argv`` runs the main job (``pretrain``) rather than the benchmark."""
    return _split(argv)[1][:1] == ["pretrain"]


_library_make_optimizer = loop.make_optimizer
# The job's workers are spawned: each runs this module again as its main module (``__mp_main__``)
# with this command line, so the substitution holds in every worker, and only in this program.
if __name__ in ("__main__", "__mp_main__") and _training(sys.argv[1:]):
    loop.make_optimizer = _make_optimizer


def _row(name: str, folder: str, clipper: int) -> Variant:
    return Variant(convergence.Row(name, folder, list(DEFAULT.row.flags)),
                   program=("benchmarks.local_lamb", "--local-step-clipper", str(clipper)))


LOCAL_STEPS = _row(f"1-bit LAMB, local steps after the freeze (H up to {LOCAL_STEP_CLIPPER})", "onebitlamb-local",
                   LOCAL_STEP_CLIPPER)
EVERY_STEP_SYNC = _row("1-bit LAMB, the same rule with every step a sync (H = 1)", "onebitlamb-local-h1", 1)
VARIANTS = [LAMB, DEFAULT, LOCAL_STEPS, EVERY_STEP_SYNC]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _training(argv):
        from onebitlamb.cli import main as onebitlamb_main
        return onebitlamb_main(_split(argv)[1])
    title = "1-bit LAMB with local steps after the freeze (an experiment)"
    note = (" The last two rows run it through `python -m benchmarks.local_lamb --local-step-clipper H pretrain ...`: "
            "this module's optimizer in place of `OneBitLamb` (its docstring has the rule; no per-layer factor), "
            "the local interval doubling every tenth of the run up to H.")
    return main_for("benchmarks.local_lamb", __doc__, title, "local-lamb", {"demo": VARIANTS, "b1024": VARIANTS},
                    argv, note, presets=("demo", "b1024"))


if __name__ == "__main__":
    sys.exit(main())
