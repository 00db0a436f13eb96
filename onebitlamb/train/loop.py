"""One rank's run of the main job, top to bottom: data, model, optimizer and schedule, resume,
the loop (forward and backward over the micro-batches, clip, step, evaluate, checkpoint, stop),
then the results. ``train_rank`` is what every worker process runs.

The model is not wrapped in DDP: gradients of the micro-batches accumulate locally, with no
communication, and ``optimizer.step()`` does all of it (averages the gradients in LAMB and in the
warm-up stage, sends the 1-bit compressed momentum after the freeze). Gradient clipping therefore
acts on each worker's *local* accumulated gradient right before ``step()``, identically for the
three optimizers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import random
import signal
import sys
import time
from typing import Optional

import torch

import onebitlamb
from onebitlamb.train import data, files, runlog
from onebitlamb.train.checkpoints import CheckpointStore, TrainState, checkpoint_folder
from onebitlamb.train.config import RunError, SetupError, TrainConfig
from onebitlamb.train.metrics import WINDOW_STEPS, evaluate_mlm, layer_report, write_metrics
from onebitlamb.train.model import build_model, mlm_loss
from onebitlamb.train.ranks import agree_any, gather_bytes, rank_device, ranks_flagged
from onebitlamb.train.sharding import Sharding, clip_gradients as clip_sharded, local_tensors, saved_model


class _Phase:
    """Where this rank is, for the message when a collective times out."""
    now = "the start (the checkpoint, the first evaluation)"


# A run whose optimizer skipped more than this fraction of its steps (a gradient not finite on some
# rank: the step is skipped on every rank alike) ends with an error, its metrics written: its
# result is not that of the steps asked for.
MAX_SKIPPED_FRACTION = 0.1


# what gloo says on a rank whose peer left the group (that rank's process ended, with its own error)
PEER_GONE = ("connection closed by peer", "connection reset by peer")


class RankTimeout(RunError):
    """A collective timed out: another rank died, hung or was paused."""


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict:
    """One rank's run. A collective that times out (another rank died, hung or was paused) ends
    it with an error that says where this rank waited."""
    phase = _Phase()
    try:
        return _train_rank(rank, world, cfg, phase)
    except files.WriteError as exc:  # a full disk under a file of the run's (log.csv, metrics.json)
        raise RunError(f"rank {rank}: {exc}, in {phase.now}. The last checkpoint in {cfg.out} is complete: continue "
                       f"with --resume once that is fixed") from None
    except RuntimeError as exc:  # torch.distributed's DistBackendError is one
        said = str(exc).lower()
        if any(m in said for m in PEER_GONE):
            raise RunError(f"rank {rank}: another rank left the run in {phase.now} (its own error says why). The "
                           f"last checkpoint in {cfg.out} is complete: continue with --resume") from None
        if "timed out" not in said and "timeout" not in said:
            raise
        raise RankTimeout(f"rank {rank} waited {cfg.timeout:g} s for the other ranks in {phase.now} and gave up: "
                           f"another rank has died, hung or been paused. The last checkpoint in {cfg.out} is "
                           f"complete: continue with --resume (--timeout sets the wait)") from exc


@dataclasses.dataclass
class RankStart:
    """What a rank of the main job starts from, before its optimizer: the data (the cached corpus;
    every step's global batch is a function of (seed, step)), this rank's share of the held-out
    batch, and the model, built from the seed, so every rank holds the same initial weights."""
    device: torch.device
    corpus: data.Corpus
    accum: int  # micro-batches a step, per rank
    eval_inputs: torch.Tensor
    eval_labels: torch.Tensor
    model: torch.nn.Module
    groups: list  # the optimizer's parameter groups (``param_groups``)
    names: dict   # parameter name -> parameter
    sharding: Optional[Sharding] = None  # under --shard: the mesh (the model is sharded over it)


def start_rank(cfg: TrainConfig, rank: int, world: int) -> RankStart:
    """Seeds, data and model of one rank: the part of a run that does not depend on its optimizer."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = rank_device()
    corpus = prepare_corpus(cfg, log=lambda *a: None)
    eval_inputs, eval_labels = data.eval_batch(corpus, cfg.eval_samples, cfg.seed, cfg.mask_prob)
    model = build_model(cfg.model, cfg.seed).to(device)
    model.train()
    sharding = Sharding(world, cfg.shard, device) if cfg.shard > 1 else None
    if sharding is not None:
        sharding.shard(model)
    groups, names = param_groups(model, cfg.weight_decay)
    return RankStart(device, corpus, cfg.global_batch // (world * cfg.micro_batch), eval_inputs[rank::world].to(device),
                     eval_labels[rank::world].to(device), model, groups, names, sharding)


def lr_factor(cfg: TrainConfig):
    """The learning-rate schedule, as ``LambdaLR``'s factor of step ``s``: linear warm-up over
    ``cfg.warmup_steps``, then linear decay to 0 at ``cfg.steps``."""
    warm, total = cfg.warmup_steps, cfg.steps
    return lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm))


