"""The convergence study's plan and table (the runs themselves are the main job, tested elsewhere)."""
import math
import os

import pytest

from onebitlamb.benchmarks import convergence


def _parses(optimizer, flags):
    import argparse

    from onebitlamb.train import pretrain

    parser = argparse.ArgumentParser()
    pretrain.add_arguments(parser)
    return pretrain.config_from_args(parser.parse_args(["--preset", "demo", "--optimizer", optimizer, "--out", "x",
                                                        *flags]))


def test_every_planned_row_is_a_valid_pretrain_command():
    everything = list(convergence.PRESETS)
    rows = convergence.plan(everything, sweep=everything, seeds=[f"{p}:3" for p in everything])
    assert {r.preset for r in rows} == set(convergence.PRESETS)
    for row in rows:
        cfg = _parses(row.optimizer, row.flags)
        assert cfg.optimizer == row.optimizer and cfg.seed == row.seed
        if "auto" in row.label:
            assert cfg.auto_freeze
        # every row at another rate is a valid command too, at that rate and no other
        label2, flags2 = convergence.with_rate(row.label, row.flags, 0.5 * cfg.lr)
        at_half = _parses(row.optimizer, flags2)
        assert at_half.lr == 0.5 * cfg.lr and flags2.count("--lr") == 1 and at_half.seed == row.seed
        assert convergence.rate_stem(label2) == convergence.rate_stem(row.label)
        assert convergence.own_rate(row.optimizer, row.flags) == cfg.lr
    # one swept row per optimizer and preset when all are asked for (two for each 1-bit optimizer: the
    # automatic freeze with the default rule and with the rule before); none unless asked
    assert sum(r.swept for r in rows) == 5 * len(convergence.PRESETS)
    assert not any(r.swept for r in convergence.plan(["b512"]))
    only_lamb = convergence.plan(["b512", "b4096"], sweep=["b512:lamb", "b4096:lamb,onebitadam"])
    assert [r.label for r in only_lamb if r.swept] == ["lamb", "lamb", "1bit-adam auto (cap 75%), lr 2e-3",
                                                       "1bit-adam auto (cap 75%), transient end 2.5, lr 2e-3"]
    for bad in (["b999"], ["b512:sgd"], ["b512@0"], ["b512:lamb@x"]):
        with pytest.raises(ValueError, match="invalid sweep"):
            convergence.plan(["b512"], sweep=bad)


def test_a_sweep_at_more_seeds_sweeps_the_default_rows_at_each():
    adam = "1bit-adam auto (cap 75%), transient end 2.5, lr 2e-3"
    rows = convergence.plan(["b512", "b1024"], seeds=["b512:3", "b1024:3"],
                            sweep=["b512@2", "b1024", "b1024:onebitadam@3"])
    swept = {(r.preset, r.variant, r.seed) for r in rows if r.swept}
    default_rule = ["lamb", "1bit-lamb auto (cap 75%), transient end 2.5", adam]
    # b512: every optimizer at the first two seeds, the rule before's rows only at the first
    assert {v for p, v, s in swept if p == "b512" and s == 1234} == set(default_rule) | {
        "1bit-lamb auto (cap 75%)", "1bit-adam auto (cap 75%), lr 1e-3"}
    assert {v for p, v, s in swept if p == "b512" and s != 1234} == set(default_rule)
    assert {s for p, v, s in swept if p == "b512"} == {1234, 1235}
    # b1024: every optimizer at the first seed, 1-bit Adam at all three
    assert {(v, s) for p, v, s in swept if p == "b1024" and s != 1234} == {(adam, 1235), (adam, 1236)}
    assert {v for p, v, s in swept if p == "b1024" and s == 1234} == set(default_rule) | {
        "1bit-lamb auto (cap 75%)", "1bit-adam auto (cap 75%), lr 2e-3"}
    # a sweep at more seeds than the preset runs is refused, naming it
    with pytest.raises(ValueError, match=r"b512 at \{'onebitadam': 3\} seeds"):
        convergence.plan(["b512"], seeds=["b512:2"], sweep=["b512:onebitadam@3"])


