"""What a run measures and writes: the held-out loss, the per-layer diagnostics, the freeze's
record, and the results: OUT/metrics.json, OUT/model_final.pt, OUT/curves.png, OUT/freeze.png.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from onebitlamb.train import data, files, plots
from onebitlamb.train.config import TrainConfig
from onebitlamb.train.data import atomic_save
from onebitlamb.train.model import mlm_loss

# the diagnostics' window (steps; at most the steps between diagnoses): long enough for the error
# feedback to return what single 1-bit steps leave out, short against the run
WINDOW_STEPS = 16


@torch.no_grad()
def evaluate_mlm(model, inputs, labels, batch: int, device) -> float:
    """Held-out MLM loss: mean cross-entropy over all masked tokens of the whole evaluation set,
    each rank doing its share (two scalars all-reduced, outside the optimizer's byte counts)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(inputs), batch):
        lab = labels[i:i + batch]
        total[0] += mlm_loss(model, inputs[i:i + batch], lab, reduction="sum").double()
        total[1] += (lab != data.IGNORE_INDEX).sum()
    model.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


def _relative_move(x: torch.Tensor, x0: Optional[torch.Tensor]) -> Optional[float]:
    """``|x - x0| / |x0|``; None without a start or where ``x0`` is 0."""
    if x0 is None:
        return None
    x0n = float(x0.float().norm())
    return float((x.detach().float() - x0.float()).norm()) / x0n if x0n > 0 else None


def layer_report(step: int, stage: str, names: dict, before: List[torch.Tensor], optimizer,
                 window_start: Optional[List[torch.Tensor]] = None) -> dict:
    """Per layer at this step: the coefficient the optimizer applied (LAMB's live trust ratio; in
    1-bit LAMB's compression stage, frozen coefficient x factor), the relative step size
    ``|x_after - x_before| / |x_before|`` measured on the parameters themselves, and the relative
    move over the last ``WINDOW_STEPS`` steps (``window_step``; None where the run has no start for
    it), and the parameter's norm (``norm``, to weigh the layers into the whole model's move). A single 1-bit step is noisy by design; the error feedback should keep the window's move
    close to LAMB's."""
    diag = optimizer.layer_diagnostics()
    layers = []
    starts = window_start if window_start is not None else [None] * len(before)
    for i, ((name, p), x0, xw) in enumerate(zip(names.items(), before, starts)):
        d = diag[i] if i < len(diag) else {}
        layers.append({"name": name, "trust_ratio": d.get("trust_ratio"), "frozen_coeff": d.get("frozen_coeff"),
                       "factor": d.get("factor"), "norm": float(p.detach().float().norm()),
                       "rel_step": _relative_move(p, x0),
                       "window_step": _relative_move(p, xw)})
    return {"step": step, "stage": stage, "layers": layers}


def write_metrics(cfg: TrainConfig, world: int, history: dict, ranks_bytes: List[int], layers: List[str],
                  model_state: dict, state_bytes: Optional[List[int]] = None) -> dict:
    """OUT/metrics.json, OUT/model_final.pt (``model_state``: the whole model's state dict) and the
    figures; ``state_bytes``: each rank's optimizer state in bytes."""
    steps = history["steps"]
    samples = cfg.steps * cfg.global_batch
    losses = [loss for _, loss in history["eval"]] + [r["loss"] for r in steps]
    if not all(math.isfinite(v) for v in losses):  # the loop stops before; never report one as a result
        raise RuntimeError(f"[{cfg.optimizer}] a non-finite loss reached the results; no metrics written")
    freeze = None if cfg.optimizer == "lamb" else [_json_safe(r["freeze"]) for r in steps]
    skipped = [i + 1 for i, r in enumerate(steps) if r.get("skipped")]
    metrics = {
        "optimizer": cfg.optimizer,
        "world_size": world,
        "final_eval_loss": history["eval"][-1][1],
        "samples": samples,
        "steps": cfg.steps,
        "freeze_step": None if freeze is None else freeze[-1]["frozen_at"],
        "warmup_steps": sum(r["stage"] == "warmup" for r in steps),
        # steps the optimizer skipped on every rank (a gradient not finite on some rank): their data
        # went unused, the schedule moved on
        "skipped_steps": skipped,
        "bytes_sent_per_rank": sum(ranks_bytes) / len(ranks_bytes),
        "bytes_sent_by_rank": ranks_bytes,
        # the optimizer's state on each rank (its tensors): 1/N of the whole under --shard N
        "optimizer_state_bytes_by_rank": state_bytes,
        # every rank calls the same collectives: this rank's count is every worker's
        "rounds_per_rank": steps[-1].get("collectives") if steps else 0,
        "wall_time_s": history["wall_time_s"],
        "train_time_s": history["train_time_s"],
        "samples_per_s": samples / max(history["train_time_s"], 1e-9),
        "eval_curve": history["eval"],
        "bytes_curve": [[i + 1, r["bytes"]] for i, r in enumerate(steps)],
        "rounds_curve": [[i + 1, r.get("collectives")] for i, r in enumerate(steps)],
        "train_loss": [r["loss"] for r in steps],
        "stage": [r["stage"] for r in steps],
        "lr": [r["lr"] for r in steps],
        "diagnostics": history["diagnostics"],
        "config": dataclasses.asdict(cfg),
        "freeze": freeze,
        "layers": layers,
    }
    atomic_save(model_state, os.path.join(cfg.out, "model_final.pt"))
    files.write_json(os.path.join(cfg.out, "metrics.json"), metrics)
    for png, draw, what in (("curves.png", plots.plot_run, "loss, bytes and rounds by step"),
                            ("freeze.png", plots.plot_freeze, "how the automatic freeze decided")):
        try:  # after the metrics are safe: a figure that fails to draw must not fail the run
            if draw(metrics, os.path.join(cfg.out, png)):
                print(f"[{cfg.optimizer}] {what}: {cfg.out}/{png}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 (matplotlib's errors have no common type)
            print(f"[{cfg.optimizer}] {png} not drawn: {exc!r}", file=sys.stderr)
    print(f"[{cfg.optimizer}] done: held-out loss {metrics['final_eval_loss']:.4f} after {samples} samples, "
          f"{metrics['bytes_sent_per_rank'] / 1e6:.1f} MB and {metrics['rounds_per_rank']} rounds per worker, "
          f"{metrics['wall_time_s']:.0f} s ({metrics['samples_per_s']:.0f} samples/s)"
          + (f", {len(skipped)} of {cfg.steps} steps skipped (a gradient not finite on some rank; "
             f"metrics.json's skipped_steps)" if skipped else ""), file=sys.stderr, flush=True)
    return {k: metrics[k] for k in ("final_eval_loss", "samples", "bytes_sent_per_rank", "rounds_per_rank",
                                    "wall_time_s")}


def _json_safe(value):
    """JSON has no infinities: a layer without gradient yet (log 0) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
