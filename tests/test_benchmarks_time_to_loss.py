"""benchmarks.time_to_loss on made-up runs and made-up measured step times: each step priced at its
kind's time (a streaming sync at a local step plus its fragment's share of a full sync's extra),
the first evaluation at or below LAMB's final loss, and "not reached" with the final gap."""
import json

import pytest

from benchmarks import time_to_loss as ttl
from benchmarks.network import step_kinds

# measured seconds a step, by kind, at one rate (made up)
TIMES = {"warmup": 3.0, "compression": 0.5, "local": 0.1, "sync": 2.1}


def test_each_step_is_priced_at_its_kinds_measured_time():
    assert ttl.step_prices(["warmup", "warmup", "compression"], TIMES) == [3.0, 3.0, 0.5]
    # a sync of half the model: a local step plus half the full sync's extra (2.1 - 0.1)
    assert ttl.step_prices(["local", "sync"], TIMES, sync_share=0.5) == pytest.approx([0.1, 1.1])
    with pytest.raises(KeyError, match="variance"):
        ttl.step_prices(["variance"], TIMES)
    with pytest.raises(ValueError, match="1.5"):
        ttl.step_prices(["sync"], TIMES, sync_share=1.5)


def test_zero_one_adams_compression_steps_after_its_freeze_are_syncs():
    stages = ["warmup", "compression", "local", "compression"]
    assert step_kinds(stages, "zerooneadam", 2) == ["warmup", "compression", "local", "sync"]
    assert step_kinds(stages, "onebitadam", 2) == stages


def test_the_time_is_that_of_the_steps_up_to_the_first_evaluation_at_or_below_the_target():
    curve = [(0, 9.0), (2, 6.0), (4, 5.0), (6, 5.2)]
    prices = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert ttl.time_to_target(curve, prices, 5.0) == (4, 10.0)  # at, not only below
    assert ttl.time_to_target(curve, prices, 6.5) == (2, 3.0)
    assert ttl.time_to_target(curve, prices, 9.5) == (0, 0.0)
    assert ttl.time_to_target(curve, prices, 4.9) is None


def test_a_row_that_never_reaches_the_target_says_not_reached_and_its_final_gap():
    curve = [(0, 9.0), (4, 5.5), (8, 5.25)]
    missed = ttl.reach(curve, [1.0] * 8, 5.0)
    assert missed.seconds is None and missed.final_gap == pytest.approx(0.05)
    hit = ttl.reach(curve, [60.0] * 8, 5.25)
    assert (hit.step, hit.seconds) == (8, 480.0)
    assert ttl.cell([hit, hit]) == "8.00 ± 0.00 min"
    assert ttl.cell([missed, missed]) == "not reached (2 of 2 seeds), final gap +5.00%"
    # a row that gets there at some seeds: their time, and the gap of the others
    assert ttl.cell([hit, missed]) == "8.00 min (1 of 2 seeds; the other: final gap +5.00%)"
    early = ttl.reach(curve, [30.0] * 8, 5.5)  # there at step 4: 2 minutes; with 8: 5 ± 4.24
    assert ttl.cell([hit, early, missed, missed]) == "5.00 ± 4.24 min (2 of 4 seeds; the others: final gap +5.00%)"


def _metrics(stages, curve, loss_scale=1.0, freeze=None, sent=400e6):
    return {"steps": len(stages), "samples": 16 * len(stages), "world_size": 4, "stage": stages,
            "freeze_step": freeze, "final_eval_loss": curve[-1][1] * loss_scale, "bytes_sent_per_rank": sent,
            "eval_curve": [[16 * step, loss * loss_scale] for step, loss in curve]}