def test_seeds_repeat_the_seeded_rows_at_new_seeds():
    default = convergence.plan(["b1024"])
    assert {r.seed for r in default} == {1234} == {_parses(r.optimizer, r.flags).seed for r in default}
    rows = convergence.plan(["b1024", "demo"], seeds=["b1024:3"])
    extra = [r for r in rows if r.seed != 1234]
    assert len(rows) == len(default) + len(convergence.plan(["demo"])) + 2 * len(convergence.SEEDED["b1024"])
    assert {(r.variant, r.seed) for r in extra} == {(v, s) for v in convergence.SEEDED["b1024"] for s in (1235, 1236)}
    assert len({r.label for r in rows if r.preset == "b1024"}) == len([r for r in rows if r.preset == "b1024"])
    assert convergence.plan(["b1024"], seeds=["b1024:1"]) == default
    # past the seeds it ran at, the rule before's row stops following --seeds; the others go on
    before = "1bit-lamb auto (cap 75%)"
    assert before in convergence.SEEDED["demo"] and convergence.SEEDS_OF_THE_RULE_BEFORE["demo"] == 4
    six = convergence.plan(["demo"], seeds=["demo:6"])
    assert sorted(r.seed for r in six if r.variant == before) == [1234, 1235, 1236, 1237]
    assert sorted(r.seed for r in six if r.variant == "lamb") == [1234, 1235, 1236, 1237, 1238, 1239]
    assert sorted(r.seed for r in convergence.plan(["b512"], seeds=["b512:2"]) if r.variant == before) == [1234]
    # 1-bit Adam's default-rule row follows --seeds on every preset
    adam = "1bit-adam auto (cap 75%), transient end 2.5, lr 2e-3"
    both = convergence.plan(["b512", "b1024"], seeds=["b512:3", "b1024:2"])
    assert sorted(r.seed for r in both if r.variant == adam and r.preset == "b512") == [1234, 1235, 1236]
    assert sorted(r.seed for r in both if r.variant == adam and r.preset == "b1024") == [1234, 1235]
    for bad in (["b1024"], ["b1024:0"], ["b999:2"], ["b1024:x"]):
        with pytest.raises(ValueError, match="invalid seeds"):
            convergence.plan(["b1024"], seeds=bad)


def test_rate_labels():
    assert [convergence.format_rate(r) for r in (0.02, 0.01, 5e-4, 0.004, 0.16)] == ["2e-2", "1e-2", "5e-4", "4e-3",
                                                                                      "1.6e-1"]
    label, flags = convergence.with_rate("1bit-adam auto (cap 75%), lr 2e-3", ["--steps", "9", "--lr", "2e-3"], 1e-3)
    assert label == "1bit-adam auto (cap 75%), lr 1e-3" and flags == ["--steps", "9", "--lr", "1e-3"]
    # a seeded row keeps its seed last, in the label (and so the run folder) and in the flags
    label, flags = convergence.with_rate("lamb, seed 1235", ["--steps", "9", "--seed", "1235"], 1e-2)
    assert label == "lamb, lr 1e-2, seed 1235" and flags == ["--steps", "9", "--lr", "1e-2", "--seed", "1235"]
    label, flags = convergence.with_rate("1bit-adam auto, lr 2e-3, seed 1236",
                                         ["--lr", "2e-3", "--seed", "1236"], 4e-3)
    assert label == "1bit-adam auto, lr 4e-3, seed 1236" and flags == ["--lr", "4e-3", "--seed", "1236"]
    assert convergence.folder_name(label) == "1bit-adam_auto_lr_4e-3_seed_1236"


@pytest.mark.parametrize("best_rate, expected", [
    (2e-2, [1e-2, 2e-2, 4e-2]),                    # best in the middle: three runs
    (5e-2, [1e-2, 2e-2, 4e-2, 8e-2]),              # best at the top edge: one more above
    (1e-3, [2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2]),     # keeps going down, at most five rates
    (None, [5e-3, 1e-2, 2e-2, 4e-2]),              # NaN above 2e-2 counts as the worst; best 1e-2
])
def test_sweep_goes_outwards_while_the_best_is_at_an_edge(best_rate, expected):
    ran = []

    def loss_at(rate):
        ran.append(rate)
        if best_rate is None:
            return math.nan if rate > 2e-2 else 5.0 + abs(math.log(rate / 1e-2))
        return (math.log(rate) - math.log(best_rate)) ** 2

    rates = convergence.sweep_rates(2e-2, loss_at)
    assert rates == pytest.approx(expected)
    assert len(set(ran)) == len(expected)  # the caller caches; the sweep asks only for the rates it lists


