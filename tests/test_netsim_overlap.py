"""The serial step against ``overlap_with_backward`` (``worker.hierarchy_steps``' overlap modes,
``benchmarks/overlap.py``): the summary's ratios, ideal step and targets on synthetic per-rank
results worked out by hand, the worker's modes on 2 real gloo ranks on loopback (no root
needed), and the end-to-end run on emulated hosts (marked ``netns``)."""
import pytest

from benchmarks import overlap
from benchmarks.hierarchy import summarise_hierarchy_rate
from netns import needs_netns

TINY = {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64}


def _rec(times, wire=None, started=None, buckets=1):
    """One rank's record of one mode and stage, as ``hierarchy_steps`` writes it."""
    n = len(times)
    return {"step_times": list(times), "backward_times": [t / 2 for t in times],
            "opt_step_times": [t / 4 for t in times],
            "started_in_backward": list(started or [0] * n), "buckets": [buckets] * n, "bytes": [100] * n,
            "intra_bytes": [0] * n, "wire_bytes": [wire] * n}


def _ranks(by_mode, local_size=1):
    """Per-rank results: ``by_mode[mode]`` is the list of each rank's record (compression stage)."""
    world = len(next(iter(by_mode.values())))
    return [{"local_size": local_size, "params": 1000,
             "steps": {"onebitlamb": {mode: {"compression": recs[k]} for mode, recs in by_mode.items()}}}
            for k in range(world)]


# 2 hosts, one rank each, 4 steps. Per step the slowest rank: serial 0.4 0.4 0.5 0.6, overlapped
# 0.2 0.25 0.5 0.4, compute-only 0.25 0.2 0.2 0.3
TWO_HOSTS = {
    "flat": [_rec([0.4, 0.3, 0.5, 0.6], wire=2.1e6), _rec([0.1, 0.4, 0.45, 0.2], wire=2.3e6)],
    "overlap": [_rec([0.2, 0.1, 0.5, 0.4], wire=2e6, started=[3, 4, 4, 4], buckets=4),
                _rec([0.15, 0.25, 0.3, 0.35], wire=3e6, started=[4, 4, 4, 4], buckets=4)],
    "solo": [_rec([0.2, 0.2, 0.2, 0.2]), _rec([0.25, 0.1, 0.1, 0.3])],
}


def test_overlap_ratio_ideal_step_and_buckets_by_hand():
    row, = summarise_hierarchy_rate(_ranks(TWO_HOSTS), 50e6)
    assert row["flat_s"] == pytest.approx(0.45) and row["overlap_s"] == pytest.approx(0.325)
    assert row["solo_s"] == pytest.approx(0.225)
    # per step serial / overlapped: 2.0 1.6 1.0 1.5, sorted 1.0 1.5 1.6 2.0; quartiles (exclusive
    # method, positions 1.25 and 3.75): 1.0 + 0.25 * 0.5 and 1.6 + 0.75 * 0.4
    assert row["overlap_ratio_median"] == pytest.approx(1.55)
    assert row["overlap_ratio_q1"] == pytest.approx(1.125) and row["overlap_ratio_q3"] == pytest.approx(1.9)
    assert row["overlap_faster_share"] == pytest.approx(0.75) and row["steps"] == 4
    # no node_groups run: no flat / hier ratio
    assert "ratio_median" not in row and "hier_overlap_ratio_median" not in row
    # wire: mean over hosts 2.5 MB a step, 0.4 s at 50 Mbit/s, more than the compute-only 0.225 s
    assert row["overlap_wire_bytes"] == pytest.approx(2.5e6) and row["overlap_wire_s"] == pytest.approx(0.4)
    assert row["overlap_ideal_s"] == pytest.approx(0.4)
    assert row["flat_wire_s"] == pytest.approx(8 * 2.2e6 / 50e6)
    # 31 of 8 steps x 4 buckets started in the backward; the serial run starts none of its one
    assert row["overlap_started"] == pytest.approx(31 / 8) and row["overlap_buckets"] == 4
    assert row["flat_started"] == 0 and row["flat_buckets"] == 1
    # at 1 Gbit/s the same bytes take 20 ms: the compute-only step is the ideal
    fast, = summarise_hierarchy_rate(_ranks(TWO_HOSTS), 1e9)
    assert fast["overlap_wire_s"] == pytest.approx(0.02) and fast["overlap_ideal_s"] == pytest.approx(0.225)
    # unshaped: nothing to wait for on the wire
    free, = summarise_hierarchy_rate(_ranks(TWO_HOSTS), None)
    assert free["overlap_wire_s"] == 0.0 and free["overlap_ideal_s"] == pytest.approx(0.225)


def test_results_from_before_overlap_still_summarise():
    old = {mode: [{k: v for k, v in rec.items() if k not in ("started_in_backward", "buckets")} for rec in recs]
           for mode, recs in TWO_HOSTS.items()}
    row, = summarise_hierarchy_rate(_ranks(old), 50e6)
    assert "overlap_started" not in row and row["overlap_ratio_median"] == pytest.approx(1.55)
    assert "| - |" in overlap.format_overlap_table({"rows": [row], "local_size": 1, "params": 1000})