def test_the_table_prices_every_row_against_lamb_at_its_own_seed(tmp_path):
    # made-up network results: two rates measured on 2 hosts (network.by_kind fills 1-bit LAMB's
    # compression steps from onebitlamb's row)
    rows = [{"rate_bps": rate, "optimizer": name, "stage": kind, "measured_s": s}
            for rate, scale in ((10e6, 10.0), (1e9, 1.0))
            for name, kind, s in (("lamb", "warmup", 1.0), ("onebitlamb-int8", "warmup", 0.5),
                                  ("onebitlamb", "compression", 0.1), ("onebitadam", "warmup", 1.0),
                                  ("onebitadam", "compression", 0.1), ("zerooneadam", "warmup", 1.0),
                                  ("zerooneadam", "compression", 0.1), ("zerooneadam", "local", 0.05),
                                  ("zerooneadam", "sync", 0.1), ("diloco", "local", 0.05), ("diloco", "sync", 1.0))
            for s in [s * scale]]
    path = tmp_path / "netsim.json"
    path.write_text(json.dumps({"summary": {"rows": rows}}))
    network = {2: ttl.measured_seconds(str(path)), 4: {}}
    assert network[2][10e6]["onebitlamb-int8"] == {"warmup": 5.0, "compression": 1.0}

    lamb = [(0, 9.0), (2, 6.0), (4, 5.0)]
    runs = {
        ttl.ROWS[0].label: {1: _metrics(["warmup"] * 4, lamb), 2: _metrics(["warmup"] * 4, lamb, 2.0)},
        ttl.ROWS[1].label: {s: _metrics(["warmup", "warmup", "compression", "compression"], [(0, 9.0), (2, 4.9),
                                                                                          (4, 4.95)], k, sent=sent)
                            for s, k, sent in ((1, 1.0, 30e6), (2, 2.0, 50e6))},
        ttl.ROWS[2].label: {s: _metrics(["warmup", "compression", "compression", "compression"],
                                        [(0, 9.0), (2, 5.6), (4, 5.3)], k) for s, k in ((1, 1.0), (2, 2.0))},
        ttl.ROWS[3].label: {s: _metrics(["warmup", "compression", "local", "compression"], [(0, 9.0), (4, 5.0)],
                                        k, freeze=2) for s, k in ((1, 1.0), (2, 2.0))},
        ttl.ROWS[4].label: {s: _metrics(["local", "sync"] * 2, [(0, 9.0), (2, 5.0), (4, 4.0)], k)
                            for s, k in ((1, 1.0), (2, 2.0))},
        ttl.ROWS[5].label: {s: {"error": "stopped"} for s in (1, 2)},
    }
    measured = {"seeds": [1, 2], "runs": runs, "chosen": {}, "grids": {}}
    lines = ttl.table(measured, network, 0.0)
    assert lines[0] == ("| row | 2 hosts, 10 Mbit/s | 2 hosts, 100 Mbit/s | 2 hosts, 1 Gbit/s | 4 hosts, 10 Mbit/s "
                        "| 4 hosts, 100 Mbit/s | 4 hosts, 1 Gbit/s | bytes a worker sent |")
    cells = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines[2:]}
    # LAMB: 4 warm-up steps to its own final loss, 10 s each at 10 Mbit/s, 1 s at 1 Gbit/s
    assert cells["LAMB"][0] == "0.67 ± 0.00 min" and cells["LAMB"][1] == "not measured"
    assert cells["LAMB"][2] == "0.07 ± 0.00 min" and cells["LAMB"][5] == "not measured"
    # the whole run's bytes beside the times: the mean over seeds, LAMB's over it (a stopped run has none)
    assert cells["LAMB"][6] == "400 MB (1.0x fewer than LAMB) |"
    assert cells[ttl.ROWS[1].label][6] == "40 MB (10.0x fewer than LAMB) |"
    assert cells[ttl.ROWS[5].label][6] == "not measured |"
    # 1-bit LAMB: there at its evaluation after step 2 (two int8 warm-up steps, 5 s each)
    assert cells[ttl.ROWS[1].label][0] == "0.17 ± 0.00 min"
    # 1-bit Adam: 5.3 against 5.0 at each seed
    assert cells[ttl.ROWS[2].label][0] == "not reached (2 of 2 seeds), final gap +6.00%"
    # 0/1 Adam: warm-up, compression, local, sync (after its freeze at step 2): 10 + 1 + 0.5 + 1 s
    assert cells[ttl.ROWS[3].label][0] == "0.21 ± 0.00 min"
    # DiLoCo: local, sync: 0.5 + 10 s at 10 Mbit/s
    assert cells[ttl.ROWS[4].label][0] == "0.17 ± 0.00 min"
    assert cells[ttl.ROWS[5].label][0] == "not reached (2 of 2 seeds), final gap +inf%"
    assert ttl.table(measured, network, 0.05)[4].split(" | ")[1] == "not reached (2 of 2 seeds), final gap +0.95%"


@pytest.mark.parametrize("spec", ["2", "x=f.json", "1=f.json", "4="])
def test_a_bad_network_argument_is_refused_naming_it(spec):
    with pytest.raises(ValueError, match=spec):
        ttl.parse_network([spec])