def test_sweep_table_compares_best_against_best_at_the_same_seed():
    def row(label, sweep, rate, loss, seed=1234):
        return {"preset": "b512", "label": label, "flags": [], "loss": loss, "freeze": None, "bytes": 100,
                "sweep": sweep, "rate": rate, "seed": seed, "variant": sweep}

    results = [row("lamb", "lamb", 2e-2, 5.0), row("lamb, lr 1e-2", "lamb", 1e-2, 4.0),
               row("lamb, lr 4e-2", "lamb", 4e-2, math.nan), row("1bit", "1bit", 2e-2, 4.4),
               row("1bit, lr 1e-2", "1bit", 1e-2, 4.6),
               row("lamb, seed 1235", "lamb", 2e-2, 5.5, 1235), row("lamb, lr 1e-2, seed 1235", "lamb", 1e-2, 6.0, 1235),
               row("1bit, seed 1235", "1bit", 2e-2, 4.95, 1235), row("1bit, lr 4e-2, seed 1235", "1bit", 4e-2, 6.0, 1235),
               row("adam, seed 1235", "adam", 2e-3, 4.4, 1235)]
    table = convergence.render(results, "cmd")
    assert "| b512 | lamb | 1234 | 1e-2: 4.000, 2e-2: 5.000, 4e-2: NaN | 1e-2 | 4.000 | - |" in table
    assert "| b512 | 1bit | 1234 | 1e-2: 4.600, 2e-2: 4.400 | 2e-2 | 4.400 | +10.0% |" in table
    # at seed 1235 against LAMB's best there (5.5), not at the first seed
    assert "| b512 | 1bit | 1235 | 2e-2: 4.950, 4e-2: 6.000 | 2e-2 | 4.950 | -10.0% |" in table
    assert "| b512 | adam | 1235 | 2e-3: 4.400 | 2e-3 | 4.400 | -20.0% |" in table


def test_table_gap_volume_and_divergence():
    results = [
        {"preset": "b512", "label": "lamb", "flags": [], "loss": 5.0, "freeze": None, "bytes": 3200},
        {"preset": "b512", "label": "1bit", "flags": ["--freeze-frac", "0.2"], "loss": 5.5, "freeze": 26,
         "bytes": 1000},
        {"preset": "b512", "label": "bad", "flags": [], "loss": math.nan, "freeze": None, "bytes": 0},
    ]
    table = convergence.render(results, "cmd")
    assert "| b512 | 1bit | `--freeze-frac 0.2` | 26 | 5.500 | +10.0% | 3.20x less |" in table
    assert "diverged (NaN)" in table


def test_seed_table_pairs_each_run_with_lamb_at_its_seed():
    def row(variant, seed, loss):
        label = variant if seed == 1234 else f"{variant}, seed {seed}"
        return {"preset": "b1024", "label": label, "flags": [], "loss": loss, "freeze": None, "bytes": 100,
                "variant": variant, "seed": seed}

    results = [row("lamb", 1234, 5.0), row("auto", 1234, 5.5), row("lamb", 1235, 4.0), row("auto", 1235, 4.0)]
    table = convergence.render(results, "cmd")
    assert "| b1024 | auto, seed 1235 | `` | - | 4.000 | +0.0% | - |" in table  # against LAMB at 1235
    assert "| b1024 | auto | 1234: 5.500, 1235: 4.000 | 4.750 | +10.0%, +0.0% | +5.0% |" in table
    assert "| b1024 | lamb | 1234: 5.000, 1235: 4.000 | 4.500 | - | - |" in table


def test_a_diverged_run_is_recorded_and_not_rerun(tmp_path, monkeypatch):
    from onebitlamb.comm.launch import WorkerError
    from onebitlamb.train import pretrain

    calls = []

    def diverging(cfg):
        calls.append(cfg.out)
        raise WorkerError("rank 1 raised:\nFloatingPointError: the momentum holds NaN or inf")

    monkeypatch.setattr(pretrain, "train", diverging)
    first = convergence.run_one(str(tmp_path / "run"), "lamb", ["--steps", "4"], str(tmp_path / "cache"))
    again = convergence.run_one(str(tmp_path / "run"), "lamb", ["--steps", "4"], str(tmp_path / "cache"))
    assert len(calls) == 1 and math.isnan(first["final_eval_loss"]) and math.isnan(again["final_eval_loss"])
    assert "NaN or inf" in again["diverged"]

    def failing(cfg):
        raise WorkerError("rank 0 raised:\nValueError: something else")

    monkeypatch.setattr(pretrain, "train", failing)
    with pytest.raises(WorkerError, match="something else"):  # only a divergence counts as a result
        convergence.run_one(str(tmp_path / "other"), "lamb", ["--steps", "4"], str(tmp_path / "cache"))


