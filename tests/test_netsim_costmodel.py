"""The alpha-beta cost model and the rate/bucket arithmetic: hand-computed cases, no root needed."""
import math

import pytest
import torch

from benchmarks.netsim.topology import tbf_params
from onebitlamb.comm import costmodel
from onebitlamb.comm.costmodel import parse_rate, rate_label
from onebitlamb.comm.quantized import quantized_wire_bytes


def test_collective_bytes_two_and_four_ranks():
    # d = 1000 fp32 elements, n = 2: ring all-reduce sends 2 * (1/2) * 4000 = 4000 bytes
    assert costmodel.lamb_collectives(1000, 2) == [4000]
    # n = 4: 2 * 3/4 * 4000 = 6000
    assert costmodel.lamb_collectives(1000, 4) == [6000]
    # 1-bit, n = 2: D = 1008 (multiple of 16); a message is D/16 = 63 sign bytes + a 4-byte scale;
    # the all-to-all sends 1 of its 2 messages (67), the all-gather its one message to 1 peer (67)
    assert costmodel.onebit_collectives(1000, 2) == [67, 67]
    # n = 4: D = 1024; messages of 32 + 4 = 36 bytes, to 3 peers in each collective
    assert costmodel.onebit_collectives(1000, 4) == [108, 108]
    assert costmodel.lamb_collectives(1000, 1) == [] and costmodel.onebit_collectives(1000, 1) == []
    # the finite flag: one float32 in a ring all-reduce, 2 (n-1)/n * 4 bytes
    assert costmodel.finite_flag_collectives(2) == [4] and costmodel.finite_flag_collectives(4) == [6]
    assert costmodel.finite_flag_collectives(1) == []


def test_predict_step_hand_computed():
    # 10 Mbit/s, no header overhead: 1.25e6 bytes/s; 1,250,000 bytes take 1 s; alpha 1 ms
    link = costmodel.Link(10e6, alpha_s=0.001, overhead=1.0)
    assert costmodel.predict_step(0.1, [1_250_000], link) == pytest.approx(0.1 + 0.001 + 1.0)
    # two collectives pay two alphas; the codec is added once
    t = costmodel.predict_step(0.1, [125_004, 125_004], link, codec_s=0.01)
    assert t == pytest.approx(0.1 + 0.01 + 2 * 0.001 + (250_008 / 1.25e6))
    # header overhead scales the byte term only
    link2 = costmodel.Link(10e6, alpha_s=0.0, overhead=1.05)
    assert costmodel.predict_step(0.0, [1_250_000], link2) == pytest.approx(1.05)


def test_host_rate_adds_in_series_and_unshaped_link():
    # unshaped: only the host's own byte rate limits; 1e9 bytes/s -> 1e6 bytes in 1 ms
    link = costmodel.Link(None, alpha_s=0.0, host_Bps=1e9)
    assert link.collective_s(1_000_000) == pytest.approx(0.001)
    # shaped and host rate in series: 8 Mbit/s (1 us/byte) + 1 GB/s (1 ns/byte)
    link = costmodel.Link(8e6, alpha_s=0.0, overhead=1.0, host_Bps=1e9)
    assert link.seconds_per_byte() == pytest.approx(1e-6 + 1e-9)
    assert costmodel.Link(None, alpha_s=0.002).collective_s(10**9) == pytest.approx(0.002)


def test_wire_overhead_is_frame_over_payload():
    # MTU 1500: MSS 1448 (IP 20, TCP 20, timestamps 12); a frame adds 66 bytes (Ethernet 14)
    assert costmodel.MSS == 1448
    assert costmodel.WIRE_OVERHEAD == pytest.approx(1514 / 1448)


