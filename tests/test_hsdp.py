"""The 1-bit optimizers on FSDP2-sharded parameters (HSDP), on 4 real gloo ranks: 2 replicas of 2
shards against the single-process reference run per shard (tests/reference.py, ``shards=2``), a
shard size of 1 against the unsharded optimizer bit for bit, a real ``fully_shard`` model through
``torch.distributed.checkpoint``, and the set-ups that are refused.

Fresh processes (``spawn_local``), not the rank pool: FSDP2 builds DeviceMeshes, which torch keeps
in a process-wide registry that would outlive the process group the pool destroys after each call.
Every part on 4 ranks runs in one start of them (``four_ranks``): starting 4 interpreters that
import torch took longer than most parts' own work.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import onebitlamb
from onebitlamb.comm.launch import spawn_local
from onebitlamb.optim.state_format import flat_of
from reference import Reference
from toy import grads_for, initial_params

LRS = [0.02, 0.01, 0.02, 0.05]
WDS = [0.01, 0.0, 0.01, 0.0]
CLASSES = {"lamb": onebitlamb.Lamb, "onebitlamb": onebitlamb.OneBitLamb, "onebitadam": onebitlamb.OneBitAdam}


def _mesh(replicas, shards):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _optimizer(kind, params, group, freeze, **options):
    groups = [{"params": [p], "lr": lr, "weight_decay": wd} for p, lr, wd in zip(params, LRS, WDS)]
    if kind != "lamb":
        options["freeze_step"] = freeze
    return CLASSES[kind](groups, lr=LRS[0], process_group=group, **options)


def _sharded_run(rank, n, replicas, shards, kind, steps, freeze, options, nan_at=None):
    """Each rank: the toy layers as DTensors sharded over its replica's ranks, each replica's
    gradient that of ``grads_for`` at the whole parameters (what FSDP's reduce-scatter leaves:
    the replica's average, cut in shards), stepped ``steps`` times; with one shard, the same run on
    plain tensors beside it. Returns the whole parameters after every step."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(replicas, shards)
    replica = rank // shards
    group = mesh["replicate"].get_group()
    params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh["shard"], [Shard(0)])) for t in initial_params()]
    opt = _optimizer(kind, params, group, freeze, **options)
    plain = [torch.nn.Parameter(t.clone()) for t in initial_params()] if shards == 1 else None
    plain_opt = _optimizer(kind, plain, group, freeze, **options) if plain else None
    history, plain_history = [], []
    for t in range(1, steps + 1):
        whole = [p.full_tensor() for p in params]
        grads = grads_for(whole, replica, t)
        for p, g in zip(params, grads):
            p.grad = distribute_tensor(g, mesh["shard"], [Shard(0)])
        if nan_at is not None and (t, rank) == nan_at:  # one rank's shard of one gradient
            p.grad.to_local().view(-1)[0] = float("nan")
        opt.step()
        history.append([p.full_tensor().clone() for p in params])
        if plain:
            for p, g in zip(plain, grads_for(plain, replica, t)):
                p.grad = g
            plain_opt.step()
            plain_history.append([p.detach().clone() for p in plain])
    flat = opt.state["flat"]
    return {"history": history, "plain": plain_history, "stage": opt.stage,
            "exchange ranks": dist.get_process_group_ranks(opt.process_group),
            "state numel": flat["exp_avg"].numel(), "whole numel": sum(p.numel() for p in params),
            "skipped": opt.stats()["skipped_steps"],
            "slow bytes": opt.comm_stats.bytes_sent, "node bytes": opt.shard_comm_stats.bytes_sent}


def rel_err(a, b):
    return float((a - b).detach().norm() / b.norm())


CASES = [("onebitlamb", "update"), ("onebitlamb", "momentum"), ("onebitadam", None), ("lamb", None)]
STEPS, FREEZE = 24, 10
NAN_AT = (14, 3)  # a NaN in the shard of rank 3 (replica 1, shard 1) after the freeze


