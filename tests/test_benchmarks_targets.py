"""The targets benchmark: which runs it makes, where, and its verdicts on records checkable by hand."""
import math

from onebitlamb.benchmarks import convergence
from onebitlamb.benchmarks import targets as tg
from onebitlamb.benchmarks.convergence import _ADAM, _ADAM_AUTO, DEFAULT_AUTO, DEFAULT_PLAN, plan


def _m(loss, nbytes=100, freeze=None):
    # no evaluations before the end and no diagnostics: the tables' columns for them read "-"
    return {"final_eval_loss": loss, "bytes_sent_per_rank": nbytes, "freeze_step": freeze, "diagnostics": []}


def _results(auto_losses, adam=5.0, hand=4.5, seed=1234, late=4.7):
    """LAMB at 5.0 (400 bytes) everywhere; the automatic freeze at the given losses (100 bytes);
    uncompressed Adam at 5.0 too; b1024's 20% freeze at ``hand``, its 35% at ``late``."""
    out = {}
    for preset, loss in auto_losses.items():
        out[(preset, "lamb", seed)] = _m(5.0, 400)
        out[(preset, DEFAULT_AUTO, seed)] = _m(loss, 100, freeze=30)
    out[("b4096", _ADAM_AUTO, seed)] = _m(adam, freeze=60)
    out[("b4096", _ADAM, seed)] = _m(5.0, 400, freeze=100)
    out[("b1024", tg.HAND_PICKED, seed)] = _m(hand, freeze=80)
    out[("b1024", tg.HAND_PICKED_LATE, seed)] = _m(late, freeze=140)
    return out


def _seed(results, seed, b4096=None, adam=None, plain_adam=None, b1024=None, hand=None, late=4.7):
    """``results`` with b4096's and b1024's runs at one more seed (LAMB at 5.0 again)."""
    for preset, variant, loss in (("b4096", DEFAULT_AUTO, b4096), ("b4096", _ADAM_AUTO, adam), ("b4096", _ADAM, plain_adam),
                                  ("b1024", DEFAULT_AUTO, b1024), ("b1024", tg.HAND_PICKED, hand),
                                  ("b1024", tg.HAND_PICKED_LATE, late if b1024 is not None else None)):
        if loss is not None:
            results[(preset, "lamb", seed)] = _m(5.0, 400)
            results[(preset, variant, seed)] = _m(loss, 100, freeze=70)
    return results


def test_the_runs_are_rows_of_the_study_on_every_preset():
    for row in tg.runs():
        assert row.variant in DEFAULT_PLAN[row.preset]  # so the study and this check share their run folders
        assert row.seed == 1234
    assert {row.preset for row in tg.runs()} == set(DEFAULT_PLAN)
    assert convergence.command(tg.runs()[1]).endswith("--global-batch 512 --steps 128 --eval-every 16 --auto-freeze "
                                             "--freeze-frac 0.75 --freeze-transient-end 2.5 --freeze-after-trust-peak "
                                             "--min-freeze-frac 0.3")


def test_more_seeds_are_the_studys_seeded_rows_after_every_preset_at_the_first():
    seeded = tg.runs({"b4096": 3})
    assert seeded[:12] == tg.runs()
    assert [(r.variant, r.seed) for r in seeded[12:]] == [(v, s) for s in (1235, 1236) for v in tg.CHECKS["b4096"]]
    study = {(r.label, tuple(r.flags)) for r in plan(["b4096"], seeds=["b4096:3"])}
    for row in seeded[12:]:
        assert (row.label, tuple(row.flags)) in study  # the same run folder and flags as the study's --seeds
        assert row.flags[-2:] == ["--seed", str(row.seed)] and row.label.endswith(f", seed {row.seed}")


