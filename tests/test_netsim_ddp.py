"""Plain usage against DDP + register_ddp as the emulated hosts' worker runs them (``worker.ddp_steps``):
real gloo ranks on loopback, no root needed."""
import pytest

TINY = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}
WARM, COMP = 2, 3


@pytest.fixture(scope="module")
def per_rank():
    from rank_pool import run_ranks
    from benchmarks.netsim.worker import ddp_steps

    spec = {"model": TINY, "batch": 2, "optimizers": ["onebitlamb", "lamb"], "warmup_steps": WARM,
            "compression_steps": COMP, "skip_steps": 1}
    return run_ranks(ddp_steps, 2, (spec,), timeout_s=120)


def test_ddp_averages_the_warmup_in_the_backward_and_sends_nothing_after_the_freeze(per_rank):
    from onebitlamb.train.model import ModelConfig, build_model

    d = sum(p.numel() for p in build_model(ModelConfig(**TINY), 0).parameters())
    D = -(-d // 16) * 16  # padded to a multiple of 8 n for n = 2
    for rank in per_rank:
        assert rank["params"] == d and rank["barrier_bytes"] == 0
        ob = rank["steps"]["onebitlamb"]
        plain_w, ddp_w = ob["plain"]["warmup"], ob["ddp"]["warmup"]
        plain_c, ddp_c = ob["plain"]["compression"], ob["ddp"]["compression"]
        assert len(plain_w["step_times"]) == len(ddp_w["step_times"]) == WARM
        assert len(plain_c["step_times"]) == len(ddp_c["step_times"]) == COMP
        # warm-up: the same ring all-reduce of 4d bytes (2 (n-1)/n * 4d = 4d for n = 2), sent by
        # the optimizer in step() in plain usage, by DDP's buckets during the backward with DDP
        assert plain_w["backward_bytes"] == [0] * WARM and plain_w["opt_step_bytes"] == [4 * d] * WARM
        assert ddp_w["backward_bytes"] == [4 * d] * WARM and ddp_w["opt_step_bytes"] == [0] * WARM
        assert all(b >= 1 for b in ddp_w["buckets"]) and plain_w["buckets"] == [0] * WARM
        # compression: DDP sends nothing; the optimizer's 1-bit exchange (D/8 sign bytes, two
        # scales, the 4-byte finite flag) is the only one, the same in both usages
        assert ddp_c["backward_bytes"] == plain_c["backward_bytes"] == [0] * COMP
        assert ddp_c["opt_step_bytes"] == plain_c["opt_step_bytes"] == [D // 8 + 8 + 4] * COMP
        # no interface on loopback: no wire bytes
        assert ddp_c["wire_bytes"] == [None] * COMP
        # LAMB never compresses: warm-up rounds only
        assert set(rank["steps"]["lamb"]["plain"]) == set(rank["steps"]["lamb"]["ddp"]) == {"warmup"}
