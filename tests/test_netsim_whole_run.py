"""The network benchmark's whole-run table without a network: the steps by kind read from the
convergence benchmark's run logs (written here by hand), and each step timed at its kind's
measured time."""
import json

import pytest

from benchmarks import network
from benchmarks.netsim.worker import ZERO_ONE_SCHEDULE, step_kind, zero_one_freeze_step


def write_run(folder, stages, freeze_step):
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"freeze_step": freeze_step}))
    lines = ["step,loss,heldout_loss,bytes,collectives,lr,stage", "0,,8.3,0,0,,"]
    lines += [f"{i},8.0,,0,0,0.001,{stage}" for i, stage in enumerate(stages, start=1)]
    (folder / "log.csv").write_text("\n".join(lines) + "\n")


@pytest.fixture
def runs(tmp_path):
    write_run(tmp_path / "lamb", ["warmup"] * 10, None)
    write_run(tmp_path / "onebitlamb-auto-float32warmup", ["warmup"] * 3 + ["compression"] * 7, 3)
    # 0/1 Adam frozen after step 4: its compression steps up to 4 are 1-bit steps, after it syncs
    write_run(tmp_path / "zerooneadam", ["warmup", "warmup", "compression", "warmup", "local", "compression",
                                         "local", "compression", "local", "compression"], 4)
    write_run(tmp_path / "onebitlamb-auto", ["warmup"] * 2 + ["compression"] * 8, 2)  # the default: int8
    write_run(tmp_path / "diloco-H16", (["local"] * 3 + ["sync"]) * 2 + ["local", "sync"], None)  # H 4, a last sync
    return tmp_path


def test_steps_by_kind_come_from_each_run_log(runs):
    schedules = network.load_schedules(str(runs), network.NETWORK_OPTIMIZERS)
    assert schedules == {
        "lamb": {"warmup": 10},
        "onebitlamb": {"warmup": 3, "compression": 7},
        "onebitlamb-int8": {"warmup": 2, "compression": 8},
        "zerooneadam": {"warmup": 3, "compression": 1, "local": 3, "sync": 3},
        "diloco": {"local": 7, "sync": 3},
    }  # no run of 1-bit Adam: left out


def test_an_unfinished_run_has_no_schedule(runs):
    (runs / "onebitlamb-auto" / "metrics.json").unlink()  # a run still writing its log
    assert "onebitlamb-int8" not in network.load_schedules(str(runs), ["lamb", "onebitlamb-int8"])


def test_the_new_rows_runs_are_the_benchmarks_that_write_them():
    folders = network.schedule_folders()
    # benchmarks.warmup_quantised's: 1-bit LAMB's float32 warm-up, and the main job's default, int8
    assert (folders["onebitlamb"], folders["onebitlamb-int8"]) == ("onebitlamb-auto-float32warmup", "onebitlamb-auto")
    assert folders["diloco"] == "diloco-H16"  # benchmarks.diloco at H 16, the paper's outer step


def test_the_int8_warm_up_times_its_compression_steps_at_one_bit_lambs():
    """Its warm-up is its own row; after the freeze it sends what 1-bit LAMB sends, timed once."""
    schedules = {"lamb": {"warmup": 10}, "onebitlamb": {"warmup": 3, "compression": 7},
                 "onebitlamb-int8": {"warmup": 2, "compression": 8}, "diloco": {"local": 7, "sync": 3}}
    times = {("lamb", "warmup"): 2.0, ("onebitlamb", "warmup"): 2.1, ("onebitlamb", "compression"): 0.3,
             ("onebitlamb-int8", "warmup"): 0.6, ("diloco", "local"): 0.1, ("diloco", "sync"): 2.05}
    rows = [{"rate_bps": 1e7, "optimizer": name, "stage": kind, "measured_s": t} for (name, kind), t in times.items()]
    whole = {r["optimizer"]: r for r in network.whole_run_rows(rows, schedules)}
    assert whole["onebitlamb-int8"]["whole_run_s"] == pytest.approx(2 * 0.6 + 8 * 0.3)
    assert whole["diloco"]["whole_run_s"] == pytest.approx(7 * 0.1 + 3 * 2.05)
    assert whole["diloco"]["speedup"] == pytest.approx(20.0 / (7 * 0.1 + 3 * 2.05))
    text = network.format_whole_run(list(whole.values()), "runs")
    assert "| steps by kind | LAMB | 1-bit LAMB | 1-bit LAMB, int8 warm-up | DiLoCo |" in text
    assert "| (warm-up / compression / local / sync) | 10 / 0 / 0 / 0 | 3 / 7 / 0 / 0 | 2 / 8 / 0 / 0 | 0 / 0 / 7 / 3 |" in text
    assert "1-bit LAMB, int8 warm-up's compression steps at 1-bit LAMB's time" in text
    # without 1-bit LAMB's compression step there is no whole run of the int8 warm-up's
    rows = [r for r in rows if (r["optimizer"], r["stage"]) != ("onebitlamb", "compression")]
    assert "onebitlamb-int8" not in {r["optimizer"] for r in network.whole_run_rows(rows, schedules)}


