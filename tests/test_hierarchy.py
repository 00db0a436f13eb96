"""The hierarchical compressed all-reduce (docs/hierarchy.md) on real gloo ranks.

Spawning ranks costs seconds on a 2-core machine, so each world size is spawned once: the
module-level ``_checks`` runs every scenario on each rank (4 ranks as 2 nodes x 2, 4 x 1 and
1 x 4; 2 ranks as 2 x 1 and 1 x 2) and returns what it saw; the tests examine those results
(cached per world size) against ``tests/reference.py``'s ``HierarchicalAllReduceSim``, run in the
test process on the inputs the ranks gathered.
"""
import functools
import os

import pytest
import torch

from onebitlamb.comm import (CommStats, NodeGroups, allreduce_mean_, compressed_allreduce, error_sizes,
                             node_groups, padded_size, world_size_of)
from rank_pool import raised, run_ranks
from reference import HierarchicalAllReduceSim

TOPOLOGIES = {4: [(2, 2), (4, 1), (1, 4)], 2: [(2, 1), (1, 2)]}   # world: [(nodes N, local size L)]
CASES = [(n, N, L) for n, tops in TOPOLOGIES.items() for N, L in tops]
SIZES = [3, 1001]    # d: both padded; 3 gives a single sign byte per piece on 4 ranks
CALLS = 12           # successive calls, so the error buffers evolve
BYTES_D = 65536      # the buffer of the bytes comparison
MEAN_SHAPES = [(1001,), (5, 7), (1024,)]   # sizes not a multiple of L (a padded copy) and one that is


def _inputs(rank, d, D, calls, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + d)
    out = []
    for t in range(calls):
        b = torch.zeros(D)
        b[:d] = torch.randn(d, generator=g) * (1.0 + rank) * (0.5 + (t % 5) / 4)
        if d > 10:
            b[t % d] = 0.0
        out.append(b.to(dtype))
    return out


