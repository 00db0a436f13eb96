"""DiLoCo and streaming DiLoCo as torchft runs them, on the main job: the peers that
``benchmarks.time_to_loss`` sets beside LAMB and the 1-bit optimizers.

    python -m benchmarks.diloco --preset tiny --H 4                  # seconds: one run, its table
    python -m benchmarks.diloco --preset demo --H 8 16 32 --outer-lr 0.7 0.4 --fragments 1 2

DiLoCo (Douillard et al., arXiv 2311.08105): each worker takes H steps with its own AdamW,
sending nothing; then the workers average how far they moved (the outer gradient, the last sync's
parameters minus their own) and an outer SGD with Nesterov momentum (the paper's lr 0.7, momentum
0.9) steps the shared parameters with it. Streaming DiLoCo (Douillard et al., arXiv 2501.18512)
cuts the model into F fragments and syncs one of them every H/F steps, in turn: each fragment
still every H steps, a sync F times smaller. Both are ``torchft.local_sgd.DiLoCo`` (its
``sync_every`` is H, its ``model_fragments`` the F fragments), driven through torchft's own
``Manager``: every worker is a replica group of one rank, with its own TCPStore and torchft's
gloo process group, and the replicas meet at a torchft lighthouse that ``run`` starts before the
workers and stops after them. The outer gradient crosses in one bucket a sync (torchft's
``use_bucketization``), so a sync is one float32 all-reduce of the fragment, as the bytes and
rounds recorded here count it.

The run is the main job's (``onebitlamb pretrain``): its data, model, global batch, gradient
clipping, learning-rate schedule (on the inner AdamW, at the main job's Adam rate 2e-3 by
default) and held-out evaluation, of the synced model (every fragment at its last sync). Each
run writes ``metrics.json`` and ``log.csv`` in the main job's format, its steps' stages ``local``
and ``sync``, into OUT/PRESET/SEED/NAME (``Settings.name``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

# the paper's outer optimizer: SGD with Nesterov momentum
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
INNER_LR = 2e-3  # the main job's Adam rate (onebitlamb.train.config.DEFAULT_LR)
LOCAL, SYNC = "local", "sync"  # the stages of a DiLoCo run's steps (benchmarks.netsim.worker's kinds)


@dataclass(frozen=True)
class Settings:
    """DiLoCo's own settings (the rest is the main job's): H inner steps between two syncs of a
    fragment, F fragments (1: DiLoCo; more: streaming DiLoCo), the outer and inner rates."""
    H: int
    fragments: int = 1
    outer_lr: float = OUTER_LR
    inner_lr: float = INNER_LR

    def __post_init__(self) -> None:
        for name in ("H", "fragments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.H % self.fragments:
            raise ValueError(f"H must be a multiple of fragments (each syncs in turn, every H / fragments steps), "
                             f"got H {self.H} and fragments {self.fragments}")
        for name in ("outer_lr", "inner_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def name(self) -> str:
        """The run's folder and row: ``diloco-H16``, ``streaming-diloco-F2-H16``, with the rates when
        not the defaults (``-olr0.4``, ``-ilr0.001``)."""
        return (("diloco" if self.fragments == 1 else f"streaming-diloco-F{self.fragments}") + f"-H{self.H}"
                + ("" if self.outer_lr == OUTER_LR else f"-olr{self.outer_lr:g}")
                + ("" if self.inner_lr == INNER_LR else f"-ilr{self.inner_lr:g}"))


# ----------------------------------------------------------------------------------------------
# torchft: the lighthouse, one replica's manager, the fragments


@contextlib.contextmanager
def lighthouse(replicas: int, timeout_s: float) -> Iterator[str]:
    """A torchft lighthouse for ``replicas`` replicas on this machine, its address inside; stopped
    on the way out, whatever happened. A quorum waits for every replica (``min_replicas``)."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=replicas, join_timeout_ms=int(1000 * timeout_s))
    try:
        yield server.address()
    finally:
        server.shutdown()


