"""A checkpoint written on n ranks resumes on m (reshard_state_dicts): the averaged error correction
is kept, the ranks agree after, and training continues as well as an uninterrupted run."""
from __future__ import annotations

import functools
import io

import pytest
import torch

import onebitlamb
from onebitlamb.optim.state_format import flat_of
from rank_pool import run_ranks

STEPS, FREEZE, SAVED_AT = 60, 15, 30


def _problem():
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 3))
    return teacher, model


def _train(rank, model, teacher, opt, first, last):
    for t in range(first, last + 1):
        x = torch.randn(32, 12, generator=torch.Generator().manual_seed(1000 * t + rank))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), teacher(x).detach()).backward()
        opt.step()


def _held_out_loss(model, teacher):
    x = torch.randn(512, 12, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), teacher(x)).item()


def _make(model, bucket_cap_mb=None, local_size=None):
    group = onebitlamb.comm.node_groups(local_size) if local_size else None
    return onebitlamb.OneBitLamb(model.parameters(), lr=0.02, weight_decay=0.01, freeze_step=FREEZE,
                                 process_group=group, bucket_cap_mb=bucket_cap_mb,
                                 overlap_with_backward=bucket_cap_mb is not None)


def _first_part(rank, n, bucket_cap_mb=None, local_size=None):
    """Steps 1..SAVED_AT on n ranks; returns this rank's checkpoint as bytes."""
    teacher, model = _problem()
    opt = _make(model, bucket_cap_mb, local_size)
    _train(rank, model, teacher, opt, 1, SAVED_AT)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, blob)
    return blob.getvalue()


@functools.lru_cache(maxsize=None)
def _saved(n, *args):
    """_first_part on n ranks, run once per session for the tests that resume the same checkpoint
    (it is seeded: a second run would return the same bytes)."""
    return tuple(run_ranks(_first_part, n, args, timeout_s=120, collective_timeout_s=60))


def _second_part(rank, m, blobs, bucket_cap_mb=None, local_size=None):
    """Load the n ranks' checkpoint resharded for m ranks, train to STEPS."""
    saved = [torch.load(io.BytesIO(b), weights_only=True) for b in blobs]
    teacher, model = _problem()
    model.load_state_dict(saved[0]["model"])
    opt = _make(model, bucket_cap_mb, local_size)
    resharded = onebitlamb.reshard_state_dicts([s["optimizer"] for s in saved], m, local_size or 1)
    opt.load_state_dict(resharded[rank])
    _train(rank, model, teacher, opt, SAVED_AT + 1, STEPS)
    return [p.detach().clone() for p in model.parameters()], _held_out_loss(model, teacher), opt.stage


def _uninterrupted(rank, n):
    teacher, model = _problem()
    opt = _make(model)
    _train(rank, model, teacher, opt, 1, STEPS)
    return _held_out_loss(model, teacher)