def test_verdicts_within_one_percent_divergence_and_the_other_targets():
    # 5.05 is exactly 1% above LAMB's 5.0: still within; 5.06 is not; NaN (diverged) is not
    body = tg.render(_results({"b512": 5.05, "demo": 4.9, "b4096": 4.8, "b1024": 4.6}), "cmd")
    assert "| b512 | 5.000 | 30, 5.050, +1.0% | 4.00x | met |" in body
    assert "Within 1% of LAMB with the defaults: met: within on 4 of 4 presets." in body
    assert ("the automatic freeze 4.800 against 1-bit Adam auto (step 60) 5.000, -4.0%: 1-bit LAMB ahead of 1-bit "
            "Adam: met at this one seed") in body
    # 1-bit LAMB -4.0% against 1-bit Adam = LAMB 0.0% against Adam, 1-bit LAMB -4.0% against LAMB, 1-bit Adam
    # +0.0% against Adam
    assert ("Where the order comes from (1 of 1 seeds, none diverged): LAMB against Adam, both uncompressed, "
            "+0.0%; what the compression costs, 1-bit LAMB against LAMB -4.0%, 1-bit Adam auto against Adam "
            "+0.0%; the first cost less the second -4.0 points.") in body
    assert ("the automatic freeze 4.600 against hand-picked 20% (step 80) 4.500, +2.2%: the automatic freeze as "
            "good as the hand-picked 20%: **not met** at this one seed") in body
    assert "at 3 seeds" not in body  # no per-seed tables at one seed
    results = _results({"b512": 5.06, "demo": math.nan, "b4096": 5.2, "b1024": 4.4}, adam=5.1)
    results[("demo", DEFAULT_AUTO, 1234)]["freeze_step"] = 384  # 75% of demo's 512 steps: the cap made this freeze
    body = tg.render(results, "cmd")
    assert "| b512 | 5.000 | 30, 5.060, +1.2% | 4.00x | **not met** |" in body
    assert "| demo | 5.000 | 384 (the cap), NaN, diverged | 4.00x | **not met** |" in body
    assert "Within 1% of LAMB with the defaults: **not met**: within on 1 of 4 presets." in body
    assert "1-bit LAMB ahead of 1-bit Adam: **not met** at this one seed" in body
    assert "as good as the hand-picked 20%: met at this one seed" in body
    body = tg.render(_results({"b512": 5.0, "demo": 5.0, "b4096": 5.0, "b1024": 5.0}, adam=math.nan), "cmd")
    assert "1-bit LAMB ahead of 1-bit Adam: met at this one seed" in body  # 1-bit Adam diverged
    body = tg.render(_results({"b512": 5.0, "demo": 5.0, "b4096": math.nan, "b1024": 5.0}, adam=math.nan), "cmd")
    assert "1-bit LAMB ahead of 1-bit Adam: **not met** at this one seed" in body  # both diverged


def test_more_seeds_judge_by_the_mean_and_its_standard_error():
    results = _results({"b512": 5.0, "demo": 5.0, "b4096": 4.8, "b1024": 4.59}, adam=5.0, hand=4.5)
    _seed(results, 1235, b4096=5.1, adam=5.0, plain_adam=4.0, b1024=4.68, hand=4.5)
    _seed(results, 1236, b4096=5.06, adam=math.nan, plain_adam=5.0, b1024=4.635, hand=4.5)
    body = tg.render(results, "cmd")
    # b4096: -4.0% and +2.0% (mean -1.0, standard deviation 4.24, error 3.0); 1-bit Adam diverged at 1236
    assert "| 1235 | 5.000 | 70, 5.100, +2.0% | 70, 5.000, +0.0% | 4.000, -20.0% | - | +2.0% |" in body
    assert "| 1236 | 5.000 | 70, 5.060, +1.2% | 70, NaN, diverged | 5.000, +0.0% | - | 1-bit Adam auto diverged |" in body
    # at the two seeds none diverged: LAMB against Adam 0% and +25%, the costs -4% and +2%, 0% and +25%; their
    # differences -4 and -23 points (mean -13.5, standard deviation 19 / sqrt(2), error 9.5)
    assert ("Where the order comes from (2 of 3 seeds, none diverged): LAMB against Adam, both uncompressed, mean "
            "+12.5% ± 12.5 (standard error; within the seeds' spread); what the compression costs, 1-bit LAMB "
            "against LAMB mean -1.0% ± 3.0 (standard error; within the seeds' spread), 1-bit Adam auto against "
            "Adam mean +12.5% ± 12.5 (standard error; within the seeds' spread); the first cost less the second "
            "mean -13.5 points ± 9.5") in body
    # ahead on the mean, but by a third of a standard error: not settled
    assert ("1-bit LAMB ahead of 1-bit Adam: **not settled** over 3 seeds: the automatic freeze ahead at 2 of 3, "
            "mean -1.0% ± 3.0 (standard error; within the seeds' spread).") in body
    # b1024: +2.0%, +4.0%, +3.0% (mean +3.0, error 1/sqrt(3) = 0.58: 5.2 errors from 0, past t's 4.30 at two
    # degrees of freedom)
    assert ("as good as the hand-picked 20%: **not met** over 3 seeds: the automatic freeze no worse at 0 of 3, "
            "mean +3.0% ± 0.6 (standard error; the seeds settle it).") in body
    # 5.1 and 5.06 are more than 1% above LAMB's 5.0: the seed-1234 presets alone no longer make it met
    assert ("Within 1% of LAMB with the defaults: **not met**: within on 4 of 4 presets at seed 1234 and on 2 of the 4 "
            "runs at other seeds") in body
    results[("b4096", DEFAULT_AUTO, 1235)]["final_eval_loss"] = math.nan  # a divergence loses, whatever the mean
    assert "1-bit LAMB ahead of 1-bit Adam: **not met** over 3 seeds" in tg.render(results, "cmd")


