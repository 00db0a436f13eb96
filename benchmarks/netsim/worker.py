"""One training worker on one emulated host: ``python -m benchmarks.netsim.worker SPEC_JSON``.

Started by ``benchmarks.netsim.runner`` inside a host's namespace (``ip netns exec``), so its
``/sys/class/net/<if>/statistics`` are that host's link counters. The spec (a JSON file) says what
to run; the result is written as JSON to ``spec["out"]``, one file per rank.

Jobs, in the order they run when present in the spec:
- ``probe``: the latency of a tiny all-reduce (the cost model's alpha), and the time of a
  full-size fp32 all-reduce and of a compressed all-reduce (host-side costs: copies, the codec);
- ``collectives``: repeated ``all_reduce`` / ``compressed_allreduce`` calls on one buffer, with the
  bytes the library accounted and the bytes the interface counted (the wire-byte test);
- ``paired_steps`` (not a spec job: run on loopback by ``spawn_local``): LAMB's and the 1-bit
  optimizers' compression-stage steps interleaved in one launch, for a ratio that load drift
  between launches cannot move;
- ``ddp``: plain usage (the optimizer averages the gradients in ``step()``) against the same model
  wrapped in ``DistributedDataParallel`` with ``onebitlamb.register_ddp`` (DDP averages the
  warm-up's gradients bucket by bucket during the backward, and sends nothing once the optimizer
  compresses), their steps interleaved in one launch through both stages (``ddp_steps``; also
  runs on loopback under ``spawn_local``);
- ``hierarchy``: on nodes of ``spec["local_size"]`` ranks (several workers per emulated host),
  the optimizer over the flat world group against the same optimizer over
  ``onebitlamb.comm.node_groups(local_size)`` (the hierarchical all-reduce), and a third model
  with no communication at all (each rank alone), their steps interleaved in one launch through
  both stages (``hierarchy_steps``; also runs on loopback under ``spawn_local``); ``spec["modes"]``
  may add the flat and the hierarchical optimizer with ``overlap_with_backward`` (the serial step
  against the one whose exchange runs behind the backward);
- ``hsdp``: per optimizer, ``train``'s timed steps with the model sharded by FSDP2 over each
  host's ranks and the optimizer across the hosts (HSDP; ``benchmarks.sharded``);
- ``train``: per optimizer, timed steps of each kind it takes (``KINDS``: the warm-up, the
  compression stage; 0/1 Adam's variance steps, 1-bit steps, local steps and syncs; DiLoCo's local
  steps and syncs) of the BERT pretraining workload on synthetic token batches, with per-kind wire
  and accounted bytes; just before, the same steps with no communication at all (each rank alone
  in a one-rank group, all ranks at once so that they contend for the CPUs as in the networked
  run).

Each rank times its own steps; a step is the whole loop body (forward, backward, optimizer step,
which includes the communication). In ``train`` every step starts after a barrier and its
interface counter is read after another, so every byte the step sent has reached its peer.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from onebitlamb.optim import functional as F
from onebitlamb.optim.staged import COMPRESSION, LOCAL, WARMUP  # the stage names optimizer.stage reports

SYNC = "sync"  # 0/1 Adam's compression steps after its variance froze (the update sums averaged); DiLoCo's syncs
# the kinds of step ``train`` times, in the order of the tables: LAMB's and the warm-up's (0/1
# Adam's variance steps: the full-precision average), the 1-bit steps, then the local steps and
# syncs (0/1 Adam's: the agreed finite check alone, and the 1-bit average of the update sums;
# DiLoCo's: no collective at all, and the float32 average of the parameters' change). Each
# optimizer's rows are its own: a kind's name says where in a run the step falls, not what it sends
KINDS = (WARMUP, COMPRESSION, LOCAL, SYNC)
# 0/1 Adam in ``train``: the variance interval doubling after 4 refreshes, then syncs and local
# steps alternating (an interval of 2 from the second step after the freeze), so that every kind
# comes up within a few dozen steps; a step's time does not depend on where in a schedule it falls
ZERO_ONE_SCHEDULE = dict(var_update_scaler=4, local_step_scaler=1, local_step_clipper=2)


def read_counter(interface: str, name: str = "tx_bytes") -> int:
    with open(f"/sys/class/net/{interface}/statistics/{name}") as f:
        return int(f.read())


class DiLoCoSteps:
    """DiLoCo's steps as they cost (``benchmarks.diloco`` runs torchft's DiLoCo, whose syncs send the
    outer gradient in one bucket), as ``train_one`` drives an optimizer: ``step()`` is the inner
    LAMB's step on this rank's own group ``alone`` (it sends nothing); every ``H``-th step then
    syncs over ``process_group``: one float32 all-reduce of the parameters' change since the last
    sync, an outer SGD step with Nesterov momentum (the paper's 0.7, 0.9), the parameters
    reloaded. ``stage`` is the kind of the next step, ``LOCAL`` or ``SYNC``; ``comm_stats`` what
    the syncs sent."""

    def __init__(self, params, lr: float, H: int, process_group, alone) -> None:
        import onebitlamb
        from onebitlamb.comm import CommStats

        self.params = list(params)
        self.inner = onebitlamb.Lamb(self.params, lr=lr, process_group=alone)
        self.H, self.since_sync, self.group, self.comm_stats = H, 0, process_group, CommStats()
        self.anchor = torch.cat([p.detach().reshape(-1) for p in self.params]).float()
        self.outer = torch.optim.SGD([self.anchor], lr=0.7, momentum=0.9, nesterov=True)

    @property
    def stage(self) -> str:
        return SYNC if self.since_sync + 1 >= self.H else LOCAL

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        from onebitlamb.comm import allreduce_mean_

        self.inner.step()
        self.since_sync += 1
        if self.since_sync < self.H:
            return
        self.anchor.grad = self.anchor - torch.cat([p.detach().reshape(-1) for p in self.params]).float()
        allreduce_mean_(self.anchor.grad, self.group, self.comm_stats)  # one float32 all-reduce, counted
        self.outer.step()
        for p, chunk in zip(self.params, self.anchor.split([p.numel() for p in self.params])):
            p.copy_(chunk.view_as(p))
        self.since_sync = 0


def make_optimizer(name: str, params, lr: float, freeze_step: int, group, *, alone=None, **exchange):
    """``exchange``: the optimizers' other keyword-only exchange options (buckets, overlap);
    ``alone``: this rank's own one-rank group, for DiLoCo's inner LAMB."""
    import onebitlamb

    if name == "lamb":
        return onebitlamb.Lamb(params, lr=lr, process_group=group, **exchange)
    if name == "onebitlamb":
        return onebitlamb.OneBitLamb(params, lr=lr, freeze_step=freeze_step, process_group=group, **exchange)
    if name == "onebitlamb-int8":  # the warm-up's average blockwise int8 with error feedback (comm.quantized)
        return onebitlamb.OneBitLamb(params, lr=lr, freeze_step=freeze_step, process_group=group,
                                     warmup_dtype="int8", **exchange)
    if name == "onebitadam":
        return onebitlamb.OneBitAdam(params, lr=lr, freeze_step=freeze_step, process_group=group, **exchange)
    if name == "zerooneadam":  # ``freeze_step``: its var_freeze_step
        return onebitlamb.ZeroOneAdam(params, lr=lr, var_freeze_step=freeze_step, process_group=group,
                                      **ZERO_ONE_SCHEDULE, **exchange)
    if name == "diloco":  # ``freeze_step``: its H
        if alone is None or exchange:
            raise ValueError("diloco takes its inner LAMB's own group (alone) and no exchange options")
        return DiLoCoSteps(params, lr, freeze_step, group, alone)
    raise ValueError(f"unknown optimizer {name!r} (lamb, onebitlamb, onebitlamb-int8, onebitadam, zerooneadam, "
                     f"diloco)")


def timed_kinds(name: str, warm: int, comp: int) -> Dict[str, int]:
    """How many timed steps of each kind ``train_one`` takes of optimizer ``name``: ``warm`` of the
    full-precision kinds (a float32 average of the whole model, seconds behind a slow link),
    ``comp`` of the others. LAMB takes warm-up steps only; 1-bit LAMB with the int8 warm-up too:
    after the freeze it compresses as 1-bit LAMB does (the warm-up's wire format is all it changes),
    so its compression steps are 1-bit LAMB's, measured in that row."""
    if name in ("lamb", "onebitlamb-int8"):
        return {WARMUP: warm}
    if name == "zerooneadam":
        return {WARMUP: warm, COMPRESSION: comp, LOCAL: comp, SYNC: comp}
    if name == "diloco":
        return {LOCAL: comp, SYNC: warm}
    return {WARMUP: warm, COMPRESSION: comp}


def diloco_H(syncs: int, local_steps: int) -> int:
    """The smallest H whose first ``syncs`` syncs come with at least ``local_steps`` local steps
    (``H - 1`` before each): DiLoCo's steps cost the same whatever H is, and a sync is the
    expensive kind, so none is taken beyond those wanted."""
    return 1 + max(1, math.ceil(local_steps / syncs))


def zero_one_freeze_step(variance_steps: int, onebit_steps: int) -> int:
    """The first ``var_freeze_step`` by which 0/1 Adam under ``ZERO_ONE_SCHEDULE`` has taken at
    least ``variance_steps`` variance steps and ``onebit_steps`` 1-bit steps (its own schedule
    rule, ``ZeroOneAdam.stage``; ``train_one`` checks each step's kind against the optimizer)."""
    interval, counter, variance, onebit, step = 1, 0, 0, 0, 0
    while variance < variance_steps or onebit < onebit_steps:
        step += 1
        if step % interval == 0:
            variance += 1
            interval, counter = F.interval_after(interval, counter, ZERO_ONE_SCHEDULE["var_update_scaler"])
        else:
            onebit += 1
    return step


def step_kind(opt) -> str:
    """The kind of the optimizer's next step (``KINDS``): its stage, a compression step of 0/1
    Adam after its variance froze being a sync."""
    import onebitlamb

    stage = opt.stage
    if (stage == COMPRESSION and isinstance(opt, onebitlamb.ZeroOneAdam)
            and opt.freeze_stats()["frozen_at"] is not None):
        return SYNC
    return stage


def _model_config(spec: dict):
    from onebitlamb.train.model import ModelConfig

    return ModelConfig(**spec["model"])


def _batches(cfg, batch: int, count: int, seed: int) -> List[Dict[str, torch.Tensor]]:
    """Random token batches with 15% of positions as MLM targets: step time does not depend on
    the text, and generating them up front keeps data work out of the timed loop."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(5, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
        labels = ids.clone()
        labels[torch.rand(batch, cfg.seq_len, generator=gen) >= 0.15] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def _barrier_bytes(interface: Optional[str], group) -> int:
    """What one bare barrier puts on ``interface`` (median of 5), to take out of a step's count."""
    if not interface:
        return 0
    costs = []
    for _ in range(5):
        _barrier(group)
        tx0 = read_counter(interface)
        _barrier(group)
        costs.append(read_counter(interface) - tx0)
    return int(statistics.median(costs))


def _two_stage_rounds(runs: list, batches: list, skip: int, warm: int, comp: int):
    """``skip + warm`` warm-up rounds then ``skip + comp`` compression rounds (the first ``skip`` of
    each untimed); each round yields ``(stage, timed, batch, run)`` for every run, in an order drawn
    afresh each round and the same on every rank, so load drift hits all runs alike. LAMB (the
    run's first item ``"lamb"``) never compresses and sits the compression rounds out; a run in
    another stage than the round's is an error."""
    plan = [(WARMUP, i >= skip) for i in range(skip + warm)] + [(COMPRESSION, i >= skip) for i in range(skip + comp)]
    for r, (stage, timed) in enumerate(plan):
        batch = batches[r % len(batches)]
        for k in random.Random(r).sample(range(len(runs)), len(runs)):
            name, mode, opt = runs[k][0], runs[k][1], runs[k][3]
            if name == "lamb" and stage == COMPRESSION:
                continue
            if opt.stage != stage:
                raise RuntimeError(f"{name} ({mode}): expected stage {stage} in round {r + 1}, optimizer is in {opt.stage}")
            yield stage, timed, batch, runs[k]


def train_one(name: str, spec: dict, rank: int, group, interface: Optional[str], alone=None,
              shard_mesh=None) -> dict:
    """Run one optimizer through every kind of step it takes (``timed_kinds``); per kind: step
    times, wire and accounted bytes. The first ``skip_steps`` of each kind are untimed, as are the
    steps of a kind already timed often enough (0/1 Adam's and DiLoCo's kinds interleave).
    ``alone``: this rank's own group (DiLoCo's inner LAMB runs on it). ``shard_mesh``: the model
    sharded with FSDP2 over it (HSDP: a host's ranks, ``group`` the replicate group), the steps
    between barriers of the whole world; the bytes the optimizer's per-layer reductions sent over
    the shard group (``node_accounted``) are recorded beside the others."""
    from onebitlamb.train.model import build_model

    cfg = _model_config(spec)
    warm, comp, skip = spec["warmup_steps"], spec["compression_steps"], spec.get("skip_steps", 1)
    wanted = timed_kinds(name, warm, comp)
    freeze_step = skip + warm  # a 1-bit optimizer's; the int8 warm-up's run ends before it compresses
    if name == "zerooneadam":
        freeze_step = zero_one_freeze_step(skip + warm, skip + comp)
    elif name == "diloco":  # its H
        freeze_step = diloco_H(skip + wanted[SYNC], skip + wanted[LOCAL])
    model = build_model(cfg, seed=spec.get("seed", 0))
    model.train()
    barriers = group
    if shard_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        barriers = dist.group.WORLD
    opt = make_optimizer(name, model.parameters(), spec.get("lr", 1e-3), freeze_step, group, alone=alone)
    node_stats = getattr(opt, "shard_comm_stats", None)
    batches = _batches(cfg, spec["batch"], 4, seed=1000 * rank + 7)
    barrier_bytes = _barrier_bytes(interface, barriers)
    records = {kind: {"step_times": [], "opt_step_times": [], "wire": 0, "accounted": 0, "node_accounted": 0}
               for kind in wanted}
    taken = {kind: 0 for kind in wanted}
    step_no, loss = 0, None
    while any(taken[kind] < skip + n for kind, n in wanted.items()):
        kind = step_kind(opt)
        if kind not in wanted or step_no > 4 * sum(skip + n for n in wanted.values()):
            raise RuntimeError(f"{name}: step {step_no + 1} is a {kind} step; expected only {sorted(wanted)}, "
                               f"each {skip} untimed then timed")
        timed = skip <= taken[kind] < skip + wanted[kind]
        taken[kind] += 1
        batch = batches[step_no % len(batches)]
        _barrier(barriers)
        tx0 = read_counter(interface) if interface else 0
        stats0 = opt.comm_stats.bytes_sent
        node0 = node_stats.bytes_sent if node_stats is not None else 0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        step_no += 1
        _barrier(barriers)
        if timed:
            rec = records[kind]
            rec["step_times"].append(t2 - t0)
            rec["opt_step_times"].append(t2 - t1)  # of which in optimizer.step (maths and communication)
            rec["wire"] += (read_counter(interface) - tx0 - barrier_bytes) if interface else 0
            rec["accounted"] += opt.comm_stats.bytes_sent - stats0
            rec["node_accounted"] += (node_stats.bytes_sent - node0) if node_stats is not None else 0
    result = {"optimizer": name, "params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    for kind, rec in records.items():
        times = rec["step_times"]
        result[kind] = {"step_times": times, "median_s": statistics.median(times),
                        "opt_step_times": rec["opt_step_times"], "wire_bytes_per_step": rec["wire"] / len(times),
                        "accounted_bytes_per_step": rec["accounted"] / len(times),
                        "node_accounted_bytes_per_step": rec["node_accounted"] / len(times), "loss": float(loss)}
    return result


def hsdp_rows(rank: int, world: int, spec: dict, interface: Optional[str], solo) -> dict:
    """``train_one`` per row of ``spec["hsdp"]``: ``[optimizer, layout]`` with layout ``"hsdp"`` (FSDP2
    over each host's ranks, the optimizer across the hosts over the replicate group) or ``"fsdp"``
    (FSDP2 over every rank, no replicas: the optimizer alone in its one-rank group, so that all
    the traffic is FSDP's own)."""
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    out = {}
    for name, layout in spec["hsdp"]:
        if layout == "hsdp":
            out[f"{name}-{layout}"] = train_one(name, spec, rank, mesh["replicate"].get_group(), interface,
                                                shard_mesh=mesh["shard"])
        else:
            out[f"{name}-{layout}"] = train_one(name, spec, rank, solo, interface, shard_mesh=flat)
    return out


def paired_steps(rank: int, world: int, spec: dict) -> dict:
    """LAMB's step and each 1-bit optimizer's compression-stage step, interleaved in one launch.

    Run under ``onebitlamb.comm.launch.spawn_local`` (plain loopback, no namespaces). One model
    per optimizer, built alike; the 1-bit ones freeze after a few untimed warm-up steps. Each
    round times one whole step of every optimizer (forward, backward, optimizer step), in an
    order drawn afresh each round, each after a barrier: the machine's drift and the neighbours'
    load hit all optimizers alike, so the per-round ratios compare like with like even where
    absolute step times wander by 10-20% from one launch to the next.
    """

    from onebitlamb.train.model import build_model

    group = dist.group.WORLD
    cfg = _model_config(spec)
    names = list(spec["optimizers"])
    rounds, untimed = spec["rounds"], spec.get("paired_warmup_steps", 3)
    # Step times do not depend on the learning rate; a small one keeps a freeze this early on
    # random tokens from diverging (which would end the run with non-finite scales).
    lr = spec.get("paired_lr", 1e-4)
    runs = []
    for name in names:
        model = build_model(cfg, seed=spec.get("seed", 0))
        model.train()
        runs.append((name, model, make_optimizer(name, model.parameters(), lr, untimed, group)))
    batches = _batches(cfg, spec["batch"], 4, seed=1000 * rank + 7)
    times: Dict[str, List[float]] = {name: [] for name in names}
    opt_times: Dict[str, List[float]] = {name: [] for name in names}  # of which optimizer.step
    step_bytes: Dict[str, int] = {}
    for r in range(untimed + rounds):
        # a fresh order every round, the same on every rank: which step precedes which (and
        # leaves its memory traffic in the caches) varies alike for all optimizers; a rotation
        # would keep the cyclic order, so each would always follow the same neighbour
        for k in random.Random(r).sample(range(len(runs)), len(runs)):
            name, model, opt = runs[k]
            expected = WARMUP if name == "lamb" else COMPRESSION
            if r >= untimed and opt.stage != expected:
                raise RuntimeError(f"{name}: expected stage {expected} in round {r}, optimizer is in {opt.stage}")
            batch = batches[r % len(batches)]
            _barrier(group)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if r >= untimed:
                times[name].append(t2 - t0)
                opt_times[name].append(t2 - t1)
                step_bytes[name] = opt.last_step_bytes
    return {"step_times": times, "opt_step_times": opt_times, "step_bytes": step_bytes}


def ddp_steps(rank: int, world: int, spec: dict, interface: Optional[str] = None) -> dict:
    """Plain usage against DDP + ``register_ddp``, interleaved, through the warm-up and the
    compression stage.

    Per optimizer in ``spec["optimizers"]`` two models built alike: one unwrapped (the optimizer
    all-reduces the flat gradient inside ``step()``, after the backward), one wrapped in
    ``DistributedDataParallel`` with DDP's defaults (but ``spec["bucket_cap_mb"]`` if given) and
    registered (DDP's bucketed all-reduce runs behind the backward in the warm-up; after the
    freeze it sends nothing). Every round times one step of each, in an order drawn afresh each
    round (the same on all ranks), each after a barrier, as ``paired_steps`` does: load drift hits
    both alike. Per step: the time of forward + backward and of ``optimizer.step()``, the bytes
    ``comm_stats`` recorded in each (DDP's hook records its buckets there, during the backward),
    DDP's bucket count, and, with an interface, the bytes its counter saw (less what one bare
    barrier costs, measured first). LAMB never compresses: it runs the warm-up rounds only.
    """
    from torch.nn.parallel import DistributedDataParallel

    import onebitlamb
    from onebitlamb.train.model import build_model

    group = dist.group.WORLD
    cfg = _model_config(spec)
    warm, comp, skip = spec["warmup_steps"], spec["compression_steps"], spec.get("skip_steps", 1)
    freeze_step = skip + warm
    runs = []  # (optimizer name, mode, model called in the loop, optimizer, DDPLink or None)
    for name in spec["optimizers"]:
        for mode in ("plain", "ddp"):
            model = build_model(cfg, seed=spec.get("seed", 0))
            model.train()
            opt = make_optimizer(name, model.parameters(), spec.get("lr", 1e-3), freeze_step, group)
            link = None
            if mode == "ddp":
                model = DistributedDataParallel(model, process_group=group, bucket_cap_mb=spec.get("bucket_cap_mb"))
                link = onebitlamb.register_ddp(model, opt)
            runs.append((name, mode, model, opt, link))
    barrier_bytes = _barrier_bytes(interface, group)
    batches = _batches(cfg, spec["batch"], 4, seed=1000 * rank + 7)
    steps: Dict[str, Dict[str, Dict[str, dict]]] = {}
    for stage, timed, batch, (name, mode, model, opt, link) in _two_stage_rounds(runs, batches, skip, warm, comp):
        _barrier(group)
        tx0 = read_counter(interface) if interface else 0
        b0 = opt.comm_stats.bytes_sent
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        t1 = time.perf_counter()
        b1 = opt.comm_stats.bytes_sent
        buckets = link.buckets_since_step if link is not None else 0
        opt.step()
        t2 = time.perf_counter()
        b2 = opt.comm_stats.bytes_sent
        _barrier(group)
        tx1 = read_counter(interface) if interface else 0
        if not timed:
            continue
        rec = steps.setdefault(name, {}).setdefault(mode, {}).setdefault(stage, {
            "step_times": [], "backward_times": [], "opt_step_times": [], "backward_bytes": [],
            "opt_step_bytes": [], "buckets": [], "wire_bytes": []})
        rec["step_times"].append(t2 - t0)
        rec["backward_times"].append(t1 - t0)  # forward + backward (+ DDP's wait for its buckets)
        rec["opt_step_times"].append(t2 - t1)
        rec["backward_bytes"].append(b1 - b0)
        rec["opt_step_bytes"].append(b2 - b1)
        rec["buckets"].append(buckets)
        rec["wire_bytes"].append(tx1 - tx0 - barrier_bytes if interface else None)
    params = sum(p.numel() for g in runs[0][3].param_groups for p in g["params"]) if runs else 0
    return {"steps": steps, "barrier_bytes": barrier_bytes, "params": params}


#: The three ways ``hierarchy_steps`` runs each optimizer by default: over the world group, over
#: ``node_groups(local_size)``, and alone (a one-rank group: no collective, the compute-only step).
HIERARCHY_MODES = ("flat", "hier", "solo")
#: Every mode ``spec["modes"]`` may name: the process group each runs over, and whether its
#: optimizer exchanges behind the backward (``overlap_with_backward``) instead of in ``step()``.
MODE_GROUPS = {"flat": ("world", False), "hier": ("node", False), "solo": ("solo", False),
               "overlap": ("world", True), "hier-overlap": ("node", True)}


def _buckets_started(opt) -> int:
    """Buckets ``overlap_with_backward`` started since the last step (0 without it): read after the
    backward, the share of the exchange that ran behind it."""
    return opt.exchange.started_in_backward


def _time_calls(fn, calls: int, group) -> float:
    """Median seconds of ``fn()`` over ``calls`` calls, each after a barrier over ``group``; one
    untimed call first."""
    ts = []
    for i in range(calls + 1):
        _barrier(group)
        t0 = time.perf_counter()
        fn()
        if i:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def hierarchy_steps(rank: int, world: int, spec: dict, interface: Optional[str] = None, solo=None) -> dict:
    """The flat group against ``node_groups(local_size)``, interleaved, through the warm-up and
    the compression stage.

    Per optimizer in ``spec["optimizers"]`` one model built alike per mode of ``spec["modes"]``
    (default ``HIERARCHY_MODES``): ``flat``, whose optimizer has the world group (the flat
    collectives); ``hier``, with ``process_group=node_groups(L)`` (node reduce-scatter, the
    exchange across nodes, node all-gather); ``solo``, alone in a one-rank group (``solo``, created
    here when not given): its step is the compute-only time of a synchronous step, measured in the
    same seconds as the others; ``overlap`` and ``hier-overlap``, the flat and the hierarchical
    one with ``overlap_with_backward=True`` and ``bucket_cap_mb=spec["bucket_cap_mb"]`` (default 1 MiB), whose buckets'
    exchanges start during the backward. Every round times one step of each, in an order drawn
    afresh each round (the same on all ranks), each after a barrier, as ``ddp_steps`` does. Per
    step: forward + backward and ``optimizer.step()`` times, the buckets started during the
    backward (and the buckets there are), the bytes ``comm_stats`` recorded (all, and those of the
    node stages, ``hierarchy.INTRA_OPS``) and, with an interface, the bytes its counter saw less
    one bare barrier's. With several ranks per host the counter is the host's (the node's), read
    by each of its ranks. First, once: the latency of a tiny all-reduce across nodes (over
    ``inter``) and inside the node (over ``intra``), and the time of the node reduce-scatter's
    all-to-all of the full fp32 gradient (the node's byte rate).
    """
    import onebitlamb
    from onebitlamb.comm import node_groups, padded_size
    from onebitlamb.comm.hierarchy import INTRA_OPS
    from onebitlamb.train.model import build_model

    world_group = dist.group.WORLD
    L = int(spec["local_size"])
    if solo is None:
        solo = [dist.new_group([r]) for r in range(world)][rank]
    groups = node_groups(L)
    cfg = _model_config(spec)
    warm, comp, skip = spec["warmup_steps"], spec["compression_steps"], spec.get("skip_steps", 1)
    freeze_step = skip + warm
    modes = list(spec.get("modes", HIERARCHY_MODES))
    unknown = [m for m in modes if m not in MODE_GROUPS]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown} (choose from {', '.join(MODE_GROUPS)})")
    by_kind = {"world": world_group, "node": groups, "solo": solo}
    runs = []  # (optimizer name, mode, model, optimizer)
    for name in spec["optimizers"]:
        for mode in modes:
            kind, overlapped = MODE_GROUPS[mode]
            model = build_model(cfg, seed=spec.get("seed", 0))
            model.train()
            # overlapped: collective (it copies the group): every rank builds the runs in this one order
            exchange = dict(bucket_cap_mb=spec.get("bucket_cap_mb", 1.0), overlap_with_backward=True) if overlapped else {}
            opt = make_optimizer(name, model.parameters(), spec.get("lr", 1e-3), freeze_step, by_kind[kind], **exchange)
            runs.append((name, mode, model, opt))
    d = sum(p.numel() for p in runs[0][2].parameters()) if runs else 0
    tiny = torch.zeros(1)
    calls = spec.get("latency_calls", 20)
    probe = {"alpha_inter_s": _time_calls(lambda: dist.all_reduce(tiny, group=groups.inter), calls, world_group),
             "alpha_intra_s": _time_calls(lambda: dist.all_reduce(tiny, group=groups.intra), calls, world_group)}
    if L > 1:
        D = padded_size(d, world)
        src, dst = torch.randn(D), torch.empty(D)
        probe["intra_all_to_all_s"] = _time_calls(
            lambda: dist.all_to_all_single(dst, src, group=groups.intra), spec.get("bandwidth_calls", 3), world_group)
        probe["intra_all_to_all_bytes"] = (L - 1) * D // L * 4
    barrier_bytes = _barrier_bytes(interface, world_group)

    def intra(opt) -> int:
        return sum(opt.comm_stats.bytes_by_op.get(op, 0) for op in INTRA_OPS)

    batches = _batches(cfg, spec["batch"], 4, seed=1000 * rank + 7)
    steps: Dict[str, Dict[str, Dict[str, dict]]] = {}
    for stage, timed, batch, (name, mode, model, opt) in _two_stage_rounds(runs, batches, skip, warm, comp):
        _barrier(world_group)
        tx0 = read_counter(interface) if interface else 0
        b0, i0 = opt.comm_stats.bytes_sent, intra(opt)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        t1 = time.perf_counter()
        started = _buckets_started(opt)
        opt.step()
        t2 = time.perf_counter()
        _barrier(world_group)
        tx1 = read_counter(interface) if interface else 0
        if not timed:
            continue
        rec = steps.setdefault(name, {}).setdefault(mode, {}).setdefault(stage, {
            "step_times": [], "backward_times": [], "opt_step_times": [], "started_in_backward": [],
            "buckets": [], "bytes": [], "intra_bytes": [], "wire_bytes": []})
        rec["step_times"].append(t2 - t0)
        rec["backward_times"].append(t1 - t0)
        rec["opt_step_times"].append(t2 - t1)
        rec["started_in_backward"].append(started)
        rec["buckets"].append(len(opt.state["flat"]["buckets"]))
        rec["bytes"].append(opt.comm_stats.bytes_sent - b0)
        rec["intra_bytes"].append(intra(opt) - i0)
        rec["wire_bytes"].append(tx1 - tx0 - barrier_bytes if interface else None)
    return {"steps": steps, "barrier_bytes": barrier_bytes, "params": d, "local_size": L, "node": groups.node,
            "local_rank": groups.local_rank, "probe": probe}


def probe(spec: dict, group, numel: int) -> dict:
    """alpha (tiny all-reduce), and full-size fp32 and compressed all-reduce times."""
    from onebitlamb.comm import CommStats, compressed_allreduce, padded_size

    n = dist.get_world_size(group)
    calls = spec.get("latency_calls", 30)
    tiny = torch.zeros(1)
    lat = []
    for i in range(calls + 5):
        t0 = time.perf_counter()
        dist.all_reduce(tiny, group=group)
        if i >= 5:
            lat.append(time.perf_counter() - t0)
    out = {"alpha_s": statistics.median(lat), "params": numel}
    if spec.get("bandwidth_calls", 0):
        buf = torch.randn(numel)
        ts = []
        for i in range(spec["bandwidth_calls"] + 1):
            _barrier(group)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if i:
                ts.append(time.perf_counter() - t0)
        out["allreduce_s"] = statistics.median(ts)
        D = padded_size(numel, n)
        b, we, se = torch.randn(D), torch.zeros(D), torch.zeros(D // n)
        ts = []
        for i in range(spec["bandwidth_calls"] + 1):
            _barrier(group)
            t0 = time.perf_counter()
            compressed_allreduce(b, we, se, group=group, stats=CommStats())
            if i:
                ts.append(time.perf_counter() - t0)
        out["compressed_s"] = statistics.median(ts)
    return out


def collectives(spec: dict, group, interface: str) -> dict:
    """``calls`` collectives of one kind on ``numel`` elements: accounted vs counted bytes."""
    from onebitlamb.comm import CommStats, compressed_allreduce, padded_size

    n = dist.get_world_size(group)
    kind, calls, numel = spec["op"], spec["calls"], spec["numel"]
    stats = CommStats()
    D = padded_size(numel, n)
    buf = torch.randn(D, generator=torch.Generator().manual_seed(dist.get_rank()))
    we, se = torch.zeros(D), torch.zeros(D // n)
    _barrier(group)
    tx0, rx0 = read_counter(interface), read_counter(interface, "rx_bytes")
    t0 = time.perf_counter()
    for _ in range(calls):
        if kind == "allreduce":
            from onebitlamb.comm import allreduce_mean_

            allreduce_mean_(buf, group=group, stats=stats)
        elif kind == "compressed":
            compressed_allreduce(buf, we, se, group=group, stats=stats)
        else:
            raise ValueError(f"unknown collective {kind!r}")
    _barrier(group)
    elapsed = time.perf_counter() - t0
    return {"op": kind, "calls": calls, "D": D, "accounted_bytes": stats.bytes_sent,
            "wire_tx_bytes": read_counter(interface) - tx0,
            "wire_rx_bytes": read_counter(interface, "rx_bytes") - rx0, "elapsed_s": elapsed}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    rank, world = int(os.environ["OBL_RANK"]), int(os.environ["OBL_WORLD_SIZE"])
    torch.set_num_threads(spec.get("threads", 1))
    interface = spec.get("interface")
    result: dict = {"rank": rank, "world_size": world}
    dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec.get("collective_timeout_s", 120)))
    try:
        world_group = dist.group.WORLD
        # every rank alone in a one-rank group: an optimizer given it sees world size 1 and calls
        # no collective (new_group must be called by all ranks for every group, in one order)
        solo = [dist.new_group([r]) for r in range(world)][rank]
        if spec.get("probe"):
            from onebitlamb.train.model import build_model

            numel = sum(p.numel() for p in build_model(_model_config(spec), 0).parameters())
            result["probe"] = probe(spec["probe"], world_group, numel)
        if spec.get("collectives"):
            jobs = spec["collectives"]
            result["collectives"] = [collectives(j, world_group, interface)
                                     for j in (jobs if isinstance(jobs, list) else [jobs])]
        if spec.get("ddp"):
            result["ddp"] = ddp_steps(rank, world, spec, interface)
        if spec.get("hierarchy"):
            result["hierarchy"] = hierarchy_steps(rank, world, spec, interface, solo)
        if spec.get("hsdp"):
            result["hsdp"] = hsdp_rows(rank, world, spec, interface, solo)
        if spec.get("train"):
            # per optimizer, the compute-only step right before the networked one: both ranks
            # compute at once (they share the CPUs as in the real run) and the two measurements
            # are minutes apart at most, whatever else the machine is doing meanwhile
            result["train"], result["compute_only"] = {}, {}
            for name in spec["optimizers"]:
                _barrier(world_group)
                result["compute_only"][name] = train_one(name, spec, rank, solo, None, solo)
                result["train"][name] = train_one(name, spec, rank, world_group, interface, solo)
        _barrier(world_group)
    finally:
        dist.destroy_process_group()
    tmp = spec["out"] + f".{rank}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec["out"] + f".{rank}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
