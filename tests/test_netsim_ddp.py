"""Plain usage against DDP + register_ddp (``worker.ddp_steps``, ``benchmarks/ddp.py``): real gloo
ranks on loopback, no root needed; the end-to-end run on emulated hosts is marked ``netns``."""
import pytest

from benchmarks import ddp
from netns import needs_netns

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


def test_summary_rows_compare_each_steps_slowest_rank(per_rank):
    rows = ddp.summarise_ddp_rate(per_rank, 50e6)
    assert [(r["optimizer"], r["stage"]) for r in rows] == [
        ("onebitlamb", "warmup"), ("onebitlamb", "compression"), ("lamb", "warmup")]
    comp = rows[1]
    plain = [max(a, b) for a, b in zip(*(r["steps"]["onebitlamb"]["plain"]["compression"]["step_times"]
                                         for r in per_rank))]
    wrapped = [max(a, b) for a, b in zip(*(r["steps"]["onebitlamb"]["ddp"]["compression"]["step_times"]
                                           for r in per_rank))]
    ratios = sorted(a / b for a, b in zip(plain, wrapped))
    assert comp["ratio_median"] == pytest.approx(ratios[len(ratios) // 2])
    assert comp["ratio_q1"] <= comp["ratio_median"] <= comp["ratio_q3"]
    assert comp["ddp_backward_bytes"] == 0 and comp["ddp_step_bytes"] == comp["plain_step_bytes"] > 0
    assert comp["plain_wire_bytes"] is None
    table = ddp.format_ddp_table({"rows": rows})
    assert len(table.splitlines()) == 2 + len(rows) and "| 50 Mbit/s | 1-bit LAMB | compression |" in table


@pytest.mark.netns
@needs_netns
def test_benchmark_writes_its_section_on_emulated_hosts(tmp_path):
    results = tmp_path / "BENCHMARKS.md"
    argv = ["--hosts", "2", "--rates", "50M", "--hidden", "32", "--layers", "1", "--batch", "2",
            "--warmup-steps", "2", "--compression-steps", "2", "--results", str(results)]
    assert ddp.main(argv) == 0
    text = results.read_text()
    assert "<!-- begin ddp -->" in text and "--warmup-steps 2" in text
    row = next(line for line in text.splitlines() if line.startswith("| 50 Mbit/s | 1-bit LAMB | compression"))
    wire_plain, wire_ddp = (float(c) for c in row.strip("| ").split(" | ")[-2:])
    assert wire_plain > 0 and wire_ddp > 0
