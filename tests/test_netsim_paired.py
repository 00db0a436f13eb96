"""The interleaved loopback comparison (LAMB vs the 1-bit optimizers in one launch): real gloo
ranks on loopback, no root needed."""
import statistics

import pytest

from benchmarks import network
from benchmarks.emulated import Settings

TINY = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}


@pytest.fixture(scope="module")
def paired():
    s = Settings(hosts=2, model=TINY, batch=2, paired_rounds=4, timeout_s=120)
    return network.run_paired(s)


def test_every_round_times_each_optimizer_in_its_stage(paired):
    from onebitlamb.train.model import ModelConfig, build_model

    d = sum(p.numel() for p in build_model(ModelConfig(**TINY), 0).parameters())
    D = -(-d // 16) * 16  # padded to a multiple of 8 n for n = 2
    for rank in paired:
        for name in ("lamb", "onebitlamb", "onebitadam"):
            assert len(rank["step_times"][name]) == 4
            assert all(0 < o < t for o, t in zip(rank["opt_step_times"][name], rank["step_times"][name]))
        # LAMB sends its fp32 gradients (ring all-reduce: 2 (n-1)/n * 4d); the 1-bit optimizers
        # were timed in the compression stage: D/8 sign bytes and two scales, and the 4-byte
        # all-reduce that agrees the gradients are finite
        assert rank["step_bytes"]["lamb"] == 4 * d
        assert rank["step_bytes"]["onebitlamb"] == rank["step_bytes"]["onebitadam"] == D // 8 + 8 + 4


def test_summary_is_the_median_of_per_round_ratios_of_the_slowest_rank(paired):
    rows = {r["optimizer"]: r for r in network.summarise_paired(paired)}
    assert set(rows) == {"onebitlamb", "onebitadam"}
    slowest = {name: [max(a, b) for a, b in zip(paired[0]["step_times"][name], paired[1]["step_times"][name])]
               for name in ("lamb", "onebitlamb")}
    ratios = [a / b for a, b in zip(slowest["lamb"], slowest["onebitlamb"])]
    row = rows["onebitlamb"]
    assert row["speedup_median"] == pytest.approx(statistics.median(ratios))
    assert row["speedup_q1"] <= row["speedup_median"] <= row["speedup_q3"]
    assert row["faster_share"] == sum(r > 1 for r in ratios) / 4
    lines = network.check_targets({"summary": [], "paired": list(rows.values())})
    assert any("1-bit LAMB compression step not slower than LAMB on loopback" in line for line in lines)