def _train_rank(rank: int, world: int, cfg: TrainConfig, phase: _Phase) -> dict:
    setup = start_rank(cfg, rank, world)
    device, corpus, accum, model, names = setup.device, setup.corpus, setup.accum, setup.model, setup.names
    eval_inputs, eval_labels = setup.eval_inputs, setup.eval_labels
    master = rank == 0
    stop_requested = _install_stop_handler()

    sharding = setup.sharding
    optimizer = make_optimizer(cfg, setup.groups, None if sharding is None else sharding.replicate_group)
    # what the loop reads and diagnoses of the parameters: this rank's shards under --shard (the
    # diagnostics then describe rank 0's shard of each layer); read afresh each time
    viewed = functools.partial(local_tensors, names)
    warm = cfg.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))

    # the run's record (saved in every checkpoint): one entry per step, the evaluations, the diagnostics
    state = TrainState(model, optimizer, scheduler,
                       {"steps": [], "eval": [], "diagnostics": [], "train_time_s": 0.0, "wall_time_s": 0.0})
    store = CheckpointStore(cfg, rank, world, device)
    start_step = store.load(state) if cfg.resume else 0
    history = state.history
    last_saved = start_step or None  # the step of the last checkpoint written (kept when a loss goes non-finite)
    if master:
        files.write_json(os.path.join(cfg.out, "config.json"), dataclasses.asdict(cfg), indent=1)
        print(f"[{cfg.optimizer}] {world} workers on {device}, {cfg.steps} steps of {cfg.global_batch} samples "
              f"({accum} micro-batches of {cfg.micro_batch} per worker), lr {cfg.lr:g}, warm-up {warm} steps"
              f"{_freeze_banner(optimizer)}" + (f", resuming at step {start_step}" if start_step else ""),
              file=sys.stderr, flush=True)

    log = runlog.RunLog(cfg, start_step, history) if master else None  # console, log.csv, TensorBoard
    # the diagnostics' window: how far the parameters moved over the last `window` steps, which error
    # feedback keeps close to LAMB's even where single 1-bit steps are noisy (a run resumed inside a
    # window has no start for it: that diagnosis records none)
    window, window_start = min(WINDOW_STEPS, cfg.eval_every), None

    def evaluate(step: int) -> Optional[str]:
        """The held-out loss (the same number on every rank); a message when it is not finite."""
        loss = evaluate_mlm(model, eval_inputs, eval_labels, 2 * cfg.micro_batch, device)
        if not math.isfinite(loss):
            return f"the held-out loss is {loss} after step {step}"
        history["eval"].append([step * cfg.global_batch, loss])
        return None

    # the loop; a non-finite loss or parameter stops it on every rank alike (`error`), before
    # anything of that step is applied or saved
    error = evaluate(0) if start_step == 0 else None
    if start_step == 0 and error is None and log is not None:
        log.report(0, history)
    done, stopped_by, t_wall0 = start_step, None, time.perf_counter()
    wall_before = history["wall_time_s"]
    for step in range(start_step, cfg.steps if error is None else start_step):
        phase.now = f"step {step + 1} (its agreement on a finite loss, or the optimizer's collectives)"
        t0 = time.perf_counter()
        # one global batch: this rank's shard, forward and backward over its micro-batches
        inputs, labels = data.rank_batch(corpus, step, rank, world, cfg.global_batch, cfg.seed, cfg.mask_prob)
        loss_sum = forward_backward(model, optimizer, inputs, labels, accum, cfg.micro_batch, device)
        if cfg.clip > 0 and sharding is not None:  # the replica's gradient, its shards' norms summed in the node
            clip_sharded(model, cfg.clip, sharding.shard_group)
        elif cfg.clip > 0:  # this worker's local gradient, before step() communicates anything
            clip_gradients(model, cfg.clip)
        bad = ranks_flagged(not math.isfinite(loss_sum), rank, world, device)
        if bad:
            error = (f"the training loss of step {step + 1} is not finite on rank(s) {bad} (rank {rank}: loss "
                     f"{loss_sum}); the step was not applied")
            break

        # the optimizer step: all communication happens in here
        diagnose = master and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps)
        before = [p.detach().clone() for p in viewed().values()] if diagnose else None
        if master and (step + window) % cfg.eval_every == 0:  # the parameters `window` steps before a diagnosis
            window_start = (step, [p.detach().clone() for p in viewed().values()])
        stage = optimizer.stage  # the stage this step runs in (a freeze happens at the end of a step)
        lr = scheduler.get_last_lr()[0]  # this step's (the scheduler's step below sets the next one's)
        try:
            optimizer.step()
        except FloatingPointError as exc:  # on every rank alike: skips in a row, or an update not finite
            error = f"step {step + 1}: {exc}"
            break
        scheduler.step()
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps:
            # 0/1 Adam between its syncs: every rank's parameters are its own; a scheduled
            # checkpoint and the final model hold the ranks' average, one model (a sync without a
            # step; nothing for the other optimizers). A checkpoint on a stop keeps each rank's own
            # instead, so that the resumed run is the uninterrupted one
            optimizer.synchronize()
        history["train_time_s"] += time.perf_counter() - t0

        stats = optimizer.stats()
        history["steps"].append({"loss": loss_sum, "bytes": stats["bytes_sent"], "collectives": stats["rounds"],
                                 "stage": stage, "lr": lr, "freeze": stats["freeze"],
                                 "skipped": bool(stats["last_step_skipped"])})
        if diagnose:
            start = window_start[1] if window_start is not None and window_start[0] == step + 1 - window else None
            history["diagnostics"].append({**layer_report(step + 1, stage, viewed(), before, optimizer, start),
                                           "window": window if start is not None else None})

        # evaluation, checkpoint, stop
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            phase.now = f"the evaluation after step {done}"
            error = evaluate(done)
            if error is not None:
                break
        if log is not None:
            log.report(done, history)
        history["wall_time_s"] = wall_before + time.perf_counter() - t_wall0
        phase.now = f"the agreement to go on after step {done}"
        stop, nonfinite = agree_any([stop_requested(), not _all_finite(viewed().values())], device)
        if nonfinite:  # a checkpoint never holds a non-finite parameter
            error = f"the parameters are not finite after step {done}"
            break
        if cfg.stop_after_steps and cfg.stop_after_steps <= done < cfg.steps:
            stop, stopped_by = True, stopped_by or "stop-after-steps"
        elif stop:
            stopped_by = "interrupt"
        if done % cfg.ckpt_every == 0 or stop or done == cfg.steps:
            phase.now = f"the checkpoint of step {done}"
            store.save(done, state)
            last_saved = done
        if stop:
            break
    if log is not None:
        log.close()
    phase.now = "the end of the run (byte counts, metrics)"

    if error is not None:
        return _stopped_by(error, cfg, done, last_saved, master)
    completed = stopped_by is None
    summary = {"completed": completed, "interrupted": stopped_by == "interrupt", "step": done}
    ranks_bytes = gather_bytes(optimizer.stats()["bytes_sent"], world, device)
    state_bytes = gather_bytes(optimizer_state_bytes(optimizer), world, device)
    # the whole model: under --shard gathered from the shards, on every rank (a collective)
    final_model = saved_model(model, whole=True) if completed else None
    if completed and master:
        summary.update(write_metrics(cfg, world, history, ranks_bytes, list(names), final_model, state_bytes))
    skipped = skipped_steps(history)
    if completed and len(skipped) > MAX_SKIPPED_FRACTION * cfg.steps:
        summary["error"] = (f"[{cfg.optimizer}] {len(skipped)} of {cfg.steps} steps were skipped (a gradient not "
                            f"finite on some rank; steps {_ranges(skipped)}): more than "
                            f"{MAX_SKIPPED_FRACTION:.0%}, so the result is not that of the run asked for (metrics.json "
                            f"records them). A smaller --lr, or --clip, usually helps")
        if master:
            print(summary["error"], file=sys.stderr, flush=True)
    elif not completed and master:
        print(f"[{cfg.optimizer}] stopped ({stopped_by}) after step {done}; continue with --resume",
              file=sys.stderr, flush=True)
    return summary


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """``clip_grad_norm_`` when this rank's gradient norm is finite; returns the norm. A gradient
    whose norm is not (NaN, inf, or an element so large that its square is: 3e38, 1e30) is left as
    it is: clipping would scale it to zeros or NaN, and the optimizer's agreed check must see it to
    skip the step on every rank."""
    norms = [torch.linalg.vector_norm(p.grad.detach()) for p in model.parameters() if p.grad is not None]
    if norms and not bool(torch.isfinite(torch.linalg.vector_norm(torch.stack(norms)))):
        return math.inf
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def skipped_steps(history: dict) -> list:
    """The steps (1-based) the optimizer skipped, from the run's record."""
    return [i + 1 for i, r in enumerate(history["steps"]) if r.get("skipped")]