@contextlib.contextmanager
def replica_manager(replica: int, replicas: int, lighthouse_addr: str, timeout_s: float,
                    host: str = "127.0.0.1") -> Iterator["torchft.Manager"]:  # noqa: F821
    """torchft's ``Manager`` of replica ``replica`` (one rank): its own TCPStore on ``host``, torchft's
    gloo process group, a synchronous quorum of all ``replicas`` (DiLoCo's), every wait bounded by
    ``timeout_s``. No checkpoint to heal from: every replica starts from the same seed, and a
    failed commit stops the run (``max_retries=0``) instead of dropping a sync unseen."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=replicas, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout, rank=0, world_size=1, store_addr=host, store_port=store.port,
                      lighthouse_addr=lighthouse_addr, replica_id=f"replica{replica}", hostname=host,
                      init_sync=False, max_retries=0)
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)
        del store


class Fragment(nn.Module):
    """Some of a model's parameters, the same tensors, as a module of their own (what torchft's
    DiLoCo takes a fragment as): ``named_parameters`` names them as the model does, dots made
    underscores."""

    def __init__(self, named: Dict[str, nn.Parameter]) -> None:
        super().__init__()
        for name, p in named.items():
            self.register_parameter(name.replace(".", "_"), p)


def fragments(named: Dict[str, nn.Parameter], count: int) -> List[Fragment]:
    """The parameters (``{name: parameter}`` in the model's order, each once) cut into ``count``
    consecutive fragments of about equal size: each one's first parameter is the first past its
    share of the elements (streaming DiLoCo's contiguous blocks of layers)."""
    items = list(named.items())
    if not 1 <= count <= len(items):
        raise ValueError(f"fragments must be between 1 and the {len(items)} parameters, got {count}")
    total, out, current, done = sum(p.numel() for _, p in items), [], {}, 0
    for i, (name, p) in enumerate(items):
        # cut before this parameter when the fragment holds its share, keeping one parameter for each one left
        if current and (done >= total * (len(out) + 1) / count or len(items) - i == count - len(out) - 1):
            out.append(Fragment(current))
            current = {}
        current[name] = p
        done += p.numel()
    out.append(Fragment(current))
    assert len(out) == count
    return out


def allreduce_bytes(numel: int, n: int) -> int:
    """What one rank sends in a float32 ring all-reduce of ``numel`` elements on ``n`` ranks (the
    cost model's, ``onebitlamb.comm.costmodel``)."""
    from onebitlamb.comm import costmodel

    return sum(costmodel.lamb_collectives(numel, n))


class TorchftDiLoCo:
    """torchft's DiLoCo on one replica, entered (its hooks on the inner optimizer): call the inner
    optimizer's ``step()`` as usual; ``after_step()`` then says whether it synced, and counts the
    sync's bytes. ``synced_parameters()``: the parameters of every fragment's last sync, inside."""

    def __init__(self, manager, named: Dict[str, nn.Parameter], inner: torch.optim.Optimizer,
                 settings: Settings, replicas: int) -> None:
        from torchft.local_sgd import DiLoCo

        self.manager, self.replicas, self.settings = manager, replicas, settings
        self.fragments = fragments(named, settings.fragments)
        self.outer = [torch.optim.SGD(f.parameters(), lr=settings.outer_lr, momentum=OUTER_MOMENTUM, nesterov=True)
                      for f in self.fragments]
        self.diloco = DiLoCo(manager, self.fragments, inner, self.outer, sync_every=settings.H,
                             use_bucketization=True).__enter__()
        self.syncs, self.bytes_sent = 0, 0

    def after_step(self) -> bool:
        """After the inner step: whether it synced a fragment (torchft's counter back at 0). Raises
        RuntimeError when the sync did not commit (torchft kept the parameters of the sync before)."""
        if self.diloco._local_step != 0:
            return False
        fragment = self.fragments[self.syncs % len(self.fragments)]
        self.syncs += 1
        if self.manager.current_step() != self.syncs:  # torchft counts committed syncs
            raise RuntimeError(f"sync {self.syncs} of the run did not commit (torchft's step is "
                               f"{self.manager.current_step()}): a replica failed or timed out")
        self.bytes_sent += allreduce_bytes(sum(p.numel() for p in fragment.parameters()), self.replicas)
        return True

    @contextlib.contextmanager
    def synced_parameters(self) -> Iterator[None]:
        """Inside: each fragment's parameters of its last sync (torchft's ``original_parameters``,
        what the replicas agree on); after: this replica's own again, bit for bit."""
        own = []
        with torch.no_grad():
            for fragment, state in zip(self.fragments, self.diloco._fragments):
                for name, p in fragment.named_parameters():
                    own.append((p, p.detach().clone()))
                    p.copy_(state.original_parameters[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in own:
                    p.copy_(value)

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)


# ----------------------------------------------------------------------------------------------
# The job: one rank's run


def config(preset: str, seed: int, out: str, settings: Settings, steps: Optional[int] = None,
           cache_dir: str = "", extra: Sequence[str] = ()):
    """The main job's TrainConfig of this run (``onebitlamb pretrain``'s flags; the optimizer named
    is LAMB's only for the parser: the inner optimizer is AdamW at ``settings.inner_lr``)."""
    from onebitlamb.train.config import config_from_flags

    flags = ["--preset", preset, "--seed", str(seed), "--optimizer", "lamb", "--lr", repr(settings.inner_lr),
             "--out", out, *(["--steps", str(steps)] if steps is not None else []),
             *(["--cache-dir", cache_dir] if cache_dir else []), "--no-progress", *extra]
    return config_from_flags(flags)


def train_rank(rank: int, world: int, cfg, settings: Settings, lighthouse_addr: str) -> dict:
    """One rank's (one replica's) DiLoCo run of the main job; rank 0 writes the results. Returns the
    summary (``error`` set when the run stopped: a non-finite loss, a sync that did not commit)."""
    from onebitlamb.train import data, files, runlog
    from onebitlamb.train.loop import clip_gradients, lr_factor, start_rank
    from onebitlamb.train.metrics import evaluate_mlm
    from onebitlamb.train.model import mlm_loss
    from onebitlamb.train.ranks import check_ranks_agree

    setup = start_rank(cfg, rank, world)  # the main job's seeds, data, model and parameter groups
    device, model = setup.device, setup.model
    inner = torch.optim.AdamW(setup.groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lr_factor(cfg))
    history = {"steps": [], "eval": [], "diagnostics": [], "train_time_s": 0.0, "wall_time_s": 0.0}
    log = None
    error = None
    with replica_manager(rank, world, lighthouse_addr, cfg.timeout) as manager:
        run = TorchftDiLoCo(manager, setup.names, inner, settings, world)

        def evaluate(step: int) -> Optional[str]:
            with run.synced_parameters():
                loss = evaluate_mlm(model, setup.eval_inputs, setup.eval_labels, 2 * cfg.micro_batch, device)
            if not math.isfinite(loss):
                return f"the held-out loss is {loss} after step {step}"
            history["eval"].append([step * cfg.global_batch, loss])
            return None

        if rank == 0:
            files.write_json(os.path.join(cfg.out, "config.json"), dataclasses.asdict(cfg), indent=1)
            named = SimpleNamespace(optimizer=settings.name, out=cfg.out, steps=cfg.steps,
                                    global_batch=cfg.global_batch, progress=False)  # the log's name is the row's
            log = runlog.RunLog(named, 0, history)
        error = evaluate(0)
        if log is not None and error is None:
            log.report(0, history)
        t_wall0 = time.perf_counter()
        for step in range(cfg.steps if error is None else 0):
            t0 = time.perf_counter()
            inputs, labels = data.rank_batch(setup.corpus, step, rank, world, cfg.global_batch, cfg.seed,
                                             cfg.mask_prob)
            inner.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for i in range(setup.accum):  # the main job's micro-batches, accumulated
                sl = slice(i * cfg.micro_batch, (i + 1) * cfg.micro_batch)
                loss = mlm_loss(model, inputs[sl].to(device), labels[sl].to(device)) / setup.accum
                loss.backward()
                loss_sum += loss.item()
            if not math.isfinite(loss_sum):
                error = f"the training loss of step {step + 1} is not finite on rank {rank}"
                break
            if cfg.clip > 0:
                clip_gradients(model, cfg.clip)
            lr = scheduler.get_last_lr()[0]
            inner.step()  # torchft's hooks: every H / F steps, a fragment's sync
            try:
                synced = run.after_step()
            except RuntimeError as exc:
                error = f"step {step + 1}: {exc}"
                break
            scheduler.step()
            history["train_time_s"] += time.perf_counter() - t0
            history["steps"].append({"loss": loss_sum, "bytes": run.bytes_sent, "collectives": run.syncs,
                                     "stage": SYNC if synced else LOCAL, "lr": lr, "freeze": None,
                                     "skipped": False})
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                error = evaluate(done)
                if error is not None:
                    break
            history["wall_time_s"] = time.perf_counter() - t_wall0
            if log is not None:
                log.report(done, history)
        if log is not None:
            log.close()
        run.close()
        if error is None:
            with run.synced_parameters():  # what the replicas agree on: the same bits on every rank
                check_ranks_agree(model, rank, world, cfg.steps, device)
    if error is not None:
        error = f"[{settings.name}] stopped: {error}; no metrics written"
        if rank == 0:
            print(error, file=sys.stderr, flush=True)
        return {"completed": False, "error": error, "step": len(history["steps"])}
    if rank == 0:
        with run.synced_parameters():
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        write_results(cfg, settings, world, history, list(setup.names), state, run.syncs)
    return {"completed": True, "step": cfg.steps}


def write_results(cfg, settings: Settings, world: int, history: dict, layers: List[str], model_state: dict,
                  syncs: int) -> None:
    """OUT/metrics.json in the main job's format (``metrics.write_metrics``'s keys), DiLoCo's
    settings beside them, and OUT/model_final.pt (the synced model)."""
    from onebitlamb.train import data, files

    steps = history["steps"]
    samples = cfg.steps * cfg.global_batch
    sent = steps[-1]["bytes"] if steps else 0  # every replica sends the same syncs
    metrics = {
        "optimizer": settings.name, "world_size": world, "final_eval_loss": history["eval"][-1][1],
        "samples": samples, "steps": cfg.steps, "freeze_step": None, "warmup_steps": 0, "skipped_steps": [],
        "bytes_sent_per_rank": sent, "bytes_sent_by_rank": [sent] * world,
        "rounds_per_rank": steps[-1]["collectives"] if steps else 0,
        "wall_time_s": history["wall_time_s"], "train_time_s": history["train_time_s"],
        "samples_per_s": samples / max(history["train_time_s"], 1e-9),
        "eval_curve": history["eval"],
        "bytes_curve": [[i + 1, r["bytes"]] for i, r in enumerate(steps)],
        "rounds_curve": [[i + 1, r["collectives"]] for i, r in enumerate(steps)],
        "train_loss": [r["loss"] for r in steps], "stage": [r["stage"] for r in steps],
        "lr": [r["lr"] for r in steps], "diagnostics": [], "config": dataclasses.asdict(cfg), "freeze": None,
        "layers": layers,
        "diloco": {**dataclasses.asdict(settings), "outer_momentum": OUTER_MOMENTUM, "nesterov": True,
                   "inner": "AdamW", "implementation": "torchft.local_sgd.DiLoCo", "syncs": syncs,
                   "sync_steps": [i + 1 for i, r in enumerate(steps) if r["stage"] == SYNC]},
    }
    data.atomic_save(model_state, os.path.join(cfg.out, "model_final.pt"))
    files.write_json(os.path.join(cfg.out, "metrics.json"), metrics)
    print(f"[{settings.name}] done: held-out loss {metrics['final_eval_loss']:.4f} after {samples} samples, "
          f"{sent / 1e6:.2f} MB and {metrics['rounds_per_rank']} rounds per worker, "
          f"{metrics['wall_time_s']:.0f} s", file=sys.stderr, flush=True)


def run(cfg, settings: Settings) -> dict:
    """The metrics of one run in ``cfg.out``: read when a run of the same settings finished there,
    else trained on ``cfg.workers`` local replicas, a lighthouse started for them and stopped after."""
    from onebitlamb.comm.launch import spawn_local
    from onebitlamb.train.config import SetupError, changed_settings
    from onebitlamb.train.loop import prepare_corpus

    done = os.path.join(cfg.out, "metrics.json")
    if os.path.exists(done):
        with open(done) as f:
            saved = json.load(f)
        differ = {**changed_settings(cfg, saved.get("config", {})),
                  **{k: (saved.get("diloco", {}).get(k), v) for k, v in dataclasses.asdict(settings).items()
                     if saved.get("diloco", {}).get(k) != v}}
        if differ:
            raise SetupError(f"{cfg.out} holds a finished run of other settings ({differ}, saved then now): "
                             f"move it aside or give another --out")
        return saved
    cfg.check(cfg.workers)
    os.makedirs(cfg.out, exist_ok=True)
    prepare_corpus(cfg)  # once, before the ranks load it
    print(f"[{settings.name}] torchft: {cfg.workers} replicas, {cfg.steps} steps of {cfg.global_batch} samples, "
          f"inner AdamW lr {cfg.lr:g}, a sync every {settings.H // settings.fragments} steps "
          f"({settings.fragments} fragment(s)), outer SGD lr {settings.outer_lr:g} Nesterov momentum "
          f"{OUTER_MOMENTUM:g}", file=sys.stderr, flush=True)
    with lighthouse(cfg.workers, cfg.timeout) as address:
        summary = spawn_local(train_rank, cfg.workers, args=(cfg, settings, address), timeout_s=7 * 24 * 3600,
                              collective_timeout_s=cfg.timeout, threads_per_worker=cfg.threads)[0]
    if summary.get("error"):
        return {"error": summary["error"]}
    with open(done) as f:
        return json.load(f)


def grid(H: Sequence[int], outer_lrs: Sequence[float], fragments: Sequence[int],
         inner_lr: float = INNER_LR) -> List[Settings]:
    """Every combination that is a valid run (H a multiple of the fragments), in order."""
    return [Settings(h, f, lr, inner_lr) for f in fragments for h in H for lr in outer_lrs if h % f == 0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from onebitlamb.train.config import PRESETS, SetupError

    parser = argparse.ArgumentParser(prog="python -m benchmarks.diloco", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="demo")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--steps", type=int, default=None, help="every run's steps (default: the preset's)")
    parser.add_argument("--H", nargs="+", type=int, default=[16], help="inner steps between syncs (default 16)")
    parser.add_argument("--fragments", nargs="+", type=int, default=[1],
                        help="1: DiLoCo; more: streaming DiLoCo with that many fragments (default 1)")
    parser.add_argument("--outer-lr", nargs="+", type=float, default=[OUTER_LR], help="default: the paper's 0.7")
    parser.add_argument("--inner-lr", type=float, default=INNER_LR, help="the inner AdamW's peak rate")
    parser.add_argument("--out", default=os.path.join("runs", "convergence"), help="OUT/PRESET/SEED/NAME")
    args = parser.parse_args(argv)
    try:
        settings = grid(args.H, args.outer_lr, args.fragments, args.inner_lr)
    except ValueError as exc:
        parser.error(str(exc))
    folder = os.path.join(args.out, args.preset if args.steps is None else f"{args.preset}-{args.steps}steps",
                          str(args.seed))
    failed = 0
    for s in settings:
        try:
            m = run(config(args.preset, args.seed, os.path.join(folder, s.name), s, args.steps,
                           os.path.join(args.out, "cache")), s)
        except SetupError as exc:
            print(f"python -m benchmarks.diloco: error: {exc}", file=sys.stderr)
            return 2
        if "error" in m:
            failed += 1
            print(m["error"], file=sys.stderr)
            continue
        print(f"{s.name}: held-out loss {m['final_eval_loss']:.4f}, {m['bytes_sent_per_rank'] / 1e6:.2f} MB and "
              f"{m['rounds_per_rank']} rounds per worker")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