def test_end_to_end_speedup_and_volume():
    # LAMB 1 s/step; 1-bit: warm-up 1 s, compression 0.1 s; 20% warm-up: 0.2 + 0.08 = 0.28 s
    assert costmodel.end_to_end_speedup(1.0, 1.0, 0.1, 0.2) == pytest.approx(1 / 0.28)
    assert costmodel.end_to_end_speedup(1.0, 1.0, 0.1, 0.0) == pytest.approx(10.0)
    assert costmodel.end_to_end_speedup(1.0, 1.0, 0.1, 1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        costmodel.end_to_end_speedup(1.0, 1.0, 0.1, 1.5)
    # docs/algorithm.md: 1 / (w + (1-w)/32); w = 0.2 -> 1 / 0.225 = 4.444
    assert costmodel.volume_reduction(0.2) == pytest.approx(1 / 0.225)
    assert costmodel.comm_fraction(1.0, 0.1) == pytest.approx(0.9)
    assert costmodel.comm_fraction(1.0, 1.2) == 0.0


def test_bucket_is_sized_to_the_rate():
    # 10 Mbit/s = 1.25 MB/s: 4 ms = 5000 bytes = one 250 Hz tick
    assert tbf_params(10e6) == {"burst": 5000, "limit": 256 * 1024}
    # 1 Gbit/s: 4 ms = 500 KB; queue 100 ms = 12.5 MB
    assert tbf_params(1e9) == {"burst": 500_000, "limit": 12_500_000}
    # never below two full frames, never below one timer tick
    assert tbf_params(1e6)["burst"] == 2 * 1514
    assert tbf_params(100e6, burst_ms=1.0)["burst"] == int(12.5e6 / 250)
    with pytest.raises(ValueError):
        tbf_params(0)


def test_rate_parsing():
    assert parse_rate("200mbit") == 200e6
    assert parse_rate("inf") is None and parse_rate("unlimited") is None
    assert rate_label(10e6) == "10 Mbit/s" and rate_label(1e9) == "1 Gbit/s" and rate_label(None) == "unshaped"
    assert rate_label(100) == "100 bit/s" and rate_label(64e3) == "64 kbit/s"
    assert not math.isnan(costmodel.WIRE_OVERHEAD)


@pytest.mark.parametrize("text, bits_per_second", [
    ("100bit/s", 100), ("64kbit/s", 64e3), ("10Mbit/s", 10e6), ("1Gbit/s", 1e9), ("10 Mbit/s", 10e6),
    ("10Mbit", 10e6), ("200mbit", 200e6), ("10Mbps", 10e6), ("1Gbps", 1e9), ("10Mb/s", 10e6), ("1.5e2Mbit/s", 150e6),
    ("100B/s", 800), ("500kB/s", 4e6), ("500KB/s", 4e6), ("10MB/s", 80e6), ("1GB/s", 8e9), ("10MBps", 80e6)])
def test_rates_are_read_in_bits_or_bytes_by_their_unit(text, bits_per_second):
    assert parse_rate(text) == pytest.approx(bits_per_second, rel=1e-12)


@pytest.mark.parametrize("text, why", [
    ("100", "no unit"), ("10M", "no unit"), ("1.5e8", "no unit"), ("10Mbytes", "unknown unit 'bytes'"),
    ("10MBPS", "unknown unit"), ("10Gb", "unknown unit 'b'"), ("fast", "not a number"), ("0Mbit/s", "must be > 0")])
def test_an_ambiguous_or_unknown_rate_is_refused_naming_it_and_the_forms(text, why):
    with pytest.raises(ValueError, match=why) as caught:
        parse_rate(text)
    assert repr(text) in str(caught.value)
    assert why == "must be > 0" or all(form in str(caught.value) for form in ("10Mbit/s", "10Mbps", "10MB/s"))


def test_estimate_refuses_a_rate_without_its_unit(capsys):
    from onebitlamb.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["estimate", "--params", "1M", "--ranks", "2", "--compute-ms", "10", "--rates", "1Gbit/s,100"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --rates: cannot read a rate from '100' (no unit" in err and "10MB/s" in err


def test_synchronous_compute_is_the_median_of_the_slowest_rank():
    from benchmarks.network import synchronous_compute_s

    # per step the slower rank: 0.3, 0.2, 0.4 -> median 0.3 (each rank's own median is 0.2)
    assert synchronous_compute_s([[0.1, 0.2, 0.4], [0.3, 0.2, 0.1]]) == pytest.approx(0.3)
    assert synchronous_compute_s([[0.5]]) == pytest.approx(0.5)


def _estimate_rows(argv, capsys):
    from onebitlamb.cli import main

    assert main(["estimate", *argv]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "Mbit/s" in line]
    return {row[1]: row for row in rows}


def test_estimate_command_gives_the_alpha_beta_steps_by_hand(capsys):
    # 2^20 parameters on 2 ranks at 10 Mbit/s, 100 ms compute, alpha 1 ms, frames 1514 B per 1448 B
    rows = _estimate_rows(["--params", "1048576", "--ranks", "2", "--rates", "10Mbit/s", "--compute-ms", "100",
                           "--alpha-ms", "1", "--warmup-dtype", "float32"], capsys)
    beta = 8 * (1514 / 1448) / 10e6
    lamb = 0.1 + 0.001 + 4 * 2**20 * beta  # one ring all-reduce of 4d bytes: 2 (n-1)/n * 4d
    m = 2**20 // 16 + 4  # one message: D/(8n) sign bytes and a float32 scale
    onebit = 0.1 + 3 * 0.001 + (m + m + 4) * beta  # all-to-all, all-gather, the 4-byte finite flag
    (row,) = rows.values()
    assert row[1] == "world group"
    assert float(row[2]) == pytest.approx(1e3 * lamb, abs=0.05)
    assert float(row[3]) == pytest.approx(1e3 * lamb, abs=0.05)  # the warm-up averages as LAMB does
    assert float(row[4]) == pytest.approx(1e3 * onebit, abs=0.05)
    assert float(row[5].rstrip("x")) == pytest.approx(lamb / onebit, abs=0.005)
    assert float(row[6].rstrip("x")) == pytest.approx(lamb / (0.3 * lamb + 0.7 * onebit), abs=0.005)


def test_estimates_default_warm_up_average_is_the_main_jobs(capsys):
    """Without --warmup-dtype each exchange is priced with what `onebitlamb pretrain` sends: int8 over
    the world group, float32 over node groups (--local-size), where the quantised average cannot run."""
    from onebitlamb.train import config

    assert costmodel.DEFAULT_WARMUP_DTYPE == config.DEFAULT_WARMUP_DTYPE["onebitlamb"]
    assert config.TrainConfig(out="x").warmup_dtype == costmodel.DEFAULT_WARMUP_DTYPE
    assert config.TrainConfig(out="x", local_size=2).warmup_dtype == "float32"
    argv = ["--params", "1M", "--ranks", "4", "--ranks-per-node", "2", "--rates", "100Mbit/s", "--compute-ms", "10"]
    default = _estimate_rows(argv, capsys)
    int8, float32 = (_estimate_rows([*argv, "--warmup-dtype", dtype], capsys) for dtype in ("int8", "float32"))
    assert set(default) == {"world group", "node_groups(2)"} and set(int8) == {"world group"}
    assert default["world group"] == int8["world group"] != float32["world group"]
    assert default["node_groups(2)"] == float32["node_groups(2)"]


def test_estimates_default_warm_up_is_autofreezes_floor_for_1bit_lamb():
    import onebitlamb

    opt = onebitlamb.OneBitLamb([torch.nn.Parameter(torch.zeros(4))], freeze_step=onebitlamb.AutoFreeze(total_steps=1000))
    assert opt.freeze_stats()["floor_step"] / 1000 == costmodel.WARMUP_FRACTION


def test_rates_are_taken_as_a_list_or_comma_separated(capsys):
    argv = ["--params", "1M", "--ranks", "2", "--compute-ms", "10"]
    from onebitlamb.cli import main

    tables = []
    for rates in (["10Mbit/s", "100Mbit/s"], ["10Mbit/s,100Mbit/s"]):
        assert main(["estimate", *argv, "--rates", *rates]) == 0
        tables.append([line for line in capsys.readouterr().out.splitlines() if "Mbit/s" in line])
    assert len(tables[0]) == 2 and tables[0] == tables[1]


def test_estimate_on_nodes_sends_fewer_bytes_across_them_over_node_groups():
    # 2 nodes x 2 ranks, d = 2^20: messages of m = D/32 + 4 bytes. Flat: the all-to-all sends
    # L^2 (N-1) m across a node's card, the ring all-gather (n-1) m; node_groups: L (N-1) m in each
    # of its two collectives; the finite flag's 6 bytes a rank from both of the node's ranks.
    m = 2**20 // 32 + 4
    flat = costmodel.estimate(2**20, 4, 1e9, 0.1, ranks_per_node=2)
    hier = costmodel.estimate(2**20, 4, 1e9, 0.1, ranks_per_node=2, node_groups=True)
    assert flat["compression_node_bytes"] == 4 * m + 3 * m + 12
    assert hier["compression_node_bytes"] == 2 * m + 2 * m + 12
    assert hier["compression_s"] < flat["compression_s"] < flat["lamb_s"]


def test_estimate_refuses_what_it_cannot_model(capsys):
    from onebitlamb.cli import main

    base = ["estimate", "--params", "1M", "--compute-ms", "10"]
    assert main([*base, "--ranks", "3", "--ranks-per-node", "2", "--rates", "1Gbit/s"]) == 2
    assert "ranks (3) must be >= 2 and a multiple of ranks_per_node (2)" in capsys.readouterr().err
    assert main([*base, "--ranks", "4", "--rates", "1Gbit/s", "--warmup-fraction", "1.5"]) == 2
    assert "warmup_fraction must be in [0, 1], got 1.5" in capsys.readouterr().err


def test_warmup_bytes_per_step_follow_the_warmup_dtype(capsys):
    # d = 2^20 on 4 ranks (one a node): D = 2^20, a chunk of c = D/4 = 2^18 elements. float32 and
    # bfloat16: one ring all-reduce, 2 (n-1)/n * b d bytes a rank. int8/int4/int2: the quantised
    # average, an all-to-all and an all-gather of n - 1 messages each, a message c elements at
    # bits/8 bytes plus a float32 step per 256, and the finite flag's 2 (n-1)/n * 4 = 6 bytes.
    d, n, c = 2**20, 4, 2**18
    expected = {"float32": 2 * 3 * 4 * d // 4, "bfloat16": 2 * 3 * 2 * d // 4}
    for bits in (8, 4, 2):
        m = c * bits // 8 + 4 * (c // 256)
        expected[f"int{bits}"] = 2 * (n - 1) * m + 6
    assert set(expected) == set(costmodel.WARMUP_DTYPES)
    link = costmodel.Link(1e9, alpha_s=0.001)
    for dtype, nbytes in expected.items():
        e = costmodel.estimate(d, n, 1e9, 0.1, alpha_s=0.001, warmup_dtype=dtype)
        assert e["warmup_node_bytes"] == nbytes, dtype
        assert sum(costmodel.warmup_collectives(d, n, dtype)) == nbytes, dtype
        calls = 1 if dtype in ("float32", "bfloat16") else 3
        assert e["warmup_s"] == pytest.approx(0.1 + calls * 0.001 + nbytes * link.seconds_per_byte()), dtype
        if dtype.startswith("int"):  # c is a whole number of blocks: what the collective counts, plus the flag
            assert nbytes == quantized_wire_bytes(d, n, dtype) + 6
    assert costmodel.warmup_collectives(d, n) == costmodel.lamb_collectives(d, n)  # float32: LAMB's all-reduce
    assert costmodel.warmup_collectives(d, 1, "int8") == []

    # the command: 2^20 parameters on 2 ranks at 10 Mbit/s, alpha 1 ms; int8 messages of
    # c = 2^19 elements, 2^19 + 4 * 2^11 bytes; the warm-up step pays three alphas
    from onebitlamb.cli import main

    argv = ["estimate", "--params", "1048576", "--ranks", "2", "--rates", "10Mbit/s", "--compute-ms", "100",
            "--alpha-ms", "1"]
    beta = 8 * (1514 / 1448) / 10e6
    m = 2**19 + 4 * 2**11
    assert main([*argv, "--warmup-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    (row,) = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| 10 Mbit/s")]
    assert "warm-up average in int8" in out
    assert float(row[3]) == pytest.approx(1e3 * (0.1 + 3 * 0.001 + (m + m + 4) * beta), abs=0.05)
    assert [float(x) for x in row[7].split(" / ")] == pytest.approx([4 * 2**20 / 1e6, (2 * m + 4) / 1e6,
                                                                     (2 * (2**20 // 16 + 4) + 4) / 1e6], abs=0.01)


def test_whole_run_bytes_with_an_int8_warmup_at_autofreezes_floor(capsys):
    # 1 / (w r_w + (1-w)/32), r_w the warm-up's bytes over float32's: int8 sends a byte an element
    # plus a float32 step per 256, r_w = (1 + 4/256) / 4; w = 0.3 (the default, AutoFreeze's floor)
    assert costmodel.WARMUP_FRACTION == 0.3
    w = 0.3
    r_int8 = (1 + 4 / 256) / 4
    expected = 1 / (w * r_int8 + (1 - w) / 32)  # 10.199
    assert costmodel.volume_reduction(w, 32.0, r_int8) == pytest.approx(expected)
    assert costmodel.volume_reduction(w) == pytest.approx(1 / (w + (1 - w) / 32))  # the float32 warm-up
    # the model's bytes (the sign messages' scales and the flags included) on 2 ranks, d = 2^24
    e = costmodel.estimate(2**24, 2, 1e9, 0.1, warmup_fraction=w, warmup_dtype="int8")
    assert e["volume_reduction"] == pytest.approx(expected, rel=1e-4)
    e = costmodel.estimate(2**24, 2, 1e9, 0.1, warmup_fraction=w)
    assert e["volume_reduction"] == pytest.approx(1 / (w + (1 - w) / 32), rel=1e-4)
    # and printed by the command, at the default fraction
    from onebitlamb.cli import main

    assert main(["estimate", "--params", "16M", "--ranks", "2", "--rates", "1Gbit/s", "--compute-ms", "10",
                 "--warmup-dtype", "int8"]) == 0
    (row,) = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
              if line.startswith("| 1 Gbit/s")]
    assert float(row[8].rstrip("x")) == pytest.approx(expected, abs=0.01)


def test_estimate_prices_a_quantised_warmup_over_the_world_group_only(capsys):
    from onebitlamb.cli import main

    argv = ["estimate", "--params", "1M", "--ranks", "4", "--ranks-per-node", "2", "--rates", "1Gbit/s",
            "--compute-ms", "10", "--warmup-dtype", "int4"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("| 1 Gbit/s")]
    assert len(rows) == 1 and "| world group |" in rows[0]
    assert "no node_groups(2) row" in captured.err and "int4" in captured.err
    assert main([*argv[:-1], "bfloat16"]) == 0  # the float formats average over node groups: both rows
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 Gbit/s")]) == 2
    with pytest.raises(ValueError, match="node_groups"):
        costmodel.estimate(2**20, 4, 1e9, 0.1, ranks_per_node=2, node_groups=True, warmup_dtype="int8")
    # over the world group of 2 nodes x 2 the quantised warm-up is priced as the 1-bit exchange's
    # node bytes (all-to-all L^2 (N-1) m, ring all-gather (n-1) m, the flag's 6 bytes from both ranks)
    m = 2**18 + 4 * 2**10
    e = costmodel.estimate(2**20, 4, 1e9, 0.1, ranks_per_node=2, warmup_dtype="int8")
    assert e["warmup_node_bytes"] == 4 * m + 3 * m + 12
