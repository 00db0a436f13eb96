"""The serial step against ``overlap_with_backward`` as the emulated hosts' worker runs them
(``worker.hierarchy_steps``' overlap modes), on 2 real gloo ranks on loopback (no root needed)."""

TINY = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}


def _two_ranks_on_loopback():
    from rank_pool import run_ranks
    from benchmarks.netsim.worker import hierarchy_steps

    spec = {"model": TINY, "batch": 2, "optimizers": ["onebitlamb"], "warmup_steps": 2, "compression_steps": 2,
            "skip_steps": 1, "local_size": 1, "latency_calls": 2, "bucket_cap_mb": 0.01,
            "modes": ["flat", "overlap", "solo", "hier-overlap"]}
    return run_ranks(hierarchy_steps, 2, (spec,), timeout_s=120)


def test_worker_starts_the_overlapped_buckets_in_the_backward():
    per_rank = _two_ranks_on_loopback()
    for rank in per_rank:
        ob = rank["steps"]["onebitlamb"]
        assert set(ob) == {"flat", "overlap", "solo", "hier-overlap"}
        for stage, steps in (("warmup", 2), ("compression", 2)):
            for mode in ("overlap", "hier-overlap"):
                rec = ob[mode][stage]
                # 0.01 MiB buckets: several, every one completed by the backward (all parameters
                # get a gradient), so step() starts none
                assert rec["buckets"][0] > 1 and rec["started_in_backward"] == rec["buckets"]
                assert len(rec["step_times"]) == steps
            for mode in ("flat", "solo"):
                assert ob[mode][stage]["started_in_backward"] == [0] * steps
                assert ob[mode][stage]["buckets"] == [1] * steps
        assert ob["solo"]["compression"]["bytes"] == [0, 0] and min(ob["overlap"]["compression"]["bytes"]) > 0