def _run_topology(rank, n, groups):
    res = {"repr": repr(groups), "world_size_of": world_size_of(groups),
           "fields": (groups.nodes, groups.local_size, groups.world_size, groups.node, groups.local_rank)}
    for d in SIZES:
        D = padded_size(d, n)
        worker, server = error_sizes(D, groups)
        e_w, e_s = torch.zeros(worker), torch.zeros(server)
        inputs, outputs, stats = _inputs(rank, d, D, CALLS), [], []
        for b in inputs:
            buf = b.clone()
            s = CommStats()
            assert compressed_allreduce(buf, e_w, e_s, groups, s) is buf
            outputs.append(buf.clone())
            stats.append(s.state_dict())
        res[("oracle", d)] = dict(inputs=inputs, outputs=outputs, e_w=e_w, e_s=e_s, stats=stats)
    # bytes: one call of a larger buffer, hierarchical and flat on the same D
    hier, flat = CommStats(), CommStats()
    worker, server = error_sizes(BYTES_D, groups)
    compressed_allreduce(torch.randn(BYTES_D), torch.zeros(worker), torch.zeros(server), groups, hier)
    compressed_allreduce(torch.randn(BYTES_D), torch.zeros(BYTES_D), torch.zeros(BYTES_D // n), None, flat)
    res["bytes"] = dict(hier=hier.state_dict(), flat=flat.state_dict())
    # bf16: the node stages move bytes, so any float dtype travels through gloo
    D = padded_size(1001, n)
    buf = _inputs(rank, 1001, D, 1, torch.bfloat16)[0]
    worker, server = error_sizes(D, groups)
    compressed_allreduce(buf, torch.zeros(worker, dtype=torch.bfloat16), torch.zeros(server, dtype=torch.bfloat16),
                         groups, CommStats())
    res["bf16"] = buf
    # averaging (the warm-up)
    res["mean"] = []
    for shape in MEAN_SHAPES:
        g = torch.Generator().manual_seed(rank * 31 + len(shape))
        x = torch.randn(shape, generator=g) * (rank + 1)
        y = x.clone()
        s = CommStats()
        assert allreduce_mean_(y, groups, s) is y
        res["mean"].append(dict(input=x, output=y, stats=s.state_dict()))
    return res


def _checks(rank, n):
    res = {}
    for N, L in TOPOLOGIES[n]:
        groups = node_groups(L)
        res[(N, L)] = _run_topology(rank, n, groups)
    if n != 4:
        return res
    # bad topologies: every rank raises the same ValueError, and the world stays usable
    res["bad"] = {
        "local_size 3": raised(lambda: node_groups(3)),
        "local_size 0": raised(lambda: node_groups(0)),
        "disagree": raised(lambda: node_groups(1 if rank == 0 else 2)),
    }
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    res["bad"]["env unset"] = raised(lambda: node_groups())
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    groups = node_groups()  # torchrun's variable
    res["from env"] = (groups.nodes, groups.local_size)
    # bad buffers raise before any communication
    D = padded_size(1001, n)
    res["bad"]["flat-sized worker_error"] = raised(
        lambda: compressed_allreduce(torch.zeros(D), torch.zeros(D), torch.zeros(D // n), groups, CommStats()))
    res["bad"]["D not a multiple of 8n"] = raised(
        lambda: compressed_allreduce(torch.zeros(8 * n + 8), torch.zeros(4 * n + 4), torch.zeros(2), groups))
    res["error_sizes"] = dict(flat=error_sizes(D), hier=error_sizes(D, groups),
                              bad=raised(lambda: error_sizes(D + 8, groups)))
    # a NaN on one rank: every rank raises, and the groups still work afterwards
    buf = torch.ones(D)
    if rank == 3:
        buf[5] = float("nan")
    worker, server = error_sizes(D, groups)
    res["nonfinite"] = raised(lambda: compressed_allreduce(buf, torch.zeros(worker), torch.zeros(server),
                                                            groups, CommStats()))
    after = torch.full((D,), float(rank))
    compressed_allreduce(after, torch.zeros(worker), torch.zeros(server), groups, CommStats())
    res["after nonfinite"] = after
    return res


@functools.lru_cache(maxsize=None)
def results(n):
    return run_ranks(_checks, n, timeout_s=60, collective_timeout_s=30)


def _gathered(n, N, L, key):
    return [r[(N, L)][key] for r in results(n)]


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("n,N,L", CASES)
def test_matches_simulation_over_successive_calls(n, N, L, d):
    ranks = _gathered(n, N, L, ("oracle", d))
    D = padded_size(d, n)
    sim = HierarchicalAllReduceSim(N, L, D)
    for t in range(CALLS):
        expected = sim([ranks[i]["inputs"][t] for i in range(n)])
        for i in range(n):
            torch.testing.assert_close(ranks[i]["outputs"][t], expected, rtol=1e-5, atol=0,
                                       msg=lambda m: f"call {t}, rank {i}: {m}")
    # the errors to float tolerance at the data's scale: a piece of padding alone holds z = const,
    # whose error z - ||z||/sqrt(c) is 0 or an ulp of z depending on how the norm is rounded
    scale = max(o.abs().max().item() for o in ranks[0]["outputs"])
    for i in range(n):
        assert ranks[i]["e_w"].numel() == D // L and ranks[i]["e_s"].numel() == D // n
        for got, want in ((ranks[i]["e_w"], sim.worker_error(i)), (ranks[i]["e_s"], sim.server_error(i))):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)
    if N > 1:  # the errors really evolved (on every rank whose chunk holds data, not padding alone)
        every = all if d > (L - 1) * (D // L) else any
        assert every(r["e_w"].abs().sum() > 0 for r in ranks) and any(r["e_s"].abs().sum() > 0 for r in ranks)
    else:      # one node: no compression, the exact node average, no error
        assert all(r["e_w"].abs().sum() == 0 and r["e_s"].abs().sum() == 0 for r in ranks)


@pytest.mark.parametrize("n,N,L", CASES)
def test_outputs_bit_identical_on_every_rank(n, N, L):
    res = [r[(N, L)] for r in results(n)]
    for d in SIZES:
        for t, out in enumerate(res[0][("oracle", d)]["outputs"]):
            for r in range(1, n):
                assert _bits(out).tolist() == _bits(res[r][("oracle", d)]["outputs"][t]).tolist(), \
                    f"d={d} call {t}: rank {r} differs from rank 0"
    assert all(torch.equal(_bits(res[0]["bf16"]), _bits(r["bf16"])) for r in res)
    for k in range(len(MEAN_SHAPES)):
        assert all(torch.equal(res[0]["mean"][k]["output"], r["mean"][k]["output"]) for r in res)


@pytest.mark.parametrize("n,N,L", CASES)
def test_each_piece_is_one_scale_times_signs(n, N, L):
    """Across nodes, each of the n pieces of D/n elements is served by one rank: one scale."""
    if N == 1:
        pytest.skip("one node: no 1-bit stage")
    out = _gathered(n, N, L, ("oracle", 1001))[0]["outputs"][-1]
    for piece in out.view(n, -1):
        assert piece.abs().unique().numel() == 1 and piece.abs()[0] > 0
    bf16 = _gathered(n, N, L, "bf16")[0]
    assert bf16.dtype == torch.bfloat16 and all(p.abs().unique().numel() == 1 for p in bf16.view(n, -1))


def test_error_feedback_bookkeeping_2x2():
    """sum_t out_t + W + S = sum_t mean_i b_i,t: what the errors hold is exactly what was not yet
    sent. W: over chunk r, the mean over nodes of the worker errors of local rank r; S: rank
    (k, r)'s server error at piece r N + k. This is the map a reshard of the errors needs."""
    n, N, L = 4, 2, 2
    ranks = _gathered(n, N, L, ("oracle", 1001))
    D = padded_size(1001, n)
    c, piece = D // L, D // n
    target = sum(torch.stack([r["inputs"][t] for r in ranks]).double().mean(0) for t in range(CALLS))
    sent = torch.stack(ranks[0]["outputs"]).double().sum(0)
    W, S = torch.zeros(D, dtype=torch.float64), torch.zeros(D, dtype=torch.float64)
    for k in range(N):
        for r in range(L):
            W[r * c:(r + 1) * c] += ranks[k * L + r]["e_w"].double() / N
            S[(r * N + k) * piece:(r * N + k + 1) * piece] = ranks[k * L + r]["e_s"].double()
    torch.testing.assert_close(sent + W + S, target, rtol=0, atol=1e-4 * target.abs().max().item())


@pytest.mark.parametrize("n,N,L", CASES)
def test_bytes_per_collective(n, N, L):
    D, c = BYTES_D, BYTES_D // L
    for r in results(n):
        by_op = r[(N, L)]["bytes"]["hier"]["bytes_by_op"]
        expected = {}
        if L > 1:
            expected["intra_reduce_scatter"] = (L - 1) * c * 4   # fp32 chunks to the L-1 others
            expected["intra_all_gather"] = (L - 1) * c * 4
        if N > 1:
            message = c // (8 * N) + 4                          # D/(8n) sign bytes and a scale
            expected["all_to_all"] = expected["all_gather"] = (N - 1) * message
        assert by_op == expected
        assert r[(N, L)]["bytes"]["flat"]["bytes_by_op"] == {"all_to_all": (n - 1) * (D // (8 * n) + 4),
                                                            "all_gather": (n - 1) * (D // (8 * n) + 4)}


INTER_OPS = ("all_to_all", "all_gather")


@pytest.mark.parametrize("n,N,L", [(4, 2, 2), (2, 2, 1)])
def test_inter_node_bytes_per_node_are_L_times_fewer(n, N, L):
    """Per node, the sum over its ranks of what they send across nodes. The flat collective sends
    each of its messages to the n-1 other ranks alike, n-L of them on other nodes; the
    hierarchical one sends across nodes only on ``inter``."""
    res = results(n)
    for k in range(N):
        node = [res[k * L + i][(N, L)]["bytes"] for i in range(L)]
        hier_inter = sum(b["hier"]["bytes_by_op"][op] for b in node for op in INTER_OPS)
        flat_total = sum(b["flat"]["bytes_sent"] for b in node)
        flat_off_node = flat_total * (n - L) // (n - 1)
        assert flat_total * (n - L) % (n - 1) == 0
        assert hier_inter * L == flat_off_node
        if (N, L) == (2, 2):  # the figures docs/hierarchy.md quotes, for D = 65536
            assert (flat_total, flat_off_node, hier_inter) == (24624, 16416, 8208)


@pytest.mark.parametrize("n,N,L", CASES)
def test_averaging_equals_the_mean(n, N, L):
    res = [r[(N, L)]["mean"] for r in results(n)]
    for k, shape in enumerate(MEAN_SHAPES):
        mean = torch.stack([r[k]["input"] for r in res]).double().mean(0)
        for r in res:
            assert r[k]["output"].shape == shape
            torch.testing.assert_close(r[k]["output"].double(), mean, rtol=1e-6, atol=1e-6)
        ops = set(res[0][k]["stats"]["bytes_by_op"])
        assert ops == ({"intra_reduce_scatter", "intra_all_gather"} if L > 1 else set()) | \
            ({"all_reduce"} if N > 1 else set())


@pytest.mark.parametrize("n,N,L", CASES)
def test_node_groups_fields(n, N, L):
    for rank, r in enumerate(results(n)):
        res = r[(N, L)]
        assert res["fields"] == (N, L, n, rank // L, rank % L) and res["world_size_of"] == n
        assert f"nodes={N}, local_size={L}" in res["repr"]


def test_one_node_sends_nothing_across_nodes_and_one_rank_per_node_is_the_flat_collective():
    for r in results(4):
        one_node = r[(1, 4)][("oracle", 1001)]["stats"][0]["bytes_by_op"]
        assert set(one_node) == {"intra_reduce_scatter", "intra_all_gather"}
        one_per_node = r[(4, 1)][("oracle", 1001)]["stats"][0]["bytes_by_op"]
        assert set(one_per_node) == {"all_to_all", "all_gather"}


EXPECTED_BAD = {
    "local_size 3": ["local_size 3", "does not divide the world size 4"],
    "local_size 0": ["must be >= 1", "got 0"],
    "disagree": ["disagree", "rank 0: 1", "rank 1: 2", "rank 2: 2", "rank 3: 2"],
    "env unset": ["LOCAL_WORLD_SIZE", "unset"],
    "flat-sized worker_error": ["worker_error", "D/L = 512", "error_sizes"],
    "D not a multiple of 8n": ["multiple of 32"],
}


def test_bad_topologies_and_sizes_raise_value_errors_on_every_rank():
    for r in results(4):
        for case, words in EXPECTED_BAD.items():
            raised = r["bad"][case]
            assert raised is not None and raised[0] == "ValueError", f"{case}: {raised}"
            for w in words:
                assert w in raised[1], f"{case}: {w!r} not in {raised[1]!r}"
        assert r["from env"] == (2, 2)
        assert r["error_sizes"]["flat"] == (1024, 256) and r["error_sizes"]["hier"] == (512, 256)
        assert r["error_sizes"]["bad"][0] == "ValueError"


def test_nonfinite_input_raises_on_every_rank_and_the_groups_still_work():
    res = results(4)
    for r in res:
        assert r["nonfinite"] is not None and r["nonfinite"][0] == "FloatingPointError", r["nonfinite"]
        assert "local rank(s) [0]" in r["nonfinite"][1]
    outs = [r["after nonfinite"] for r in res]
    assert all(torch.isfinite(o).all() and torch.equal(o, outs[0]) for o in outs)
    assert outs[0].mean().item() == pytest.approx(1.5, rel=0.1)


def test_node_groups_needs_an_initialised_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        node_groups(2)
    assert issubclass(NodeGroups, object) and error_sizes(64) == (64, 64)