def test_hierarchical_pair_on_nodes_of_two_by_hand():
    # 2 nodes x 2 ranks, 3 steps; in step i rank i holds the slowest time, the others half of it
    def recs(slowest, wire=None, started=None, buckets=1):
        out = []
        for k in range(4):
            times = [t if i == k else t / 2 for i, t in enumerate(slowest)]
            # each node's counter is read by both its ranks; the summary takes local rank 0's
            out.append(_rec(times, wire=wire[k // 2] if k % 2 == 0 else 99e6, started=started, buckets=buckets)
                       if wire else _rec(times, started=started, buckets=buckets))
        return out

    by_mode = {"flat": recs([0.6, 0.5, 0.4], wire=[1000.0, 3000.0]),
               "hier": recs([0.3, 0.5, 0.2], wire=[500.0, 700.0]),
               "overlap": recs([0.5, 0.5, 0.4], wire=[1100.0, 3100.0], started=[2, 2, 1], buckets=2),
               "hier-overlap": recs([0.2, 0.25, 0.25], wire=[600.0, 800.0], started=[2, 2, 2], buckets=2),
               "solo": recs([0.1, 0.1, 0.1])}
    row, = summarise_hierarchy_rate(_ranks(by_mode, local_size=2), 8e6)
    assert row["nodes"] == 2 and row["local_size"] == 2 and row["steps"] == 3
    # three steps: the quartiles (exclusive method) are the smallest and the largest ratio
    # flat / hier: 2.0 1.0 2.0
    assert (row["ratio_median"], row["ratio_q1"], row["ratio_q3"]) == pytest.approx((2.0, 1.0, 2.0))
    assert row["hier_faster_share"] == pytest.approx(2 / 3)
    # hier / hier-overlap: 1.5 2.0 0.8
    assert (row["hier_overlap_ratio_median"], row["hier_overlap_ratio_q1"], row["hier_overlap_ratio_q3"]) == \
        pytest.approx((1.5, 0.8, 2.0))
    assert row["hier_overlap_faster_share"] == pytest.approx(2 / 3)
    # flat / overlap: 1.2 1.0 1.0
    assert row["overlap_ratio_median"] == pytest.approx(1.0) and row["overlap_ratio_q3"] == pytest.approx(1.2)
    # a node's wire bytes from its local rank 0, mean over the nodes: 2100 for overlap, 16.8 ms at 8 Mbit/s
    assert row["overlap_wire_bytes"] == pytest.approx(2100.0) and row["hier_overlap_wire_bytes"] == pytest.approx(700.0)
    assert row["overlap_wire_s"] == pytest.approx(0.0021) and row["hier_overlap_ideal_s"] == pytest.approx(0.1)
    assert row["overlap_started"] == pytest.approx(5 / 3) and row["hier_overlap_started"] == 2
    table = overlap.format_overlap_table({"rows": [row], "local_size": 2, "params": 1000})
    lines = table.splitlines()
    assert len(lines) == 3 and "wire KB/step per node" in lines[0] and "hier. overlapped ms" in lines[0]
    cells = lines[2].strip("| ").split(" | ")
    assert len(cells) == len(lines[0].strip("| ").split(" | "))
    assert cells[-3:] == ["300", "250", "1.50x (0.80-2.00)"]


def test_targets_table_and_plot(tmp_path):
    rows = [summarise_hierarchy_rate(_ranks(TWO_HOSTS), rate)[0] for rate in (50e6, 1e9)]
    summary = {"rows": rows, "local_size": 1, "params": 1000, "bucket_cap_mb": 1.0}
    lines = overlap.check_overlap_targets(summary)
    # 1 Gbit/s: 325 ms against the compute-only 225 ms is 44% over; 50 Mbit/s: 325 ms against
    # max(225, 400) ms is 0.81x
    assert lines[0].startswith("MISSED") and "+44%" in lines[0] and "1 Gbit/s" in lines[0]
    assert lines[1].startswith("met") and "0.81x" in lines[1] and "50 Mbit/s" in lines[1]
    near = [dict(rows[0], overlap_s=0.5), dict(rows[1], overlap_s=0.24)]  # 1.25x; +7%
    lines = overlap.check_overlap_targets(dict(summary, rows=near))
    assert lines[0].startswith("met") and "+7%" in lines[0]
    assert lines[1].startswith("MISSED") and "1.25x" in lines[1]
    lines = overlap.check_overlap_targets(dict(summary, rows=[dict(rows[0], overlap_wire_bytes=None,
                                                                      overlap_ideal_s=None)]))
    assert all(line.startswith("n/a") for line in lines)
    table = overlap.format_overlap_table(summary)
    assert len(table.splitlines()) == 2 + len(rows) and "hier." not in table
    row = next(line for line in table.splitlines() if line.startswith("| 50 Mbit/s | 1-bit LAMB | compression |"))
    assert "| 400 (400 on the wire) | 0.81x | 3.9 of 4 |" in row and "1.55x (1.12-1.90)" in row
    overlap.plot_overlap(summary, tmp_path / "o.png")
    assert (tmp_path / "o.png").stat().st_size > 0


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
    rows = summarise_hierarchy_rate(per_rank, None)
    assert [r["stage"] for r in rows] == ["warmup", "compression"]
    assert all("overlap_ratio_median" in r and "ratio_median" not in r for r in rows)


@pytest.mark.netns
@needs_netns
def test_benchmark_on_emulated_hosts(tmp_path, capsys):
    from benchmarks.netsim import topology

    before = set(topology.list_namespaces())
    argv = ["--rates", "1G", "--hidden", "32", "--layers", "1", "--batch", "2", "--warmup-steps", "1",
            "--compression-steps", "2", "--bucket-cap-mb", "0.01", "--no-write"]
    assert overlap.main(argv) == 0
    assert set(topology.list_namespaces()) == before, "every namespace removed"
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1 Gbit/s | 1-bit LAMB | compression"))
    wire = row.strip("| ").split(" | ")[-1]  # "serial / overlapped"
    assert all(float(x) > 0 for x in wire.split(" / "))
    assert "within 10% of compute-only at 1 Gbit/s" in out and "n/a" in out  # no 50 Mbit/s row
