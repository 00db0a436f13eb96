"""``optimizer.stats()``: one dict with the same keys on all four optimizers, on 2 real gloo ranks,
whose values are those the older attributes give (comm_stats, last_step_bytes, skipped_steps,
last_step_skipped, stage, freeze_stats) and the steps actually taken."""
import torch

import onebitlamb
from rank_pool import run_ranks
from toy import grads_for, initial_params


def _stats(rank, world):
    out = {}
    for name, build in {
        "Lamb": lambda ps: onebitlamb.Lamb(ps, lr=0.01),
        "OneBitLamb": lambda ps: onebitlamb.OneBitLamb(ps, lr=0.01, freeze_step=3),
        "OneBitAdam": lambda ps: onebitlamb.OneBitAdam(ps, lr=0.01, freeze_step=3),
        "ZeroOneAdam": lambda ps: onebitlamb.ZeroOneAdam(ps, lr=0.01, var_freeze_step=3),
    }.items():
        params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
        opt = build(params)
        before = opt.stats()
        for t in range(1, 6):
            for p, g in zip(params, grads_for(params, rank, t)):
                p.grad = g
            if t == 4:  # a NaN on rank 1: the step is skipped on every rank
                params[0].grad[0, 0] = float("nan") if rank == 1 else params[0].grad[0, 0]
            opt.step()
        after = opt.stats()
        aliases = {"bytes_sent": opt.comm_stats.bytes_sent, "rounds": opt.comm_stats.calls,
                   "last_step_bytes": opt.last_step_bytes, "skipped_steps": opt.skipped_steps,
                   "last_step_skipped": opt.last_step_skipped, "stage": opt.stage,
                   "freeze": opt.freeze_stats() if hasattr(opt, "freeze_stats") else None}
        out[name] = (before, after, aliases)
    return out


def test_stats_has_the_same_keys_everywhere_and_the_values_of_the_older_names():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = run_ranks(_stats, 2, (), timeout_s=180)
    keys = None
    for rank in ranks:
        for name, (before, after, aliases) in rank.items():
            keys = keys or set(after)
            assert set(before) == set(after) == keys, name
            assert before["bytes_sent"] == 0 and before["step"] == 0 and before["freeze_step"] is None
            assert after["step"] == 4 and after["skipped_steps"] == 1, name  # 5 calls, one skipped
            assert all(after[k] == v for k, v in aliases.items()), name
            assert after["bytes_sent"] > 0 and after["rounds"] > 0
            assert after["bytes_sent_in_shard_group"] == 0  # no sharded parameters
        assert rank["Lamb"][1]["freeze_step"] is None and rank["Lamb"][1]["freeze"] is None
        assert rank["OneBitLamb"][1]["freeze_step"] == 3 and rank["OneBitLamb"][1]["stage"] == "compression"
