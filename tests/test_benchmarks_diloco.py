"""benchmarks.diloco: torchft's DiLoCo and streaming DiLoCo on 2 gloo ranks through the benchmark's
own code path (a lighthouse started and stopped here, each rank a replica with its own Manager,
``TorchftDiLoCo`` driving the inner AdamW), against n workers simulated in one process; and the
settings, names and fragments."""
import pytest
import torch
from torch import nn

from benchmarks import diloco
from onebitlamb.comm.launch import spawn_local

WORLD = 2
H, STEPS = 4, 9  # DiLoCo syncs after steps 4 and 8; streaming (2 fragments) one fragment every 2 steps
INNER = dict(lr=0.01, weight_decay=0.01)
TIMEOUT_S = 20.0


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


def _on_rank(rank: int, world: int, address: str, fragments: int) -> dict:
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    with diloco.replica_manager(rank, world, address, TIMEOUT_S) as manager:
        run = diloco.TorchftDiLoCo(manager, dict(model.named_parameters()), inner,
                                   diloco.Settings(H, fragments), world)
        after, synced, agreed = [], [], []
        for step in range(STEPS):
            inner.zero_grad()
            _loss(model, rank, step).backward()
            inner.step()
            synced.append(run.after_step())
            after.append(_vector(model))
            with run.synced_parameters():
                agreed.append(_vector(model))
            assert torch.equal(_vector(model), after[-1]), "synced_parameters gave this rank's own back"
        run.close()
    return {"after": after, "synced": synced, "agreed": agreed, "syncs": run.syncs, "bytes": run.bytes_sent}


@pytest.fixture(scope="module", params=[1, 2], ids=["diloco", "streaming"])
def ranks(request):
    with diloco.lighthouse(WORLD, TIMEOUT_S) as address:
        return request.param, spawn_local(_on_rank, WORLD, (address, request.param), timeout_s=50,
                                          collective_timeout_s=TIMEOUT_S)


def _simulated(fragments: int):
    """n workers in one process: each its own AdamW; every H / F steps the next fragment's outer
    gradient (the last sync's parameters minus the worker's) averaged, the paper's Nesterov SGD on
    that fragment, every worker's fragment set to the result. Each worker's parameters after every step."""
    workers = [_model() for _ in range(WORLD)]
    inners = [torch.optim.AdamW(m.parameters(), **INNER) for m in workers]
    names = [name for name, _ in workers[0].named_parameters()]
    cut = [list(f.named_parameters()) for f in diloco.fragments(dict(workers[0].named_parameters()), fragments)]
    cut = [[name.replace("_", ".") for name, _ in f] for f in cut]
    anchor = {n: p.detach().clone() for n, p in workers[0].named_parameters()}
    momentum = {n: None for n in names}
    out = [[] for _ in range(WORLD)]
    syncs = 0
    for step in range(STEPS):
        for r, (m, opt) in enumerate(zip(workers, inners)):
            opt.zero_grad()
            _loss(m, r, step).backward()
            opt.step()
        if (step + 1) % (H // fragments) == 0:
            for n in cut[syncs % fragments]:
                delta = sum(anchor[n] - dict(m.named_parameters())[n].detach() for m in workers) / WORLD
                momentum[n] = delta.clone() if momentum[n] is None else diloco.OUTER_MOMENTUM * momentum[n] + delta
                anchor[n] = anchor[n] - diloco.OUTER_LR * (delta + diloco.OUTER_MOMENTUM * momentum[n])
                with torch.no_grad():
                    for m in workers:
                        dict(m.named_parameters())[n].copy_(anchor[n])
            syncs += 1
        for r, m in enumerate(workers):
            out[r].append(_vector(m))
    return out, syncs


def test_torchft_diloco_on_two_ranks_matches_workers_simulated_in_one_process(ranks):
    fragments, outs = ranks
    expected, syncs = _simulated(fragments)
    every = H // fragments
    for r, out in enumerate(outs):
        assert out["synced"] == [(s + 1) % every == 0 for s in range(STEPS)]
        assert out["syncs"] == syncs == STEPS // every
        for step in range(STEPS):
            torch.testing.assert_close(out["after"][step], expected[r][step], rtol=1e-5, atol=1e-6)


def test_the_synced_parameters_are_the_same_bits_on_every_rank_and_the_ranks_differ_between(ranks):
    fragments, (first, second) = ranks
    for step in range(STEPS):
        assert torch.equal(first["agreed"][step], second["agreed"][step])
        if fragments == 1:  # after a DiLoCo sync every parameter is the agreed one; between, the ranks' own
            assert torch.equal(first["after"][step], second["after"][step]) == first["synced"][step]


def test_a_sync_sends_one_float32_all_reduce_of_its_fragment():
    model = _model()
    d = sum(p.numel() for p in model.parameters())
    full = 2 * (WORLD - 1) * 4 * d // WORLD
    assert diloco.allreduce_bytes(d, WORLD) == full


def test_bytes_counted_are_the_fragments_all_reduces(ranks):
    fragments, outs = ranks
    cut = diloco.fragments(dict(_model().named_parameters()), fragments)
    sizes = [sum(p.numel() for p in f.parameters()) for f in cut]
    expected = sum(diloco.allreduce_bytes(sizes[i % fragments], WORLD) for i in range(outs[0]["syncs"]))
    assert [out["bytes"] for out in outs] == [expected] * WORLD


def test_fragments_cut_the_parameters_in_order_each_once_about_evenly():
    model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)])
    named = dict(model.named_parameters())
    for count in (1, 2, 4, 8):
        cut = diloco.fragments(named, count)
        ids = [id(p) for f in cut for p in f.parameters()]
        assert len(cut) == count and ids == [id(p) for p in named.values()]
    sizes = [sum(p.numel() for p in f.parameters()) for f in diloco.fragments(named, 2)]
    assert sizes == [220, 220]
    with pytest.raises(ValueError, match="9"):
        diloco.fragments(named, 9)


def test_a_runs_name_says_its_fragments_and_its_rates_when_not_the_defaults():
    assert diloco.Settings(16).name == "diloco-H16"  # the run benchmarks.network's whole-run table reads
    assert diloco.Settings(16, 2).name == "streaming-diloco-F2-H16"
    assert diloco.Settings(8, outer_lr=0.4).name == "diloco-H8-olr0.4"
    assert [s.name for s in diloco.grid([4, 6], [0.7], [2, 4])] == [
        "streaming-diloco-F2-H4", "streaming-diloco-F2-H6", "streaming-diloco-F4-H4"]


@pytest.mark.parametrize("kwargs, named", [(dict(H=0), "0"), (dict(H=2.0), "2.0"), (dict(H=6, fragments=4), "6"),
                                           (dict(H=2, outer_lr=0.0), "0.0"), (dict(H=2, fragments=0), "0")])
def test_bad_settings_are_refused_naming_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named):
        diloco.Settings(**kwargs)
