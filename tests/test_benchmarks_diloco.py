"""benchmarks.diloco: the algorithm on 2 real gloo ranks against references written here (an identity
that holds exactly in exact arithmetic, and n workers simulated in one process), and its bytes
against the float32 all-reduce's formula."""
import pytest
import torch
from torch import nn

import onebitlamb
from benchmarks.diloco import DiLoCo, Settings, own_group
from rank_pool import run_ranks

WORLD = 2
SGD_LR = 0.1
LAMB = dict(lr=0.05, weight_decay=0.01)
H, STEPS = 3, 7  # syncs after steps 3 and 6, and after the last (7)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s batch of step ``step``: its own data, a function of (rank, step) only."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    return nn.functional.mse_loss(model(x), y)


def _vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _on_ranks(rank: int, world: int) -> dict:
    """Both cases on this rank: inner SGD with H=1 and the outer SGD at lr 1 without momentum; inner
    LAMB on this rank's own group with H=3 and the paper's outer Nesterov SGD, recording the
    parameters after every step."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    state = DiLoCo(model.parameters(), 1, outer_lr=1.0, outer_momentum=0.0)
    for step in range(5):
        inner.zero_grad()
        _loss(model, rank, step).backward()
        inner.step()
        state.step()
    sgd = {"params": _vector(model), "syncs": state.syncs}

    model = _model()
    inner = onebitlamb.Lamb(model.parameters(), **LAMB, process_group=own_group(rank, world, 30.0))
    state = DiLoCo(model.parameters(), H, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    after, synced = [], []
    for step in range(STEPS):
        inner.zero_grad()
        _loss(model, rank, step).backward()
        inner.step()
        synced.append(state.step(sync=step + 1 == STEPS))
        after.append(_vector(model))
    lamb = {"after": after, "synced": synced, "syncs": state.syncs, "numel": state.numel,
            "stats": state.comm_stats.state_dict(), "inner_stats": inner.comm_stats.state_dict()}

    model = _model()  # a failed inner step on rank 1 only, at step 1 of 2: both ranks stop at the sync
    state = DiLoCo(model.parameters(), 2)
    stopped = []
    for step in range(3):
        try:
            state.step(finite=not (rank == 1 and step == 0))
        except FloatingPointError:
            stopped.append(step + 1)
            break
    failure = {"stopped": stopped, "untouched": torch.equal(_vector(model), _vector(_model())),
               "bytes": state.comm_stats.bytes_sent}
    return {"sgd": sgd, "lamb": lamb, "failure": failure}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_on_ranks, WORLD, timeout_s=180, collective_timeout_s=60)


def test_h1_outer_lr1_without_momentum_is_synchronous_sgd_on_the_mean_gradient(ranks):
    # each worker: theta - lr g_r; outer gradient lr g_r, averaged: lr mean(g); outer step at lr 1:
    # theta - lr mean(g), synchronous SGD (equal up to the rounding of theta - (theta - lr g))
    model = _model()
    for step in range(5):
        grads = []
        for r in range(WORLD):
            model.zero_grad()
            _loss(model, r, step).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= SGD_LR * sum(g[i] for g in grads) / WORLD
    for out in ranks:
        assert out["sgd"]["syncs"] == 5
        torch.testing.assert_close(out["sgd"]["params"], _vector(model), rtol=0, atol=1e-6)


def test_h3_with_inner_lamb_matches_n_workers_simulated_in_one_process(ranks):
    workers = [_model() for _ in range(WORLD)]
    inners = [onebitlamb.Lamb(m.parameters(), **LAMB) for m in workers]  # no process group here: one process
    anchor, momentum = _vector(workers[0]), None
    expected = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        for r, (m, opt) in enumerate(zip(workers, inners)):
            opt.zero_grad()
            _loss(m, r, step).backward()
            opt.step()
        if (step + 1) % H == 0 or step + 1 == STEPS:
            delta = sum(anchor - _vector(m) for m in workers) / WORLD
            momentum = delta.clone() if momentum is None else OUTER_MOMENTUM * momentum + delta
            anchor = anchor - OUTER_LR * (delta + OUTER_MOMENTUM * momentum)  # Nesterov
            with torch.no_grad():
                for m in workers:
                    for p, chunk in zip(m.parameters(), anchor.split([p.numel() for p in m.parameters()])):
                        p.copy_(chunk.view_as(p))
        for r, m in enumerate(workers):
            expected[r].append(_vector(m))
    for r, out in enumerate(ranks):
        assert out["lamb"]["synced"] == [False, False, True, False, False, True, True]
        for step in range(STEPS):
            torch.testing.assert_close(out["lamb"]["after"][step], expected[r][step], rtol=1e-6, atol=1e-6)


def test_ranks_differ_between_syncs_and_end_bit_identical_after_each(ranks):
    first, second = (out["lamb"] for out in ranks)
    for step, synced in enumerate(first["synced"]):
        same = torch.equal(first["after"][step], second["after"][step])
        assert same == synced, f"step {step + 1}: ranks {'equal' if same else 'differ'}, synced {synced}"


def test_bytes_per_sync_are_one_float32_ring_allreduce_and_the_inner_steps_send_nothing(ranks):
    for out in ranks:
        lamb = out["lamb"]
        d = lamb["numel"]
        assert d == sum(p.numel() for p in _model().parameters())
        per_sync = 2 * (WORLD - 1) * (4 * d) // WORLD  # ring all-reduce: reduce-scatter + all-gather of 4d bytes
        assert lamb["syncs"] == 3
        assert lamb["stats"] == {"bytes_sent": 3 * per_sync, "calls": 3, "bytes_by_op": {"all_reduce": 3 * per_sync},
                                 "rounds_by_op": {"all_reduce": 3}}
        assert lamb["inner_stats"]["bytes_sent"] == 0 and lamb["inner_stats"]["calls"] == 0


def test_a_failed_inner_step_on_one_rank_stops_every_rank_at_the_next_sync(ranks):
    d = sum(p.numel() for p in _model().parameters())
    for out in ranks:
        assert out["failure"] == {"stopped": [2], "untouched": True, "bytes": 2 * (WORLD - 1) * 4 * d // WORLD}


def test_synced_parameters_lends_the_last_sync_and_gives_this_ranks_back_bit_for_bit():
    model = _model()  # one process, no process group: the sync is a local outer step
    start = _vector(model)
    state = DiLoCo(model.parameters(), 4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    assert not state.step()
    own = _vector(model)
    with state.synced_parameters():
        assert torch.equal(_vector(model), start)
    assert torch.equal(_vector(model), own)


@pytest.mark.parametrize("kwargs", [dict(H=0), dict(H=2.0), dict(H=2, outer_lr=0.0), dict(H=2, outer_momentum=1.0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        DiLoCo(_model().parameters(), **kwargs)


# ---- the training entry, beside `onebitlamb pretrain --optimizer lamb` on the same job


def test_a_runs_name_says_its_outer_settings_when_not_the_papers():
    assert Settings(16).name == "diloco-H16"  # the run benchmarks.network's whole-run table reads
    assert Settings(8, outer_lr=1.0, outer_momentum=0.0).name == "diloco-H8-olr1-om0"
