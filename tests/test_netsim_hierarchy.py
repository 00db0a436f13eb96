"""The flat group against ``node_groups()`` on nodes of several ranks as the emulated hosts' worker
runs them (``worker.hierarchy_steps``): 4 real gloo ranks on loopback as 2 nodes x 2 (no root
needed), and the cost model's node topology by hand."""
import pytest

from onebitlamb.comm import padded_size
from onebitlamb.comm.stats import all_to_all_bytes, allreduce_bytes
from benchmarks.netsim.topology import Network
from onebitlamb.comm import costmodel

TINY = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}
WARM, COMP, N, L = 2, 3, 2, 2


@pytest.fixture(scope="module")
def per_rank():
    from rank_pool import run_ranks
    from benchmarks.netsim.worker import hierarchy_steps

    spec = {"model": TINY, "batch": 2, "optimizers": ["onebitlamb"], "warmup_steps": WARM,
            "compression_steps": COMP, "skip_steps": 1, "local_size": L, "latency_calls": 3}
    return run_ranks(hierarchy_steps, N * L, (spec,), timeout_s=120)


def test_node_groups_halve_the_bytes_a_node_sends_to_the_other_node(per_rank):
    n = N * L
    d = per_rank[0]["params"]
    D = padded_size(d, n)
    m = D // (8 * n) + 4  # one piece's sign bytes and its scale, the same in both layouts
    flag = allreduce_bytes(4, n)  # the finite flag, over the world in both
    assert [(r["node"], r["local_rank"]) for r in per_rank] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in per_rank:
        ob = r["steps"]["onebitlamb"]
        assert all(len(ob[mode]["compression"]["step_times"]) == COMP for mode in ("flat", "hier", "solo"))
        # flat: n - 1 messages per collective, L (N-1) = 2 of the 3 to the other node
        flat = ob["flat"]["compression"]
        assert flat["bytes"] == [2 * (n - 1) * m + flag] * COMP and flat["intra_bytes"] == [0] * COMP
        flat_cross = 2 * L * (N - 1) * m
        # hierarchical: fp32 node stages, then N - 1 = 1 message per collective across nodes
        hier = ob["hier"]["compression"]
        node_stages = 2 * all_to_all_bytes(4 * D, L)
        assert hier["intra_bytes"] == [node_stages] * COMP
        hier_cross = [b - i - flag for b, i in zip(hier["bytes"], hier["intra_bytes"])]
        assert hier_cross == [2 * (N - 1) * m] * COMP
        assert flat_cross == L * hier_cross[0], "a rank sends L times fewer bytes to the other node"
        # warm-up: ring over the world (one rank's 2 (n-1)/n 4d per node) against reduce-scatter,
        # a ring over the 2 nodes of a chunk of d/L elements, all-gather
        assert ob["flat"]["warmup"]["bytes"] == [allreduce_bytes(4 * d, n)] * WARM
        c = -(-d // L)
        assert [b - i for b, i in zip(ob["hier"]["warmup"]["bytes"], ob["hier"]["warmup"]["intra_bytes"])] == \
            [allreduce_bytes(4 * c, N)] * WARM
        # alone in a one-rank group: no collective
        assert ob["solo"]["compression"]["bytes"] == [0] * COMP and ob["solo"]["warmup"]["bytes"] == [0] * WARM
        assert r["probe"]["alpha_inter_s"] > 0 and r["probe"]["intra_all_to_all_bytes"] == (L - 1) * D // L * 4
    # the cost model's per-node bytes are the accounted ones
    flat_c = costmodel.node_onebit_collectives(d, N, L, hierarchical=False)
    hier_c = costmodel.node_onebit_collectives(d, N, L, hierarchical=True)
    # flat: the all-to-all's L (N-1) messages a rank, and the ring all-gather's one edge leaving the node
    assert [x.node_bytes for x in flat_c[:2]] == [L * L * (N - 1) * m, (n - 1) * m]
    assert sum(x.node_bytes for x in hier_c if not x.intra) - L * flag == L * hier_cross[0]


def test_cost_model_on_nodes_by_hand():
    # d = 1000 on 2 nodes x 2: D = 1024, messages of 1024/32 + 4 = 36 bytes
    flat = costmodel.node_onebit_collectives(1000, 2, 2, hierarchical=False)
    # the all-to-all sends 2 of each rank's 3 messages to the other node (4 a node); gloo's all-gather
    # is a ring, whose one edge leaving the node carries 3
    assert [(c.node_bytes, c.rank_bytes, c.intra) for c in flat[:2]] == [(144, 108, False), (108, 108, False)]
    hier = costmodel.node_onebit_collectives(1000, 2, 2, hierarchical=True)
    # fp32 node stages of (L-1)/L * 4D = 2048 bytes a rank; across nodes 1 message a rank, 2 a node
    assert [(c.node_bytes, c.rank_bytes, c.intra) for c in hier[:4]] == [
        (0, 2048, True), (72, 36, False), (72, 36, False), (0, 2048, True)]
    # one rank per node: exactly the one-rank-per-host model
    assert [c.rank_bytes for c in costmodel.node_onebit_collectives(1000, 4, 1, True)[:2]] == \
        costmodel.onebit_collectives(1000, 4)
    # warm-up: flat ring 2 (3/4) 4000 = 6000 per rank, one rank's worth per node; hierarchical:
    # a ring over 2 nodes of 500 elements (2000 bytes a rank), 4000 per node
    assert [(c.node_bytes, c.rank_bytes) for c in costmodel.node_warmup_collectives(1000, 2, 2, False)] == [(6000, 6000)]
    assert [(c.node_bytes, c.rank_bytes) for c in costmodel.node_warmup_collectives(1000, 2, 2, True)] == [
        (0, 2000), (4000, 2000), (0, 2000)]
    # 8 Mbit/s, no overhead: 1 us a byte across nodes; host 1 GB/s; alpha 1 ms, 0.1 ms inside
    link = costmodel.Link(8e6, alpha_s=0.001, overhead=1.0, host_Bps=1e9)
    cs = [costmodel.NodeCollective(1000, 500), costmodel.NodeCollective(0, 4000, intra=True)]
    assert costmodel.predict_node_step(0.1, cs, link, alpha_intra_s=0.0001) == pytest.approx(
        0.1 + (0.001 + 1000e-6 + 500e-9) + (0.0001 + 4000e-9))


def test_network_places_consecutive_ranks_on_one_host():
    net = Network(2, 50e6, ranks_per_host=2)  # not entered: nothing created
    assert net.world_size == 4 and [net.host_of(r) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError):
        net.host_of(4)
    with pytest.raises(ValueError, match="ranks_per_host"):
        Network(2, ranks_per_host=0)