def _options(kind, space):
    return ({} if kind == "lamb" else {"bound_direction": True}) | ({"compression_space": space} if space else {})


def _cases(rank, n, replicas, shards, cases, steps, freeze, nan_at):
    """``_sharded_run`` of every case, in one launch (the ranks start once)."""
    return {case: _sharded_run(rank, n, replicas, shards, case[0], steps, freeze, _options(*case), nan_at)
            for case in cases}


def _parts(rank, n, parts):
    """Each part's function on this rank, in turn; a part that raised comes back as its traceback,
    so that the other parts' tests still run and report."""
    import traceback

    done = {}
    for name, fn, args in parts:
        try:
            done[name] = ("ok", fn(rank, n, *args))
        except Exception:  # noqa: BLE001 (reported by the part's test)
            done[name] = ("raised", traceback.format_exc())
    return done


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Every part of this module on 4 ranks, in one ``spawn_local``; ``_part`` reads one back."""
    folder = tmp_path_factory.mktemp("hsdp")
    parts = [("reference", _cases, (2, 2, CASES, STEPS, FREEZE, NAN_AT)),
             ("shard size one", _shard_size_one, (SIZE_ONE_STEPS, SIZE_ONE_FREEZE)),
             *[(("dcp", kind, mixed), _dcp_run, (kind, str(folder / f"dcp-{kind}"), mixed)) for kind, mixed in DCP_CASES],
             ("refusals", _refusals, ()),
             ("saved states", _save_states, (str(folder / "states"),))]
    (folder / "states").mkdir()
    return spawn_local(_parts, 4, (parts,), timeout_s=600, collective_timeout_s=120), folder


def _part(four_ranks, name):
    """That part's result on each rank; an exception on any rank fails the test with its traceback."""
    ranks, _ = four_ranks
    for rank, done in enumerate(ranks):
        status, value = done[name]
        if status != "ok":
            raise AssertionError(f"{name!r} raised on rank {rank}:\n{value}")
    return [done[name][1] for done in ranks]