def test_the_int8_warm_up_needs_one_bit_lamb_among_the_optimizers():
    import argparse

    parser = argparse.ArgumentParser()
    network.add_arguments(parser)
    with pytest.raises(ValueError, match="add onebitlamb"):
        network.settings_from_args(parser.parse_args(["--optimizers", "lamb,onebitlamb-int8"]))
    s = network.settings_from_args(parser.parse_args([]))
    assert list(s.optimizers) == list(network.NETWORK_OPTIMIZERS)


def test_each_new_rows_step_is_priced_as_it_travels():
    from onebitlamb.comm import costmodel

    d, n = 950_272, 2
    assert network.step_collectives("diloco", "local", d, n) == ([], False)
    assert network.step_collectives("diloco", "sync", d, n) == (costmodel.lamb_collectives(d, n), False)
    assert network.step_collectives("onebitlamb-int8", "warmup", d, n) == (
        costmodel.warmup_collectives(d, n, "int8"), False)
    assert network.step_collectives("onebitlamb", "warmup", d, n) == (costmodel.lamb_collectives(d, n), False)
    assert network.step_collectives("zerooneadam", "local", d, n) == (costmodel.finite_flag_collectives(n), False)


def test_the_whole_run_times_each_step_at_its_kinds_time(runs):
    schedules = network.load_schedules(str(runs), ["lamb", "onebitlamb", "zerooneadam"])
    times = {("lamb", "warmup"): 2.0, ("onebitlamb", "warmup"): 2.1, ("onebitlamb", "compression"): 0.3,
             ("zerooneadam", "warmup"): 2.2, ("zerooneadam", "compression"): 0.4,
             ("zerooneadam", "local"): 0.1, ("zerooneadam", "sync"): 0.5}
    rows = [{"rate_bps": 1e7, "optimizer": name, "stage": kind, "measured_s": t} for (name, kind), t in times.items()]
    rows.append({"rate_bps": 1e9, "optimizer": "lamb", "stage": "warmup", "measured_s": 0.2})
    whole = {(r["rate_bps"], r["optimizer"]): r for r in network.whole_run_rows(rows, schedules)}
    assert set(whole) == {(1e7, "lamb"), (1e7, "onebitlamb"), (1e7, "zerooneadam"), (1e9, "lamb")}
    assert whole[1e7, "lamb"]["whole_run_s"] == pytest.approx(20.0)
    assert whole[1e7, "onebitlamb"]["whole_run_s"] == pytest.approx(3 * 2.1 + 7 * 0.3)
    zero_one = 3 * 2.2 + 1 * 0.4 + 3 * 0.1 + 3 * 0.5
    assert whole[1e7, "zerooneadam"]["whole_run_s"] == pytest.approx(zero_one)
    assert whole[1e7, "zerooneadam"]["speedup"] == pytest.approx(20.0 / zero_one)
    assert whole[1e9, "lamb"]["speedup"] == 1.0
    text = network.format_whole_run(list(whole.values()), "runs")
    assert "| 10 Mbit/s | 0.3 min (1.00x) | 0.1 min (2.38x) | 0.1 min (2.27x) |" in text
    assert "| 1 Gbit/s | 0.0 min (1.00x) | - | - |" in text
    assert "| (warm-up / compression / local / sync) | 10 / 0 / 0 / 0 | 3 / 7 / 0 / 0 | 3 / 1 / 3 / 3 |" in text


def test_zero_one_adams_benchmark_schedule_has_enough_steps_of_each_kind():
    """The freeze step the worker picks, against the optimizer itself: counted by the kinds its
    steps report."""
    import torch

    from onebitlamb import ZeroOneAdam

    freeze = zero_one_freeze_step(4, 9)
    p = torch.nn.Parameter(torch.ones(8))
    opt = ZeroOneAdam([p], lr=1e-3, var_freeze_step=freeze, **ZERO_ONE_SCHEDULE)
    kinds = []
    for _ in range(freeze + 8):
        kinds.append(step_kind(opt))
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    before, after = kinds[:freeze], kinds[freeze:]
    assert before.count("warmup") >= 4 and before.count("compression") >= 9
    assert before.count("warmup") + before.count("compression") == freeze
    assert sorted(set(after)) == ["local", "sync"] and after.count("local") >= 3 and after.count("sync") >= 4
    # the first var_freeze_step that has both counts: one step fewer lacks one of them
    shorter = kinds[:freeze - 1]
    assert shorter.count("warmup") < 4 or shorter.count("compression") < 9
