"""The freeze-signals analysis: each statistic on records small enough to work out by hand."""
import math

import pytest

from onebitlamb.benchmarks import freeze_signals as fs


def test_element_levels_per_element_without_the_key_biases():
    metrics = {"freeze_levels": {
        "layers": ["a.weight", "layer.0.attention.self.key.bias", "b.weight"],
        "per_step": [[1.0, 0.5, None], [2.0, 0.5, 3.0], None]}}  # None: frozen
    names, rows = fs.element_levels(metrics, {"a.weight": 4, "layer.0.attention.self.key.bias": 2, "b.weight": 16})
    assert names == ["a.weight", "b.weight"]
    assert rows[0][0] == pytest.approx(1.0 - math.log(2.0)) and rows[0][1] == -math.inf
    assert rows[1] == pytest.approx([2.0 - math.log(2.0), 3.0 - math.log(4.0)])
    assert len(rows) == 2


def test_level_statistics_by_hand():
    rows = [[0.0, -math.inf, 3.0], [1.0, 5.0, 3.0], [2.0, 9.0, 3.5]]
    assert fs.rise_to_come(rows, 2) == 4.0    # the second layer: 5 -> 9
    assert fs.rise_to_come(rows, 1) == 2.0    # no gradient yet at step 1: left out
    assert fs.lowest_below_median(rows, 2) == 2.0   # median 3, lowest 1
    assert fs.lowest_below_median(rows, 1) == 1.5   # of the two finite levels, 0 and 3


def test_largest_jump_counts_only_up_to_the_step():
    spread = [None, 1.0, 3.0, 2.5, 8.0]
    assert fs.largest_jump(spread, 4) == 2.0
    assert fs.largest_jump(spread, 5) == 5.5
    assert fs.largest_jump(spread, 2) is None


def test_stage2_steps_per_unit_rate_after_the_freeze():
    def layer(name, rel):
        return {"name": name, "rel_step": rel}

    metrics = {
        # lr[k] is the rate step k + 2 used: steps 2, 3, 4, 5 ran at 0.1, 0.2, 0.2, 0
        "lr": [0.1, 0.2, 0.2, 0.0, 0.0],
        "stage": ["warmup", "warmup", "compression", "compression", "compression"],  # frozen at the end of step 2
        "diagnostics": [
            # labelled with the stage after the step, as records did before: step 2 ran the warm-up
            {"step": 2, "stage": "compression", "layers": [layer("a", 1.0)]},
            {"step": 3, "stage": "compression",
             "layers": [layer("a", 0.2), layer("b", 0.4), layer("c", 1.2), layer("x.attention.self.key.bias", 99.0)]},
            {"step": 4, "stage": "compression", "layers": [layer("a", 0.4), layer("b", 0.6), layer("c", None)]},
            {"step": 5, "stage": "compression", "layers": [layer("a", 0.0)]},  # rate 0: left out
        ]}
    # step 3: ratios 1, 2, 6 -> largest 6, median 2; step 4: 2, 3 -> largest 3, median 2.5
    assert fs.stage2_steps(metrics) == pytest.approx((3.0, 6.0, 2.0, 2.5))
    assert fs.stage2_steps({"lr": [0.1], "stage": ["warmup"], "diagnostics": []}) is None


def test_render_sets_the_failed_freeze_against_those_that_worked():
    def row(run, gap, jump):
        return {"preset": "demo", "seed": 1, "run": run, "freeze": 90, "gap": gap, "spread": 4.0, "jump": jump,
                "below_median": 9.0, "rise": 8.0, "stage2": (10.0, 20.0, 3.0, 4.0)}

    text = fs.render([row("bad", 0.165, 5.4), row("good", -0.02, 6.0), row("ok", 0.01, 2.0)], "cmd")
    assert "| demo, 1 | bad | 90 | +16.5% | **no** |" in text
    assert "| demo, 1 | ok | 90 | +1.0% | yes |" in text   # 1% is within the target
    assert "- largest jump: failed 5.4; worked 2.0 to 6.0, 1 of 2 at or above the lowest failed value" in text
    assert "| 10-20 | 3-4 |" in text


def test_automatic_freezes_pair_the_two_rules_at_each_seed(tmp_path):
    import json

    def save(folder, config, loss, freeze=None, spread=()):
        (tmp_path / "p" / folder).mkdir(parents=True)
        base = {"seed": 1, "lr": 0.02, "auto_freeze": True, "compression_space": "momentum", "update_guard": 0.0}
        metrics = {"config": {**base, **config}, "final_eval_loss": loss, "freeze_step": freeze,
                   "freeze_spread": list(spread)}
        (tmp_path / "p" / folder / "metrics.json").write_text(json.dumps(metrics))

    save("lamb", {"optimizer": "lamb", "auto_freeze": False}, 5.0)
    save("default", {"optimizer": "onebitlamb", "freeze_transient_end": 2.5}, 4.5, 5, [None, 1.0, 2.0, 6.0, 5.0, 9.0])
    # saved before freeze_transient_end existed: the rule before (half the peak)
    save("before", {"optimizer": "onebitlamb"}, 5.5, 4, [None, 1.0, 2.0, 6.0, 5.0])
    save("other rate", {"optimizer": "onebitlamb", "lr": 0.01, "freeze_transient_end": 2.5}, 4.0, 3, [0.0, 9.0, 0.0])
    save("guarded", {"optimizer": "onebitlamb", "update_guard": 4.0}, 4.0, 3, [0.0, 9.0, 0.0])
    rates = {"lamb": 0.02, "onebitlamb": 0.02, "onebitadam": 0.002}
    runs = fs.study_runs(str(tmp_path), rates)
    assert sorted(folder for _, folder, _ in runs) == ["before", "default", "lamb"]
    entries = fs.automatic_freezes(runs)
    assert len(entries) == 1
    entry = entries[0]
    assert entry["jump"] == 4.0   # 2 -> 6, up to each rule's own freeze (the 9 comes after step 5)
    assert entry["default"] == (5, pytest.approx(-0.1)) and entry["half peak"] == (4, pytest.approx(0.1))
    assert "| onebitlamb | p, 1 | 4.0 | 5, -10.0% | 4, +10.0% |" in fs.render_jumps(entries, rates)