@pytest.mark.parametrize("kind,space", CASES)
def test_two_replicas_of_two_shards_follow_the_sharded_reference(four_ranks, kind, space):
    steps, freeze, nan_at = STEPS, FREEZE, NAN_AT
    out = [rank[(kind, space)] for rank in _part(four_ranks, "reference")]
    assert [o["skipped"] for o in out] == [1, 1, 1, 1]  # the NaN skipped the step on every rank
    # the exchange runs over the replicas of this rank's shard: ranks 0 and 2 hold shard 0
    assert [o["exchange ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(o["stage"] == ("warmup" if kind == "lamb" else "compression") for o in out)
    # each rank keeps the state of its shard only: the toy layers' 80 elements cut by torch.chunk
    # along their first dimension, (7, 5) into 4 and 3 rows, (5,) into 3 and 2, (16,) into 8 and 8,
    # (3, 4, 2) into 2 and 1 rows: 47 and 33
    assert [o["state numel"] for o in out] == [47, 33, 47, 33] and out[0]["whole numel"] == 80
    # every rank, replica or not, holds the same whole parameters after every step, to the bit
    for t in range(steps):
        for o in out[1:]:
            assert all(torch.equal(a, b) for a, b in zip(out[0]["history"][t], o["history"][t])), f"step {t + 1}"
    ref = Reference(initial_params(), kind, LRS, WDS, freeze_step=None if kind == "lamb" else freeze, n=2,
                    shards=2, bound_direction=kind != "lamb", **({"compression_space": space} if space else {}))
    for t in range(1, steps + 1):
        if t != nan_at[0]:
            ref.step([grads_for(ref.x, r, t) for r in range(2)])
        for a, x in zip(out[0]["history"][t - 1], ref.x):
            assert rel_err(a, x) < 2e-6, f"step {t}"
    # per-layer statistics went over the node's link, the exchange over the slow one
    assert out[0]["node bytes"] > 0 and out[0]["slow bytes"] > 0


def _shard_size_one(rank, n, steps, freeze):
    return {dtype: _sharded_run(rank, n, 4, 1, "onebitlamb", steps, freeze,
                                {"warmup_dtype": dtype, "compression_space": "update", "bound_direction": True})
            for dtype in ("float32", "int8")}


SIZE_ONE_STEPS, SIZE_ONE_FREEZE = 16, 6


def test_a_shard_size_of_one_is_the_unsharded_optimizer_bit_for_bit(four_ranks):
    steps = SIZE_ONE_STEPS
    runs = _part(four_ranks, "shard size one")
    for o in (rank[dtype] for rank in runs for dtype in ("float32", "int8")):
        assert o["exchange ranks"] == [0, 1, 2, 3]
        for t in range(steps):
            assert all(torch.equal(a, b) for a, b in zip(o["history"][t], o["plain"][t])), f"step {t + 1}"
        assert o["node bytes"] == 0  # a shard group of one rank sends nothing


# ---------------------------------------------------------------- a real fully_shard model
def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _sharded_model(seed, mesh, mixed):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(seed)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    kw = {"mp_policy": policy} if policy else {}
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"], **kw)
    fully_shard(model, mesh=mesh["shard"], **kw)
    return model


def _train(model, opt, rank, steps):
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _dcp_run(rank, n, kind, folder, mixed):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    steps, save_at = 10, 6
    mesh = _mesh(2, 2)
    group = mesh["replicate"].get_group()

    def build(seed):
        model = _sharded_model(seed, mesh, mixed)
        return model, CLASSES[kind](model.parameters(), lr=0.02, freeze_step=4, process_group=group)

    model, opt = build(0)
    _train(model, opt, rank, range(save_at))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    saved = flat_of(opt.state_dict())
    _train(model, opt, rank, range(save_at, steps))
    uninterrupted = [p.full_tensor().clone() for p in model.parameters()]

    model, opt = build(rank + 7)  # another start, as a new process would have
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = flat_of(opt.state_dict())
    same = loaded.keys() == saved.keys() and all(
        torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v for k, v in saved.items())
    _train(model, opt, rank, range(save_at, steps))
    resumed = [p.full_tensor().clone() for p in model.parameters()]
    return {"same state": same, "uninterrupted": uninterrupted, "resumed": resumed, "stage": opt.stage,
            "errors": saved.get("worker_error")}


DCP_CASES = [("onebitlamb", False), ("onebitadam", True)]


@pytest.mark.parametrize("kind,mixed", DCP_CASES)
def test_fully_shard_model_resumes_bit_identically_through_dcp(four_ranks, kind, mixed):
    out = _part(four_ranks, ("dcp", kind, mixed))
    assert all(o["stage"] == "compression" and o["same state"] for o in out)  # each rank got its own shard's state
    assert not torch.equal(out[0]["errors"], out[2]["errors"])  # the replicas' errors differ, and both came back
    for o in out:
        assert all(torch.equal(a, b) for a, b in zip(o["uninterrupted"], o["resumed"]))
        assert all(torch.equal(a, b) for a, b in zip(o["resumed"], out[0]["resumed"]))


# ---------------------------------------------------------------- refused
def _refusals(rank, n):
    from torch.distributed.fsdp import fully_shard

    said = {}
    mesh = _mesh(2, 2)
    attempts = {
        "1-D FSDP over every rank": lambda: fully_shard(_model(0)),
        "native HSDP": lambda: fully_shard(_model(0), mesh=mesh),
        "no replicate group": lambda: fully_shard(_model(0), mesh=mesh["shard"]),
    }
    for name, build in attempts.items():
        try:
            onebitlamb.OneBitLamb(build().parameters(), lr=0.01, freeze_step=3)
        except ValueError as exc:
            said[name] = str(exc)
    model = fully_shard(_model(0), mesh=mesh["shard"])
    try:
        onebitlamb.ZeroOneAdam(model.parameters(), lr=0.01, var_freeze_step=4, process_group=mesh["replicate"].get_group())
    except ValueError as exc:
        said["0/1 Adam"] = str(exc)
    # the ranks of a node must build the same optimizer: an lr given on rank 1 alone is named
    model = fully_shard(_model(0), mesh=mesh["shard"])
    lr = 0.02 if rank == 1 else 0.01
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=lr, freeze_step=3, process_group=mesh["replicate"].get_group())
    model(torch.randn(4, 8)).sum().backward()
    try:
        opt.step()
    except ValueError as exc:
        said["lr on one rank"] = str(exc)
    # the state of one shard loads on that shard only
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.01, freeze_step=3, process_group=mesh["replicate"].get_group())
    whole = onebitlamb.OneBitLamb(_model(0).parameters(), lr=0.01, freeze_step=3)
    for name, state, into in (("shard into whole", opt.state_dict(), whole),
                              ("whole into shard", whole.state_dict(), opt)):
        try:
            into.load_state_dict(state)
        except ValueError as exc:
            said[name] = str(exc)
    return said