def test_main_runs_each_check_once_in_the_study_folders_and_writes_its_section(monkeypatch, tmp_path):
    ran = []

    def fake_run_one(out_dir, optimizer, flags, cache):
        ran.append((out_dir, optimizer, list(flags)))
        return _m(4.0 if "auto" in out_dir else 5.0, freeze=7)

    monkeypatch.setattr(convergence, "run_one", fake_run_one)
    results = tmp_path / "B.md"
    assert tg.main(["--out", str(tmp_path / "runs"), "--results", str(results)]) == 0
    assert len(ran) == len(tg.runs()) == 12
    assert ran[1] == (str(tmp_path / "runs" / "b512" / "1bit-lamb_auto_cap_75pct_transient_end_2.5_after_trust_peak_floor_30pct"),
                      "onebitlamb", ["--global-batch", "512", "--steps", "128", "--eval-every", "16", "--auto-freeze",
                                     "--freeze-frac", "0.75", "--freeze-transient-end", "2.5",
                                     "--freeze-after-trust-peak", "--min-freeze-frac", "0.3"])
    text = results.read_text()
    assert "<!-- begin targets -->" in text and "defaults: met: within on 4 of 4 presets" in text
    ran.clear()
    assert tg.main(["--seeds", "b4096:2", "--out", str(tmp_path / "runs"), "--results", str(results)]) == 0
    assert len(ran) == 16 and ran[13][0] == str(tmp_path / "runs" / "b4096" /
                                                "1bit-lamb_auto_cap_75pct_transient_end_2.5_after_trust_peak_floor_30pct_seed_1235")
    assert "`b4096` at 2 seeds" in results.read_text()


def test_ahead_needs_the_seeds_to_settle_it_and_as_good_only_the_mean():
    # b4096: 1-bit LAMB -4.0% and -2.0% against 1-bit Adam (mean -3.0, error 1.0): three errors ahead, which two
    # seeds do not settle (Student's t at one degree of freedom: 12.7 errors)
    # b1024: +4.0% and -2.0% against the 20% (mean +1.0, error 3.0): behind within the spread
    results = _results({"b512": 5.0, "demo": 5.0, "b4096": 4.8, "b1024": 4.68}, adam=5.0, hand=4.5)
    _seed(results, 1235, b4096=4.9, adam=5.0, plain_adam=5.0, b1024=4.41, hand=4.5)
    body = tg.render(results, "cmd")
    assert "1-bit LAMB ahead of 1-bit Adam: **not settled** over 2 seeds" in body and "mean -3.0% ± 1.0" in body
    assert "as good as the hand-picked 20%: **not settled** over 2 seeds" in body and "mean +1.0% ± 3.0" in body
    # b1024 at -2.0% and +1.0% (mean -0.5): as good on average is met without settling anything
    results[("b1024", DEFAULT_AUTO, 1234)]["final_eval_loss"] = 4.545
    assert "as good as the hand-picked 20%: met over 2 seeds" in tg.render(results, "cmd")
    # a third b4096 seed at -3.0%: mean -3.0, error 0.58, 5.2 errors from zero, past t's 4.30 at two degrees
    _seed(results, 1236, b4096=4.85, adam=5.0, plain_adam=5.0, b1024=4.5, hand=4.5)
    body = tg.render(results, "cmd")
    assert "1-bit LAMB ahead of 1-bit Adam: met over 3 seeds" in body and "mean -3.0% ± 0.6" in body