def test_a_finished_run_is_reused_only_with_the_same_settings(tmp_path, monkeypatch):
    import dataclasses
    import json

    from onebitlamb.train import pretrain

    def fake_train(cfg):  # what the main job leaves behind, without the hours of training
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
            json.dump({"final_eval_loss": 4.5, "config": dataclasses.asdict(cfg)}, f)
        return {"completed": True}

    monkeypatch.setattr(pretrain, "train", fake_train)
    folder, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    assert convergence.run_one(folder, "onebitadam", ["--lr", "1e-3"], cache)["final_eval_loss"] == 4.5
    monkeypatch.setattr(pretrain, "train", None)  # from here on nothing may train
    assert convergence.run_one(folder, "onebitadam", ["--lr", "1e-3"], cache)["final_eval_loss"] == 4.5
    with pytest.raises(ValueError, match=r"other settings.*'lr': \(0.001, 0.002\)"):
        convergence.run_one(folder, "onebitadam", ["--lr", "2e-3"], cache)


def test_an_interrupted_run_goes_on_from_its_checkpoint_and_the_plan_says_where_each_run_stands(
        tmp_path, monkeypatch, capsys):
    import dataclasses
    import json

    from onebitlamb.train import pretrain

    resumed = []

    def stopped_at_step_50(cfg):  # what an interrupted main job leaves: a checkpoint, no metrics
        resumed.append(cfg.resume)
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, "checkpoint.json"), "w") as f:
            json.dump({"folder": "ckpt-0000050", "step": 50}, f)
        return {"completed": False, "interrupted": True, "step": 50}

    def finishing(cfg):
        resumed.append(cfg.resume)
        with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
            json.dump({"final_eval_loss": 4.5, "wall_time_s": 600.0, "config": dataclasses.asdict(cfg)}, f)
        return {"completed": True}

    out, cache = str(tmp_path / "runs"), str(tmp_path / "cache")
    row = convergence.Row("b512", "lamb", "lamb", ["--steps", "400"], "lamb")
    folder = convergence.row_folder(out, row)
    assert folder == os.path.join(out, "b512", "lamb")
    monkeypatch.setattr(pretrain, "train", stopped_at_step_50)
    with pytest.raises(RuntimeError, match="stopped before its end; the same command goes on"):
        convergence.run_one(folder, row.optimizer, row.flags, cache)
    assert convergence.run_status(folder, row.optimizer, row.flags) == "from step 50"
    monkeypatch.setattr(pretrain, "train", finishing)
    assert convergence.run_one(folder, row.optimizer, row.flags, cache)["final_eval_loss"] == 4.5
    assert resumed == [False, True]  # a fresh folder starts from scratch; a checkpoint is gone on from

    other = row._replace(label="lamb, seed 1235", flags=["--steps", "400", "--seed", "1235"])
    changed = row._replace(label="lamb, lr 1e-2", flags=["--steps", "400", "--lr", "1e-2"])
    os.makedirs(convergence.row_folder(out, changed))
    with open(os.path.join(folder, "metrics.json")) as f:
        saved = json.load(f)  # lr 1e-2 asked for, a run at the preset's rate found
    with open(os.path.join(convergence.row_folder(out, changed), "metrics.json"), "w") as f:
        json.dump(saved, f)
    capsys.readouterr()
    convergence.print_plan([row, other, changed], out)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines[:3]] == ["finished", "to run", "other settings"]
    assert lines[1].endswith("onebitlamb pretrain --preset demo --optimizer lamb --steps 400 --seed 1235")
    # two runs left at the one finished run's 600 s: 1200 s
    assert lines[3] == "3 runs, 1 finished, 2 to run: about 0.3 h at the finished runs' mean of 10 min"