def test_reshard_keeps_the_mean_worker_error_and_the_server_vector():
    blobs = _saved(4)
    states = [torch.load(io.BytesIO(b), weights_only=True)["optimizer"] for b in blobs]
    flats = [flat_of(s) for s in states]
    d = sum(flats[0]["layer_numels"])
    old_mean = torch.stack([f["worker_error"][:d] for f in flats]).double().mean(dim=0)
    old_server = torch.cat([f["server_error"] for f in flats])[:d]
    assert old_mean.abs().max() > 0 and old_server.abs().max() > 0  # there is something to keep
    for m in (2, 3, 4):
        new = [flat_of(s) for s in onebitlamb.reshard_state_dicts(states, m)]
        D = onebitlamb.padded_size(d, m)
        assert [(f["rank"], f["world_size"]) for f in new] == [(r, m) for r in range(m)]
        for f in new:
            assert f["worker_error"].shape == (D,) and f["server_error"].shape == (D // m,)
            assert torch.allclose(f["worker_error"][:d].double(), old_mean, atol=1e-7)
            assert not f["worker_error"][d:].any()
            assert torch.equal(f["exp_avg"], flats[0]["exp_avg"]) and f["step"] == flats[0]["step"]
        assert torch.equal(torch.cat([f["server_error"] for f in new])[:d], old_server)
    single = flat_of(onebitlamb.reshard_state_dicts(states, 1)[0])
    assert "worker_error" not in single and single["world_size"] == 1
    with pytest.raises(ValueError, match="rank order"):
        onebitlamb.reshard_state_dicts(states[::-1], 2)
    with pytest.raises(ValueError, match="Invalid world_size: 0"):
        onebitlamb.reshard_state_dicts(states, 0)


# 4 -> 2 runs in the default suite through the main job (test_train_elastic.py), which goes through
# this same re-sharding; 2 -> 3 (more ranks than saved) only here
@pytest.mark.parametrize("n,m", [pytest.param(4, 2, marks=pytest.mark.slow), (2, 3)])
def test_a_run_saved_on_n_ranks_continues_on_m(n, m):
    """Saved after step 30 (frozen at 15) on n ranks, continued on m to step 60: the m ranks end
    bit-identical, still compressing, and as close to the teacher as uninterrupted runs on n and
    on m ranks (within the spread between those two, and a margin)."""
    blobs = _saved(n)
    out = run_ranks(_second_part, m, (blobs,), timeout_s=120, collective_timeout_s=60)
    for r in range(1, m):
        for a, b in zip(out[0][0], out[r][0]):
            assert torch.equal(a, b)
    assert out[0][2] == "compression"
    resumed = out[0][1]
    straight = [run_ranks(_uninterrupted, k, (), timeout_s=120, collective_timeout_s=60)[0] for k in (n, m)]
    low, high = min(straight), max(straight)
    margin = 0.1 * high
    assert low - margin <= resumed <= high + margin, (resumed, straight)
    initial = _held_out_loss(_problem()[1], _problem()[0])
    assert resumed < 0.5 * initial


def _padded(numel, ranks):
    return -(-numel // (8 * ranks)) * 8 * ranks


def test_a_run_with_several_buckets_is_resharded_bucket_by_bucket():
    """overlap_with_backward's buckets (each parameter alone here) each have their own padded
    region: each is resharded as a whole buffer would be, and the run goes on on 3 ranks."""
    blobs = run_ranks(_first_part, 2, (1e-4,), timeout_s=120, collective_timeout_s=60)
    states = [torch.load(io.BytesIO(b), weights_only=True)["optimizer"] for b in blobs]
    flats = [flat_of(s) for s in states]
    assert flats[0]["buckets"] == [[512, 515], [416, 512], [384, 416], [0, 384]]  # 12x32, 32, 32x3, 3 reversed
    new = [flat_of(s) for s in onebitlamb.reshard_state_dicts(states, 3)]
    w_old = s_old = w_new = s_new = 0
    for start, end in flats[0]["buckets"]:
        size = end - start
        p_old, p_new = _padded(size, 2), _padded(size, 3)
        mean = torch.stack([f["worker_error"][w_old:w_old + size] for f in flats]).double().mean(dim=0)
        server = torch.cat([f["server_error"][s_old:s_old + p_old // 2] for f in flats])[:size]
        for f in new:
            assert torch.allclose(f["worker_error"][w_new:w_new + size].double(), mean, atol=1e-7)
            assert not f["worker_error"][w_new + size:w_new + p_new].any()
        assert torch.equal(torch.cat([f["server_error"][s_new:s_new + p_new // 3] for f in new])[:size], server)
        w_old, s_old, w_new, s_new = w_old + p_old, s_old + p_old // 2, w_new + p_new, s_new + p_new // 3
    assert [f["worker_error"].numel() for f in new] == [w_new] * 3
    out = run_ranks(_second_part, 3, (blobs, 1e-4), timeout_s=120, collective_timeout_s=60)
    assert out[0][2] == "compression" and all(torch.equal(a, b) for a, b in zip(out[0][0], out[2][0]))


def test_nodes_and_flat_groups_reshard_into_each_other():
    """A run on 2 nodes of 2 ranks (node_groups(2)) continues on a flat group of 2, and one on a flat
    group of 2 on 2 nodes of 2. Rank (node k, local rank r) compresses chunk r of its node's average
    with the other nodes' rank r: the correction is the mean over nodes of their errors of chunk r,
    and its server error is their chunk k of it."""
    d = 12 * 32 + 32 + 32 * 3 + 3  # 515
    D, L = _padded(d, 4), 2
    hier = run_ranks(_first_part, 4, (None, 2), timeout_s=120, collective_timeout_s=60)
    flats = [flat_of(torch.load(io.BytesIO(b), weights_only=True)["optimizer"]) for b in hier]
    assert [f["worker_error"].numel() for f in flats] == [D // L] * 4  # chunk r of each node's average
    correction = torch.cat([(flats[r]["worker_error"].double() + flats[2 + r]["worker_error"].double()) / 2
                            for r in range(L)])
    server = torch.cat([flats[k * L + r]["server_error"] for r in range(L) for k in range(2)])
    states = [torch.load(io.BytesIO(b), weights_only=True)["optimizer"] for b in hier]
    flat_two = [flat_of(s) for s in onebitlamb.reshard_state_dicts(states, 2)]
    for f in flat_two:
        assert torch.allclose(f["worker_error"][:d].double(), correction[:d], atol=1e-7) and f["local_size"] == 1
    assert torch.equal(torch.cat([f["server_error"] for f in flat_two])[:d], server[:d])
    out = run_ranks(_second_part, 2, (hier,), timeout_s=120, collective_timeout_s=60)
    assert out[0][2] == "compression" and all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0]))

    flat = _saved(2)
    out = run_ranks(_second_part, 4, (flat, None, 2), timeout_s=120, collective_timeout_s=60)
    assert out[0][2] == "compression"
    assert all(torch.equal(a, b) for r in range(1, 4) for a, b in zip(out[0][0], out[r][0]))
    initial = _held_out_loss(_problem()[1], _problem()[0])
    assert out[0][1] < 0.5 * initial
    with pytest.raises(ValueError, match="Invalid local_size: 3"):
        onebitlamb.reshard_state_dicts(states, 4, 3)


# ------------------------------------------------------------------ rank files of several saves
def _save_rank_files(rank, n, folder, steps, early=None):
    """``steps`` steps of 1-bit Adam (frozen at 3), then this rank's file into ``folder``; with
    ``early``, also a file after step 3 into that folder."""
    from onebitlamb.integrations import save_rank_state
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4))]
    opt = onebitlamb.OneBitAdam(params, lr=0.01, freeze_step=3)
    for t in range(1, steps + 1):
        params[0].grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * t + rank))
        opt.step()
        if t == 3 and early:
            save_rank_state(opt, early)
    save_rank_state(opt, folder)


def _load_rank_files(rank, n, folder):
    from onebitlamb.integrations import load_rank_state
    opt = onebitlamb.OneBitAdam([torch.nn.Parameter(torch.randn(6, 4))], lr=0.01, freeze_step=3)
    try:
        load_rank_state(opt, folder)
    except ValueError as e:
        return str(e)
    return opt.state["flat"]["step"]


def test_the_newest_complete_set_of_rank_files_wins_and_a_mixed_set_is_named(tmp_path):
    """A folder with a set of 4 rank files saved at step 5 and one of 2 saved at step 9: 4 ranks
    and 2 ranks both resume step 9 (4 re-sharded from the 2); a set whose rank 1 file comes from
    an earlier save is refused on every rank, naming the steps."""
    import shutil
    folder, early = str(tmp_path / "ckpt"), str(tmp_path / "early")
    run_ranks(_save_rank_files, 4, (folder, 5), timeout_s=120, collective_timeout_s=60)
    run_ranks(_save_rank_files, 2, (folder, 9, early), timeout_s=120, collective_timeout_s=60)
    assert run_ranks(_load_rank_files, 4, (folder,), timeout_s=120, collective_timeout_s=60) == [9] * 4
    assert run_ranks(_load_rank_files, 2, (folder,), timeout_s=120, collective_timeout_s=60) == [9] * 2
    name = "onebitlamb-optimizer-rank1-of-2.pt"
    shutil.copy(f"{early}/{name}", f"{folder}/{name}")
    for message in run_ranks(_load_rank_files, 2, (folder,), timeout_s=120, collective_timeout_s=60):
        assert "saved at different steps" in message and "{0: 9, 1: 3}" in message