def _trace(final, at_150, at_300, median_steps, frozen_coeff=0.1):
    """A 400-step record of 1-bit LAMB frozen at step 100, evaluated every 150 steps (the last at 300,
    three quarters in) and at the end, diagnosed at steps 100 (the freeze's own, a warm-up step), 250
    and 400 (the rate is 0 there): three layers with relative steps 0.5, the median layer's and 9 times
    the rate and frozen trust ratios 0.01, ``frozen_coeff`` and 0.9, and a key bias with a step of 1000
    times it and a trust ratio of 5."""
    lr = [0.01] * 398 + [0.0, 0.0]  # lr[k]: the rate step k + 2 used
    stage = ["warmup"] * 100 + ["compression"] * 300
    diagnostics = []
    for step, median in zip((100, 250, 400), median_steps):
        rate = lr[step - 2] if lr[step - 2] > 0 else 1.0
        diagnostics.append({"step": step, "layers": [
            {"name": name, "rel_step": size * rate, "frozen_coeff": None if step == 100 else coeff}
            for name, size, coeff in (("a.weight", 0.5, 0.01), ("b.weight", median, frozen_coeff),
                                      ("c.weight", 9.0, 0.9), ("l0.attention.self.key.bias", 1000.0, 5.0))]})
    return {"final_eval_loss": final, "bytes_sent_per_rank": 100, "freeze_step": 100, "samples": 4000,
            "steps": 400, "eval_curve": [[0, 8.0], [1500, at_150], [3000, at_300], [4000, final]],
            "lr": lr, "stage": stage, "diagnostics": diagnostics}


def test_where_the_runs_stood_three_quarters_in_and_their_stage2_steps():
    results = _results({"b512": 5.0, "demo": 5.0, "b4096": 4.8, "b1024": 4.6})
    _seed(results, 1235, b4096=4.8, adam=5.0, plain_adam=5.0, b1024=4.6, hand=4.5)
    # seed 1235: the automatic freeze 2% ahead at step 300 (4.9 against 5.0), 2.2% behind at the end; its
    # stage-2 steps 7 (step 250; step 100 ran the warm-up, step 400 at rate 0), the 20%'s 3
    results[("b1024", DEFAULT_AUTO, 1235)] = _trace(4.6, 5.3, 4.9, (50.0, 7.0, 80.0))
    results[("b1024", tg.HAND_PICKED, 1235)] = _trace(4.5, 5.4, 5.0, (50.0, 3.0, 80.0))
    body = tg.render(results, "cmd")
    assert "| auto vs it at step 300 | stage-2 step: auto / it | auto vs it |" in body
    assert "| 1235 | 5.000 | 100, 4.600, -8.0% | 100, 4.500, -10.0% | -2.0% | 7.0 / 3.0 | +2.2% |" in body
    assert "| 1234 | 5.000 | 30, 4.600, -8.0% | 80, 4.500, -10.0% | - | - / - | +2.2% |" in body
    results[("b1024", tg.HAND_PICKED, 1235)]["eval_curve"][2][1] = math.nan  # diverged before step 300
    assert "| 1235 | 5.000 | 100, 4.600, -8.0% | 100, 4.500, -10.0% | a run diverged | 7.0 / 3.0 |" in tg.render(results, "cmd")
    # 1-bit Adam's steps are not LAMB's: no such column on b4096, and no step where no evaluation came
    assert "| 1235 | 5.000 | 70, 4.800, -4.0% | 70, 5.000, +0.0% | 5.000, +0.0% | - | -4.0% |" in body