def test_freeze_steps_run_plain_1bit_lamb_at_each_step_and_seed():
    rows = convergence.plan(["b1024"], seeds=["b1024:2"], freeze_steps=["b1024:86,72"])
    scan = [r for r in rows if r.variant.startswith(convergence.FREEZE_STEP_VARIANT)]
    assert [(r.label, r.seed) for r in scan] == [("1bit-lamb freeze step 72", 1234), ("1bit-lamb freeze step 86", 1234),
                                                 ("1bit-lamb freeze step 72, seed 1235", 1235),
                                                 ("1bit-lamb freeze step 86, seed 1235", 1235)]
    for row in scan:
        cfg = _parses(row.optimizer, row.flags)
        assert not cfg.auto_freeze and cfg.seed == row.seed and cfg.steps == 400
        assert cfg.freeze_step == int(row.variant.split()[-1])
    # every step of a long run maps back to itself through the main job's freeze_frac
    for step in range(1, 400):
        _, optimizer, flags = convergence.freeze_step_variant(step, 400)
        assert _parses(optimizer, convergence.PRESETS["b1024"] + flags).freeze_step == step
    # which rows the freeze-step table takes: 1-bit LAMB frozen by hand at its own rate and options
    plain = {r.label for r in rows if convergence.is_plain_freeze(r)}
    assert plain == {r.label for r in scan} | {"1bit-lamb freeze 20%", "1bit-lamb freeze 35%", "1bit-lamb freeze 19.75%",
                                               "1bit-lamb freeze 20%, seed 1235"}
    assert not any(convergence.is_plain_freeze(r) for r in convergence.plan(["b512"]) if "update space" in r.label)
    # "@N": the scan at the first N seeds only, whatever --seeds adds
    three = convergence.plan(["b1024"], seeds=["b1024:3"], freeze_steps=["b1024:86,72@2"])
    assert ([(r.label, r.seed) for r in three if r.variant.startswith(convergence.FREEZE_STEP_VARIANT)]
            == [(r.label, r.seed) for r in scan])
    assert {r.seed for r in three} == {1234, 1235, 1236}
    assert convergence.plan(["b1024"], seeds=["b1024:2"], freeze_steps=["b1024:86,72@5"]) == rows
    for bad in (["b1024"], ["b1024:0"], ["b1024:7x"], ["b999:5"], ["b1024:400"], ["b1024:72@0"], ["b1024:72@"],
                ["b1024:72@x"]):
        with pytest.raises(ValueError, match="invalid freeze steps"):
            convergence.plan(["b1024"], freeze_steps=bad)


def test_freeze_step_table_sets_fixed_freezes_beside_auto_per_seed():
    def row(variant, seed, loss, freeze=None, plain=False):
        label = variant if seed == 1234 else f"{variant}, seed {seed}"
        return {"preset": "b1024", "label": label, "flags": [], "loss": loss, "freeze": freeze, "bytes": 100,
                "variant": variant, "seed": seed, "plain_freeze": plain}

    default_rule = "1bit-lamb auto (cap 75%), transient end 2.5"
    results = [row("lamb", 1234, 5.0), row("lamb", 1235, 4.0),
               row("1bit-lamb auto (cap 75%)", 1234, 4.5, freeze=79), row("1bit-lamb auto (cap 75%)", 1235, 4.2, 83),
               row(default_rule, 1234, 4.0, freeze=93), row(default_rule, 1235, 4.8, 97),
               row("1bit-lamb freeze 20%", 1234, 5.5, 80, True), row("1bit-lamb freeze 20%", 1235, 4.4, 80, True),
               row("1bit-lamb freeze step 72", 1234, 6.0, 72, True),
               row("1bit-lamb freeze step 72", 1235, math.nan, 72, True),
               row("1bit-lamb freeze 35%", 1234, 4.75, 140, True),
               # a seed the scan did not run at: the seed table's, not this one's
               row("lamb", 1236, 4.0), row("1bit-lamb freeze 20%", 1236, 4.2, 80, True),
               row(default_rule, 1236, 4.1, 99)]
    table = convergence.render(results, "cmd")
    assert "| preset | freeze | seed 1234 | seed 1235 | mean gap |" in table
    assert "| b1024 | step 72 | 6.000 (+20.0%) | NaN | - |" in table  # a diverged run has no mean
    assert "| b1024 | step 80 | 5.500 (+10.0%) | 4.400 (+10.0%) | +10.0% |" in table
    assert "| b1024 | step 140 | 4.750 (-5.0%) | - | - |" in table
    assert "| b1024 | auto | step 93: 4.000 (-20.0%) | step 97: 4.800 (+20.0%) | +0.0% |" in table
    assert "| b1024 | auto, rule before | step 79: 4.500 (-10.0%) | step 83: 4.200 (+5.0%) | -2.5% |" in table
    lines = table.splitlines()
    assert lines.index("| b1024 | step 72 | 6.000 (+20.0%) | NaN | - |") < lines.index(
        "| b1024 | step 140 | 4.750 (-5.0%) | - | - |") < lines.index(
        "| b1024 | auto | step 93: 4.000 (-20.0%) | step 97: 4.800 (+20.0%) | +0.0% |") < lines.index(
        "| b1024 | auto, rule before | step 79: 4.500 (-10.0%) | step 83: 4.200 (+5.0%) | -2.5% |")
    # the scanned steps stay out of the seed table, the seeded rows do not
    assert "| b1024 | 1bit-lamb freeze step 72 | 1234:" not in table
    assert ("| b1024 | 1bit-lamb freeze 20% | 1234: 5.500, 1235: 4.400, 1236: 4.200 | 4.700 | +10.0%, +10.0%, +5.0% "
            "| +8.3% |") in table