def test_loss_before_is_the_last_evaluation_at_or_before_the_step():
    metrics = {"samples": 100, "steps": 10, "eval_curve": [[0, 8.0], [50, 6.5], [100, 5.0]]}
    assert fs.loss_before(metrics, 4) == (0, 8.0)
    assert fs.loss_before(metrics, 5) == (5, 6.5)
    assert fs.loss_before(metrics, 9) == (5, 6.5)
    assert fs.loss_before(metrics, 10) == (10, 5.0)


def test_plateau_rows_set_each_automatic_freeze_beside_the_run_with_it_held_off(tmp_path):
    import json

    def save(folder, config, freeze, loss):
        (tmp_path / "b1024" / folder).mkdir(parents=True)
        base = {"optimizer": "onebitadam", "seed": 1235, "lr": 0.004, "auto_freeze": True}
        metrics = {"config": {**base, **config}, "final_eval_loss": loss, "freeze_step": freeze,
                   "freeze_spread": [1.0, 1.5, 9.0, 9.0, 2.0, 2.0], "samples": 60, "steps": 6,
                   "eval_curve": [[0, 8.3], [30, 6.16], [60, loss]]}
        (tmp_path / "b1024" / folder / "metrics.json").write_text(json.dumps(metrics))

    save("auto", {"freeze_transient_end": 2.5}, 5, 6.13)
    save("auto before", {}, 5, 6.14)                     # saved before freeze_transient_end existed
    save("other seed", {"seed": 1234, "freeze_transient_end": 2.5}, 5, 4.4)
    save("other rate", {"lr": 0.002, "freeze_transient_end": 2.5}, 5, 4.6)
    save("fixed", {"auto_freeze": False}, 2, 6.0)
    held_off = {("b1024", 1235, "onebitadam", 0.004): {"freeze_step": 300, "final_eval_loss": 4.5}}
    rows = fs.plateau_rows(str(tmp_path), held_off)
    assert [(r["rule"], r["freeze"], r["jump"], r["before"], r["final"]) for r in rows] == [
        ("default", 5, 7.5, (3, 6.16), 6.13), ("half peak", 5, 7.5, (3, 6.16), 6.14)]
    assert "| onebitadam, 4e-3 | b1024, 1235 | default | 5 | 7.5 | 6.160 (step 3) | 6.130 | 300, 4.500 |" in (
        fs.render_plateau(rows))


def test_replay_freeze_applies_both_rules_after_the_floor():
    spread = [None, 0.2, 6.0, 6.0, 2.9, 2.0]
    replay = lambda end, floor=3: fs.replay_freeze(spread, end, floor, tolerance=0.3, transient=5.0)  # noqa: E731
    assert replay(2.5) == 6            # falls to the end only at step 6
    assert replay(None) == 5 == replay(4.0)   # half the peak (3.0), or an end of 4
    assert replay(2.5, floor=1) == 2   # rule 1: settled at step 2, once the floor allows it
    assert replay(1.0) is None         # the record ends first
    assert fs.replay_freeze([1.0, 4.9, 2.0], 2.5, 1, 0.3, 5.0) is None   # no transient: 4.9 < 5


def test_replayed_ends_use_the_longest_record_and_pair_the_two_rules():
    def run(seed, end, freeze, spread):
        config = {"optimizer": "onebitlamb", "auto_freeze": True, "seed": seed, "freeze_transient_end": end,
                  "steps": 8, "min_freeze_frac": 0.25, "freeze_tolerance": 0.3, "freeze_transient": 5.0}
        return ("demo", "f", {"config": config, "freeze_step": freeze, "freeze_spread": spread})

    runs = [run(1, 2.5, 6, [None, 1.0, 8.0, 8.0, 3.0, 2.4]),       # the record ends with its freeze's spread
            run(1, 0.0, 5, [None, 1.0, 8.0, 8.0, 3.0]),            # the rule before (saved as 0.0)
            run(2, 2.5, 7, [None, 1.0, 6.0, 2.6, None, None, None]),
            ("demo", "lamb", {"config": {"optimizer": "lamb", "auto_freeze": False, "seed": 1}})]
    trace = {"freeze_spread": [None, 1.0, 6.0, 2.6, 2.55, 2.5, 0.1, None]}
    rows = fs.replayed_ends(runs, {("demo", 2): trace})
    assert fs.REPLAYED_ENDS == (2.5, 3.0, 3.5, 4.0, None)
    assert [(r["seed"], r["freeze"], r["before"], r["steps"]) for r in rows] == [
        (1, 6, 5, [6, 5, 5, 5, 5]),          # end 2.5 replays the run's own freeze; 3.0 and up fire at 3.0
        (2, 7, None, [6, 4, 4, 4, 4])]       # the trace: 2.5 at step 6
    assert "| demo, 1 | 6 | 5 | 6 | 5 | 5 | 5 | 5 |" in fs.render_ends(rows)
