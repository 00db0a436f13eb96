"""The optimizers over a hierarchical group (onebitlamb.comm.node_groups), 4 real gloo ranks as 2
nodes x 2: every rank alike, fewer bytes across nodes than the flat group, exact resume, and a
state refused where its errors do not fit."""
from __future__ import annotations

import copy

import torch

import onebitlamb
from onebitlamb.comm import node_groups
from onebitlamb.comm.hierarchy import INTRA_OPS
from rank_pool import run_ranks
from toy import classifier, train

STEPS, FREEZE, SAVE_AT = 10, 3, 6


def _cross_node_bytes(opt):
    return opt.comm_stats.bytes_sent - sum(opt.comm_stats.bytes_by_op.get(op, 0) for op in INTRA_OPS)


def _distance(a, b):
    return float(torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b))))


def _run(rank, n):
    groups = node_groups(2)
    out = {}
    for name, group in (("flat", None), ("nodes", groups)):
        model = classifier(hidden=32)
        opt = onebitlamb.OneBitLamb(model.parameters(), lr=0.02, freeze_step=FREEZE, process_group=group)
        train(model, opt, rank, range(SAVE_AT))
        saved, at_save = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
        before = _cross_node_bytes(opt)
        train(model, opt, rank, range(SAVE_AT, STEPS))
        out[name] = {"params": [p.detach().clone() for p in model.parameters()],
                     "compression_bytes": _cross_node_bytes(opt) - before, "saved": saved}
        with torch.no_grad():
            for p, s in zip(model.parameters(), at_save):
                p.copy_(s)
        resumed = onebitlamb.OneBitLamb(model.parameters(), lr=0.02, freeze_step=FREEZE, process_group=group)
        resumed.load_state_dict(saved)
        train(model, resumed, rank, range(SAVE_AT, STEPS))
        out[name]["resumed"] = [p.detach().clone() for p in model.parameters()]
    model = classifier(hidden=32)
    train(model, onebitlamb.Lamb(model.parameters(), lr=0.02), rank, range(STEPS))
    out["lamb"] = [p.detach().clone() for p in model.parameters()]
    wrong = onebitlamb.OneBitLamb(classifier(hidden=32).parameters(), lr=0.02, freeze_step=FREEZE)  # the flat group
    try:  # refused at the load, before anything changes
        wrong.load_state_dict(out["nodes"]["saved"])
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_a_hierarchical_group_trains_alike_sends_less_across_nodes_and_resumes_exactly():
    ranks = run_ranks(_run, 4, (), timeout_s=150, collective_timeout_s=60)
    for out in ranks:
        for name in ("flat", "nodes"):
            assert all(torch.equal(a, b) for a, b in zip(out[name]["params"], ranks[0][name]["params"]))
            assert all(torch.equal(a, b) for a, b in zip(out[name]["params"], out[name]["resumed"]))
        # another compression, so other numbers, but as near to uncompressed LAMB as the flat one
        flat_off, nodes_off = (_distance(out[name]["params"], out["lamb"]) for name in ("flat", "nodes"))
        assert 0 < nodes_off < 1.5 * flat_off, (nodes_off, flat_off)
        assert "saved with 2 ranks per node and is loaded with 1" in out["refused"]
    for node in ((0, 1), (2, 3)):  # what a node's two ranks send across nodes after the freeze
        flat = sum(ranks[r]["flat"]["compression_bytes"] for r in node)
        hierarchical = sum(ranks[r]["nodes"]["compression_bytes"] for r in node)
        assert hierarchical > 0 and flat >= 2 * hierarchical, (flat, hierarchical)


def _zero_one_run(rank, n):
    """0/1 Adam over 2 nodes x 2: variance steps 1 and 2, a 1-bit step 3, then syncs at 4-6, 8 and
    10 and local steps 7 and 9; saved after the local step 7, each rank with its own parameters."""
    group = node_groups(2)

    def make(model):
        return onebitlamb.ZeroOneAdam(model.parameters(), lr=0.02, var_freeze_step=3, var_update_scaler=1,
                                      local_step_scaler=2, local_step_clipper=2, process_group=group)

    model = classifier(hidden=32)
    opt = make(model)
    train(model, opt, rank, range(7))
    saved, at_save = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
    train(model, opt, rank, range(7, STEPS))
    full = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, s in zip(model.parameters(), at_save):
            p.copy_(s)
    resumed = make(model)
    resumed.load_state_dict(saved)
    train(model, resumed, rank, range(7, STEPS))
    return full, [p.detach().clone() for p in model.parameters()], _cross_node_bytes(opt) > 0


def test_zero_one_adam_over_a_hierarchical_group_keeps_the_ranks_alike_and_resumes_exactly():
    ranks = run_ranks(_zero_one_run, 4, (), timeout_s=150, collective_timeout_s=60)
    for full, resumed, crossed in ranks:
        assert crossed and all(bool(torch.isfinite(a).all()) for a in full)
        assert all(torch.equal(a, b) for a, b in zip(full, ranks[0][0]))  # step 10 was a sync
        assert all(torch.equal(a, b) for a, b in zip(full, resumed))