def test_auto_is_set_against_the_hand_picked_freeze_seed_by_seed():
    def row(variant, seed, loss):
        label = variant if seed == 1234 else f"{variant}, seed {seed}"
        return {"preset": "demo", "label": label, "flags": [], "loss": loss, "freeze": None, "bytes": 100,
                "variant": variant, "seed": seed}

    auto, picked = convergence.SEEDED["demo"][:2]
    results = [row("lamb", s, 5.0) for s in (1234, 1235, 1236)]
    results += [row(auto, 1234, 4.4), row(picked, 1234, 4.0), row(auto, 1235, 4.0), row(picked, 1235, 5.0),
                row(auto, 1236, 5.0), row(picked, 1236, 5.0)]
    table = convergence.render(results, "cmd")
    assert f"| demo | {auto} | {picked} | 1234: +10.0%, 1235: -20.0%, 1236: +0.0% | -3.3% ± 8.8 | 2 of 3 |" in table
    # a diverged run loses its seed and leaves no mean
    results[3] = row(auto, 1234, math.nan)
    assert f"| demo | {auto} | {picked} | 1234: auto diverged, 1235: -20.0%, 1236: +0.0% | - | 2 of 3 |" in convergence.render(
        results, "cmd")
    results[3], results[4] = row(auto, 1234, 4.4), row(picked, 1234, math.nan)
    assert f"| demo | {auto} | {picked} | 1234: hand-picked diverged, 1235: -20.0%, 1236: +0.0% | - | 3 of 3 |" in (
        convergence.render(results, "cmd"))
    # one seed is the main table's business, not this one's
    assert "auto vs it per seed" not in convergence.render(results[:3] + results[3:5], "cmd")
    # the rule before gets its own row where it ran at two seeds or more
    results[4] = row(picked, 1234, 4.0)
    before = convergence.SEEDED["demo"][3]
    assert before == "1bit-lamb auto (cap 75%)"
    assert f"| demo | {before} | {picked} |" not in convergence.render(results + [row(before, 1234, 4.0)], "cmd")
    with_before = convergence.render(results + [row(before, 1234, 4.0), row(before, 1235, 4.5)], "cmd")
    assert f"| demo | {before} | {picked} | 1234: +0.0%, 1235: -10.0% | -5.0% ± 5.0 | 2 of 2 |" in with_before


def _student_t_tail(t: float, dof: int, pieces: int = 20000) -> float:
    """P(T > t) for Student's t with ``dof`` degrees of freedom, by Simpson's rule on the density after
    the substitution x = t / u (so that the infinite tail becomes (0, 1])."""
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def integrand(u: float) -> float:  # density at t / u, times |dx/du| = t / u^2
        if u == 0.0:
            return 0.0
        x = t / u
        return math.exp(log_norm - (dof + 1) / 2 * math.log1p(x * x / dof)) * t / (u * u)

    h = 1.0 / pieces
    total = integrand(0.0) + integrand(1.0)
    total += sum((4 if k % 2 else 2) * integrand(k * h) for k in range(1, pieces))
    return total * h / 3


def test_settling_factor_is_students_t_at_95_percent_two_sided():
    from onebitlamb.benchmarks.convergence import settling_factor

    for count in range(2, 32):
        factor, dof = settling_factor(count), min(count - 1, 30)
        # the table's three decimals bracket the true quantile
        assert _student_t_tail(factor - 0.001, dof) > 0.025 > _student_t_tail(factor + 0.001, dof), count
    assert settling_factor(100) == settling_factor(31)  # the value at 30 degrees of freedom: a little strict
    assert _student_t_tail(2.0, 3) > 0.06  # why not two errors: at four seeds that is a two-sided p above 0.12
    with pytest.raises(ValueError, match="got 1"):
        settling_factor(1)