def test_sharded_setups_without_replicas_or_with_fsdps_own_allreduce_are_refused_by_name(four_ranks):
    for said in _part(four_ranks, "refusals"):
        assert set(said) == {"1-D FSDP over every rank", "native HSDP", "no replicate group", "0/1 Adam",
                             "shard into whole", "whole into shard", "lr on one rank"}
        assert "the ranks built different optimizers: param groups (lr, weight_decay)" in said["lr on one rank"]
        for name in ("1-D FSDP over every rank", "no replicate group"):
            assert "has no replicas" in said[name] and "mesh['replicate'].get_group()" in said[name]
        assert "native HSDP" in said["native HSDP"] and "set_requires_all_reduce(False)" in said["native HSDP"]
        assert "ZeroOneAdam does not take sharded parameters" in said["0/1 Adam"]
        assert "saved for shard" in said["shard into whole"] and "over unsharded parameters" in said["shard into whole"]
        assert "saved for unsharded parameters" in said["whole into shard"]


# ---------------------------------------------------------------- another number of replicas
def _save_states(rank, n, folder):
    mesh = _mesh(2, 2)
    model = _sharded_model(0, mesh, False)
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.02, freeze_step=3, process_group=mesh["replicate"].get_group())
    _train(model, opt, rank, range(5))
    torch.save(opt.state_dict(), f"{folder}/rank{rank}.pt")
    whole = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective: every rank
    if rank == 0:
        torch.save(whole, f"{folder}/model.pt")
    return flat_of(opt.state_dict())["exp_avg"]


def _resume_on_one_replica(rank, n, folder):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(1, 2)
    model = _sharded_model(7, mesh, False)
    whole = torch.load(f"{folder}/model.pt")
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.to_local().copy_(distribute_tensor(whole[k], mesh["shard"], [Shard(0)]).to_local())
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.02, freeze_step=3, process_group=mesh["replicate"].get_group())
    # this rank holds shard `rank`: the saved run's replicas of it were ranks `rank` and `rank + 2`
    replicas = [torch.load(f"{folder}/rank{r}.pt") for r in (rank, rank + 2)]
    opt.load_state_dict(onebitlamb.reshard_state_dicts(replicas, 1)[0])
    loaded = flat_of(opt.state_dict())["exp_avg"].clone()
    _train(model, opt, rank, range(5, 7))
    return loaded, opt.stats()["step"], [p.full_tensor() for p in model.parameters()]


def test_a_sharded_state_resumes_on_another_number_of_replicas(four_ranks):
    saved = _part(four_ranks, "saved states")
    folder = str(four_ranks[1] / "states")
    out = spawn_local(_resume_on_one_replica, 2, (folder,), timeout_s=240, collective_timeout_s=120)
    for rank, (loaded, step, params) in enumerate(out):
        assert torch.equal(loaded, saved[rank]) and step == 7  # its shard's moments, then two more steps
        assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.equal(a, b) for a, b in zip(out[0][2], out[1][2]))