def _ranges(steps: list) -> str:
    """``[2, 3, 4, 9]`` -> ``"2-4, 9"``."""
    out, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(str(start) if start == s else f"{start}-{s}")
            start = None
    return ", ".join(out)


def forward_backward(model, optimizer, inputs, labels, accum: int, micro_batch: int, device) -> float:
    """This rank's shard of one global batch, in ``accum`` micro-batches, the gradients accumulated
    locally: only the last backward lets the optimizer exchange (and, under --shard, FSDP
    reduce-scatter). Returns the shard's loss."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    sharded = hasattr(model, "set_requires_gradient_sync")  # an FSDP2 module
    for i in range(accum):
        sl = slice(i * micro_batch, (i + 1) * micro_batch)
        if sharded:
            model.set_requires_gradient_sync(i == accum - 1)
        loss = mlm_loss(model, inputs[sl].to(device), labels[sl].to(device)) / accum
        with optimizer.no_sync() if i < accum - 1 else contextlib.nullcontext():  # the last one exchanges
            loss.backward()
        loss_sum += loss.item()
    return loss_sum


def optimizer_state_bytes(optimizer) -> int:
    """The bytes of this rank's optimizer state (its tensors): under --shard, its shards'."""
    state = optimizer.state.get("flat", {})
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def _stopped_by(error: str, cfg: TrainConfig, done: int, last_saved: Optional[int], master: bool) -> dict:
    """The summary of a run that a non-finite loss or parameter stopped (rank 0 says so)."""
    kept = (f"the last checkpoint ({checkpoint_folder(last_saved)}, step {last_saved}) is kept"
            if last_saved else "no checkpoint was written")
    error = (f"[{cfg.optimizer}] stopped: {error}. Nothing non-finite was saved and no metrics were written; "
             f"{kept}. A smaller --lr (or a longer --warmup-frac) usually helps; start over with --overwrite")
    if master:
        print(error, file=sys.stderr, flush=True)
    return {"completed": False, "interrupted": False, "step": done, "error": error}


def prepare_corpus(cfg: TrainConfig, log=print) -> data.Corpus:
    """The run's corpus (``data.prepare_corpus``): built once before the workers start, then loaded
    from the cache by each."""
    try:
        corpus = data.prepare_corpus(cfg.corpus, cfg.vocab_size, cfg.seq_len, cfg.heldout_fraction, cfg.cache_dir,
                                     log=log, stdlib_tests=cfg.stdlib_tests)
    except ValueError as exc:  # a corpus too small, a damaged cache: the message says which and what to do
        raise SetupError(str(exc)) from None
    # the tokenizer keeps every character it saw, whatever the vocabulary size asked for; a token
    # beyond the model's embedding would fail in every worker at its first step
    needed = 1 + max(int(corpus.train.max()), int(corpus.heldout.max()))
    if needed > cfg.vocab_size:
        raise SetupError(f"--vocab-size must be at least {needed} for this corpus (its tokenizer keeps every "
                         f"character it saw), got {cfg.vocab_size}")
    return corpus


def param_groups(model: torch.nn.Module, weight_decay: float):
    """BERT's two groups: weight decay on the weight matrices, none on biases and LayerNorm.
    Also returns ``{name: parameter}`` in the optimizer's (flat) order, for the diagnostics."""
    decay, no_decay = {}, {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.numel() > 0:
            (no_decay if name.endswith("bias") or "LayerNorm" in name else decay)[name] = p
    groups = [{"params": list(decay.values()), "weight_decay": weight_decay},
              {"params": list(no_decay.values()), "weight_decay": 0.0}]
    return groups, {**decay, **no_decay}


def make_optimizer(cfg: TrainConfig, groups, replicate_group=None) -> torch.optim.Optimizer:
    """The run's optimizer; ``replicate_group``: under --shard, the group of this rank's shard in
    every replica, which it exchanges over."""
    group = replicate_group
    if group is None and cfg.local_size is not None:
        group = onebitlamb.comm.node_groups(cfg.local_size)
    common = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                  process_group=group,
                  bucket_cap_mb=cfg.bucket_cap_mb, overlap_with_backward=cfg.bucket_cap_mb is not None,
                  agree_every=cfg.agree_every or None)
    if cfg.optimizer == "lamb":  # the exact baseline: its average stays float32
        return onebitlamb.Lamb(groups, **common)
    common["bound_direction"] = cfg.bound_direction
    if cfg.optimizer == "onebitlamb":
        common.update(compression_space=cfg.compression_space, trust_ratio_after_freeze=cfg.trust_ratio_after_freeze)
    if cfg.optimizer == "zerooneadam":  # it exchanges in step() (its syncs need the step's update first)
        return onebitlamb.ZeroOneAdam(groups, **{**common, "overlap_with_backward": False}, total_steps=cfg.steps,
                                      var_freeze_step=cfg.var_freeze, var_update_scaler=cfg.var_update_scaler,
                                      local_step_scaler=cfg.local_step_scaler,
                                      compression_space=cfg.compression_space, warmup_dtype=cfg.warmup_dtype)
    cls = onebitlamb.OneBitLamb if cfg.optimizer == "onebitlamb" else onebitlamb.OneBitAdam
    return cls(groups, **common, freeze_step=cfg.freeze_step(), warmup_dtype=cfg.warmup_dtype)


def _freeze_banner(optimizer) -> str:
    stats = optimizer.stats()["freeze"]
    if stats is None:
        return ""
    until = f", the gradients averaged in {optimizer.exchange.wire.name} until then"
    if stats["floor_step"] == stats["cap_step"]:
        return f", freeze at step {stats['cap_step']}{until}"
    return f", freeze automatically between steps {stats['floor_step']} and {stats['cap_step']}{until}"


# ---- stopping on Ctrl-C / SIGTERM at a step boundary, all ranks together


def _install_stop_handler():
    flag = {"stop": False}

    def handle(signum, frame):
        flag["stop"] = True

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)  # torchrun forwards signals as SIGTERM
    return lambda: flag["stop"]


def _all_finite(tensors) -> bool:
    tensors = list(tensors)
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())
