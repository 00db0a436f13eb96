"""Two emulated hosts at a low rate: the bytes each host's interface counted (kernel counters read
inside its namespace) against the library's own accounting (``CommStats``), within 10%.

Large buffers (1 MB of fp32 for the all-reduce, 2^21 elements for the 1-bit all-reduce, 128 KB of
signs per call) so that TCP/IP headers, ACKs and gloo's small control messages stay a few percent.
"""
import pytest

from benchmarks.netsim.runner import run_workers
from benchmarks.netsim.topology import Network
from netns import needs_netns


@pytest.mark.netns
@needs_netns
def test_wire_bytes_match_the_library_accounting_and_the_rate_holds():
    rate = 40e6
    with Network(2, rate) as net:
        results = run_workers(net, {"model": {}, "optimizers": [], "collectives": [
            {"op": "compressed", "calls": 4, "numel": 1 << 21},
            {"op": "allreduce", "calls": 2, "numel": 1 << 18},
        ]}, timeout_s=90)
        assert net.qdisc_drops() == 0
    for r in results:
        compressed, allreduce = r["collectives"]
        for c in (compressed, allreduce):
            ratio = c["wire_tx_bytes"] / c["accounted_bytes"]
            assert 1.0 <= ratio <= 1.10, f"{c['op']} on rank {r['rank']}: wire/accounted = {ratio:.3f}"
        # the library's formulas: 4 calls of (D/16 + 4 + D/16 + 4) bytes; 2 calls of 4 * 2^18 bytes
        D = 1 << 21
        assert compressed["accounted_bytes"] == 4 * (D // 16 + 4 + D // 16 + 4)
        assert allreduce["accounted_bytes"] == 2 * 4 * (1 << 18)
        # 32x fewer bytes per element on the wire, measured (fp32 ring vs 1-bit, per element sent)
        per_elem_fp32 = allreduce["wire_tx_bytes"] / (2 * (1 << 18))
        per_elem_1bit = compressed["wire_tx_bytes"] / (4 * D)
        assert per_elem_fp32 / per_elem_1bit > 25
        # the shaping holds: 2 MB of fp32 all-reduce cannot pass 40 Mbit/s faster than the rate
        assert allreduce["elapsed_s"] >= 0.95 * allreduce["wire_tx_bytes"] * 8 / rate


@pytest.mark.netns
@needs_netns
def test_network_benchmark_end_to_end_on_a_tiny_model(tmp_path, capsys):
    import json

    from benchmarks import network

    out = tmp_path / "netsim.json"
    schedules = tmp_path / "runs"
    for folder, stages, freeze in (("lamb", ["warmup"] * 4, None),
                                   ("zerooneadam", ["warmup", "compression", "local", "compression"], 2)):
        (schedules / folder).mkdir(parents=True)
        (schedules / folder / "metrics.json").write_text(json.dumps({"freeze_step": freeze}))
        (schedules / folder / "log.csv").write_text("step,stage\n0,\n" + "".join(
            f"{i},{stage}\n" for i, stage in enumerate(stages, start=1)))
    code = network.main(["--rates", "20Mbit/s", "--optimizers", "lamb,onebitlamb,zerooneadam", "--hidden", "64",
                         "--layers", "1", "--batch", "4", "--warmup-steps", "1", "--compression-steps", "2",
                         "--raw", str(out), "--plot", str(tmp_path / "speedup.png"), "--schedules", str(schedules),
                         "--results", str(tmp_path / "BENCHMARKS.md"), "--timeout", "120", "--paired-rounds", "4"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| 20 Mbit/s | 1-bit LAMB | compression |" in printed
    summary = json.loads(out.read_text())["summary"]
    (row,) = summary["summary"]
    assert row["optimizer"] == "onebitlamb" and row["wire_reduction"] > 10
    rows = {(r["optimizer"], r["stage"]): r for r in summary["rows"]}
    assert set(rows) == {("lamb", "warmup"), ("onebitlamb", "warmup"), ("onebitlamb", "compression"),
                         ("zerooneadam", "warmup"), ("zerooneadam", "compression"), ("zerooneadam", "local"),
                         ("zerooneadam", "sync")}
    # a local step sends only the agreed finite flag; a 1-bit step and a sync far less than a variance step
    assert rows["zerooneadam", "local"]["accounted_bytes"] < 100
    for kind in ("compression", "sync"):
        assert rows["zerooneadam", kind]["wire_bytes"] * 10 < rows["zerooneadam", "warmup"]["wire_bytes"]
    # the paired loopback rounds compare the compression stage with LAMB: 0/1 Adam is not among them
    assert [p["optimizer"] for p in summary["paired"]] == ["onebitlamb"]
    whole = {r["optimizer"]: r for r in summary["whole_run"]}
    assert set(whole) == {"lamb", "zerooneadam"}  # 1-bit LAMB has no run in the schedules folder
    m = {kind: rows["zerooneadam", kind]["measured_s"] for kind in ("warmup", "compression", "local", "sync")}
    assert whole["zerooneadam"]["whole_run_s"] == pytest.approx(sum(m.values()))
    assert whole["lamb"]["whole_run_s"] == pytest.approx(4 * rows["lamb", "warmup"]["measured_s"])
    assert "No whole run for 1-bit LAMB" in printed



@pytest.mark.netns
@needs_netns
def test_the_int8_warm_up_and_dilocos_steps_on_the_wire():
    """The network benchmark's ``train`` job for its rows of 1-bit LAMB with the int8 warm-up and of
    DiLoCo, on two hosts at one rate (one launch): the kernel's counters say the int8 warm-up step
    sends about a quarter of a float32 warm-up step's bytes (LAMB's: the same all-reduce), DiLoCo's
    local step nothing and its sync a float32 all-reduce of the parameters."""
    spec = {"model": {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}, "batch": 2,
            "optimizers": ["lamb", "onebitlamb-int8", "diloco"], "warmup_steps": 2, "compression_steps": 2,
            "skip_steps": 1, "train": True, "probe": {"latency_calls": 5}}
    with Network(2, 20e6) as net:
        results = run_workers(net, spec, timeout_s=120)
    for r in results:
        d = r["train"]["lamb"]["params"]
        lamb, int8, diloco = (r["train"][name] for name in ("lamb", "onebitlamb-int8", "diloco"))
        assert set(int8) & {"warmup", "compression"} == {"warmup"}  # its compression steps: 1-bit LAMB's row
        assert {"local", "sync"} <= set(diloco)
        float32_wire, int8_wire = lamb["warmup"]["wire_bytes_per_step"], int8["warmup"]["wire_bytes_per_step"]
        assert 0.2 < int8_wire / float32_wire < 0.35, f"rank {r['rank']}: int8 {int8_wire:.0f} B, float32 {float32_wire:.0f} B"
        assert 1.0 <= int8_wire / int8["warmup"]["accounted_bytes_per_step"] <= 1.10
        assert diloco["local"]["accounted_bytes_per_step"] == 0
        assert diloco["local"]["wire_bytes_per_step"] < 1024, "a local step sends nothing but a stray acknowledgement"
        sync = diloco["sync"]
        assert sync["accounted_bytes_per_step"] == 4 * d  # one float32 ring all-reduce of d parameters, 2 ranks
        assert 1.0 <= sync["wire_bytes_per_step"] / sync["accounted_bytes_per_step"] <= 1.10