def test_b1024_names_the_best_of_its_hand_picked_freezes_by_the_mean_against_lamb():
    # one seed: the 20% at 4.5 (-10.0% against LAMB's 5.0), the 35% at 4.7 (-6.0%): the 20% is the best
    body = tg.render(_results({"b512": 5.0, "demo": 5.0, "b4096": 5.0, "b1024": 4.6}), "cmd")
    assert ("the automatic freeze 4.600 against hand-picked 35% (step 140) 4.700, -2.1%: the automatic freeze as "
            "good as the hand-picked 35%: met at this one seed") in body
    assert ("- `b1024`: the best hand-picked fraction over 1 seed (mean loss against LAMB: hand-picked 20% -10.0%, "
            "hand-picked 35% -6.0%) is the hand-picked 20%") in body
    # a second seed where the 35% is far ahead: means -5.0% (20%: -10% and 0%) against -13.0% (-6% and -20%)
    results = _results({"b512": 5.0, "demo": 5.0, "b4096": 5.0, "b1024": 4.6})
    _seed(results, 1235, b4096=5.0, adam=5.0, plain_adam=5.0, b1024=4.6, hand=5.0, late=4.0)
    body = tg.render(results, "cmd")
    assert "(mean loss against LAMB: hand-picked 20% -5.0%, hand-picked 35% -13.0%) is the hand-picked 35%" in body
    assert "`b1024` at 2 seeds. Last column: the automatic freeze against hand-picked 35%" in body
    # a divergence of the better fraction at one seed puts it last
    results[("b1024", tg.HAND_PICKED_LATE, 1234)]["final_eval_loss"] = math.nan
    assert "hand-picked 35% diverged at a seed) is the hand-picked 20%" in tg.render(results, "cmd")


def test_rank_correlation_by_hand():
    assert tg._ranks([3.0, 1.0, 1.0, 2.0]) == [4.0, 1.5, 1.5, 3.0]  # the tie shares ranks 1 and 2
    rho, p = tg.rank_correlation([1, 2, 3, 4], [40, 30, 20, 10])
    assert rho == -1.0
    assert abs(p - 2 / 24) < 0.01  # 2 of the 24 pairings are perfectly (anti-)ordered
    rho, _ = tg.rank_correlation([1, 2, 3, 4], [1, 3, 2, 4])  # ranks' squared differences 0, 1, 1, 0
    assert abs(rho - (1 - 6 * 2 / (4 * 15))) < 1e-12  # Spearman's formula without ties: 0.8


def test_b1024_relates_the_stage2_step_to_the_loss_over_all_its_1bit_lamb_runs():
    results = _results({"b512": 5.0, "demo": 5.0, "b4096": 5.0, "b1024": 4.6})
    _seed(results, 1235, b4096=5.0, adam=5.0, plain_adam=5.0, b1024=4.6)
    # six runs whose stage-2 steps (1.0 to 7.0, the median of three layers with 0.5 and 9) order their losses
    # exactly the other way round
    for k, (variant, seed) in enumerate([(v, s) for s in (1234, 1235)
                                         for v in (DEFAULT_AUTO, tg.HAND_PICKED, tg.HAND_PICKED_LATE)]):
        # and frozen trust ratios that order them the same way but for the last two, swapped
        coeff = [0.1, 0.2, 0.3, 0.4, 0.6, 0.5][k]
        results[("b1024", variant, seed)] = _trace(4.9 - 0.1 * k, 5.3, 5.0, (50.0, 1.0 + 1.2 * k, 80.0), coeff)
    body = tg.render(results, "cmd")
    assert ("over its 6 1-bit LAMB runs (the automatic freeze and the hand-picked ones, every seed), the stage-2 "
            "step ranges 1.0-7.0 and its rank correlation with the loss against LAMB is -1.00 (permutation p = "
            "0.00") in body
    # Spearman without ties: 1 - 6 * (1 + 1) / (6 * 35) = 0.943 (negated: the losses fall)
    assert ("the median layer's frozen trust ratio ranges 0.100-0.600 and its rank correlation with that loss is "
            "-0.94") in body
    # records without diagnostics (the first tests') give no such line
    assert "larger compressed steps" not in tg.render(_results({"b512": 5.0, "demo": 5.0, "b4096": 5.0,
                                                                 "b1024": 4.6}), "cmd")
