"""The freeze trade-off benchmark's parsing, table and plot, on hand-made run records (no training)."""
import pytest

from onebitlamb.benchmarks import convergence
from onebitlamb.benchmarks import freeze_tradeoff as ft
from onebitlamb.benchmarks.convergence import (_AUTO_TRUST_PEAK, AUTO_TRUST_PEAK_LEVEL, AUTO_TRUST_PEAK_UNCLIPPED, PRESETS,
                                               pretrain_config)


def _run(loss, megabytes, freeze):
    return {"final_eval_loss": loss, "bytes_sent_per_rank": megabytes * 1e6, "freeze_step": freeze}


def test_parse_fractions():
    assert ft.parse_fractions("0.35,0.3,0.35") == [0.3, 0.35]
    assert ft.parse_fractions("none") == []
    for bad in ("", "x", "0", "1", "0.3,1.2", "-0.1"):
        with pytest.raises(ValueError, match="invalid fractions"):
            ft.parse_fractions(bad)


def test_fraction_variants_freeze_at_their_step_and_share_the_study_folder():
    """35% is the study's own variant (its run folder is shared); 30% and 40% freeze at round(f x 512)."""
    assert ft.fraction_variant(0.35) == ("1bit-lamb freeze 35%", "onebitlamb", ["--freeze-frac", "0.35"])
    steps = {}
    for fraction in (0.3, 0.35, 0.4):
        name, optimizer, flags = ft.fraction_variant(fraction)
        steps[name] = pretrain_config(optimizer, PRESETS["demo"] + flags).freeze_step
    assert steps == {"1bit-lamb freeze 30%": 154, "1bit-lamb freeze 35%": 179, "1bit-lamb freeze 40%": 205}


def _two_seeds():
    """Seed 1: the automatic freeze 4.0 at 30 MB; 30% 4.1 (auto -2.4%), 35% 3.96 (+1.0%), 40% 3.98 (+0.5%);
    the unclipped one 3.92 at 36 MB (-2.0% against the automatic freeze).
    Seed 2: the automatic freeze 5.0 at 25 MB; 30% 5.0 (+0.0%), 35% 4.9 (+2.0%), 40% diverged;
    the unclipped one 4.95 at 34 MB (-1.0%)."""
    return {
        ("demo", AUTO_TRUST_PEAK_UNCLIPPED, 1): _run(3.92, 36, 180),
        ("demo", AUTO_TRUST_PEAK_UNCLIPPED, 2): _run(4.95, 34, 175),
        ("demo", _AUTO_TRUST_PEAK, 1): _run(4.0, 30, 150),
        ("demo", "1bit-lamb freeze 30%", 1): _run(4.1, 31, 154),
        ("demo", "1bit-lamb freeze 35%", 1): _run(3.96, 35, 179),
        ("demo", "1bit-lamb freeze 40%", 1): _run(3.98, 40, 205),
        ("demo", _AUTO_TRUST_PEAK, 2): _run(5.0, 25, 120),
        ("demo", "1bit-lamb freeze 30%", 2): _run(5.0, 31, 154),
        ("demo", "1bit-lamb freeze 35%", 2): _run(4.9, 35, 179),
        ("demo", "1bit-lamb freeze 40%", 2): _run(float("nan"), 0, None),
    }


def test_render_rows_and_summary():
    text = ft.render(_two_seeds(), [("demo", 1), ("demo", 2)], [0.3, 0.35, 0.4], "cmd")
    assert ("| demo | 1 | 150, 4.000, 30.0 MB | 180, 3.920, 36.0 MB | 154, 4.100, 31.0 MB; -2.4% "
            "| 179, 3.960, 35.0 MB; +1.0% | 205, 3.980, 40.0 MB; +0.5% | -2.0% | 35% |") in text
    assert ("| demo | 2 | 120, 5.000, 25.0 MB | 175, 4.950, 34.0 MB | 154, 5.000, 31.0 MB; +0.0% "
            "| 179, 4.900, 35.0 MB; +2.0% | diverged | -1.0% | 35% |") in text
    assert "- `demo`: the automatic freeze with the 5% floor came at steps 120-150 of 512 (mean 135, 26% of the steps)" in text
    assert "- `demo`: the unclipped one came at steps 175-180 of 512 (mean 178, 35% of the steps)" in text
    # -2.44 and 0: mean -1.22, standard error 1.22, Student's t at 2 seeds 12.706: -1.22 ± 15.50;
    # bytes 30/31 and 25/31: 0.89x
    assert ("- `demo`, the automatic freeze with the 5% floor against the 30% over 2 seeds: mean -1.2% ± 1.2 (standard error; within "
            "the seeds' spread), no worse at 2, at 95% between -16.7% and +14.3%; it sent 0.89x the bytes") in text
    # the diverged 40% at seed 2 leaves one seed: +0.5%, and 30/40 of the bytes
    assert ("- `demo`, the automatic freeze with the 5% floor against the 40% over 1 seed: +0.5%, no worse at 0; it sent 0.75x the "
            "bytes") in text
    # -2.0 and -1.0: mean -1.5, standard error 0.5, at 2 seeds -1.5 ± 6.35; bytes 36/30 and 34/25: 1.28x
    assert ("- `demo`, the unclipped one against the automatic freeze with the 5% floor over 2 seeds: mean -1.5% ± 0.5 (standard "
            "error; within the seeds' spread), no worse at 2, at 95% between -7.9% and +4.9%; it sent 1.28x the "
            "bytes") in text
    # the best of the three in hindsight only where all three ran: seed 1, against 3.96
    assert "- `demo`, the automatic freeze with the 5% floor against the best of the fractions at each seed (picked in hindsight) " \
           "over 1 seed: +1.0%" in text
    assert "- `demo`, the unclipped one against the best of the fractions at each seed (picked in hindsight) " \
           "over 1 seed: -1.0%" in text


def test_render_marks_a_missing_automatic_freeze():
    results = _two_seeds()
    del results[("demo", _AUTO_TRUST_PEAK, 2)]
    text = ft.render(results, [("demo", 2)], [0.3, 0.35], "cmd")
    assert "| demo | 2 | not run | 175, 4.950, 34.0 MB | 154, 5.000, 31.0 MB | 179, 4.900, 35.0 MB | - | 35% |" in text
    assert "with the 5% floor against" not in text and "against the automatic freeze" not in text


def test_main_runs_seed_by_seed_and_writes_its_section_and_plot(monkeypatch, tmp_path):
    ran = []
    records = _two_seeds()
    by_folder = {"unclipped": AUTO_TRUST_PEAK_UNCLIPPED, "auto": _AUTO_TRUST_PEAK, "freeze_30pct": "1bit-lamb freeze 30%",
                 "freeze_35pct": "1bit-lamb freeze 35%", "freeze_40pct": "1bit-lamb freeze 40%"}

    def fake_run_one(out_dir, optimizer, flags, cache):
        ran.append(out_dir.split("/")[-1])
        variant = next(v for key, v in by_folder.items() if key in out_dir)
        return records[("demo", variant, int(flags[-1]) - 1237)]

    monkeypatch.setattr(convergence, "run_one", fake_run_one)
    results, picture = tmp_path / "B.md", tmp_path / "tradeoff.png"
    assert ft.main(["--runs", "demo:1238,1239", "--fractions", "0.3,0.35,0.4", "--out", str(tmp_path / "runs"), "--results", str(results),
                    "--plot", str(picture)]) == 0
    assert ran == [f"1bit-lamb_{run}_seed_{seed}" for seed in (1238, 1239)
                   for run in ("auto_cap_75pct_transient_end_2.5_after_trust_peak",
                               "auto_cap_75pct_transient_end_2.5_after_unclipped_trust_peak", "freeze_30pct",
                               "freeze_35pct", "freeze_40pct")]
    text = results.read_text()
    assert text.index("<!-- begin freeze trade-off -->") < text.index("| demo | 1238 | 150, 4.000, 30.0 MB") \
        < text.index(f"Plot: `{picture}`.") < text.index("<!-- end freeze trade-off -->")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        ft.main(["--fractions", "0.3,1.5", "--out", str(tmp_path / "runs"), "--results", str(results)])


def test_the_plot_is_named_from_the_repository_root_when_inside_it(tmp_path):
    assert ft._shown(str(ft.REPO / "docs" / "tradeoff.png")) == "docs/tradeoff.png"  # no machine path in the results
    assert ft._shown(str(tmp_path / "t.png")) == str(tmp_path / "t.png")


def test_plot_needs_a_seed_with_every_run(tmp_path):
    picture = tmp_path / "none.png"
    # seed 2's 40% diverged: no seed is complete
    assert not ft.plot(_two_seeds(), [("demo", 2)], [0.3, 0.35, 0.4], str(picture))
    assert not picture.exists()


def test_render_sets_the_chosen_automatic_freezes_beside_the_default():
    """--automatic median_level: its column and its line against the default, and no unclipped one.
    Seed 1: the median-level one 3.9 at 33 MB against the default's 4.0 at 30 MB: -2.5%, 1.10x the bytes."""
    results = {**_two_seeds(), ("demo", AUTO_TRUST_PEAK_LEVEL, 1): _run(3.9, 33, 170)}
    text = ft.render(results, [("demo", 1)], [0.3, 0.35], "cmd", [ft.OTHERS["median_level"]])
    assert ("| preset | seed | automatic, 5% floor | automatic, median level | 30% | 35% | median level vs 5% floor "
            "| best fraction |") in text
    assert ("| demo | 1 | 150, 4.000, 30.0 MB | 170, 3.900, 33.0 MB | 154, 4.100, 31.0 MB; -2.4% "
            "| 179, 3.960, 35.0 MB; +1.0% | -2.5% | 35% |") in text
    assert "--trust-peak-measure median_level" in text and "unclipped" not in text
    assert ("- `demo`, the median-level one against the automatic freeze with the 5% floor over 1 seed: -2.5%, no worse at 1; it sent "
            "1.10x the bytes") in text
    # 3.9 against the 30%'s 4.1: -4.9%; against the better fraction (the 35%'s 3.96): -1.5%
    assert "- `demo`, the median-level one against the 30% over 1 seed: -4.9%" in text
    assert "- `demo`, the median-level one against the best of the fractions at each seed (picked in hindsight) " \
           "over 1 seed: -1.5%" in text
    alone = ft.render(results, [("demo", 1)], [0.3, 0.35], "cmd", [])
    assert "| demo | 1 | 150, 4.000, 30.0 MB | 154, 4.100, 31.0 MB; -2.4% | 179, 3.960, 35.0 MB; +1.0% | 35% |" in alone
    assert "The last column: the fraction with the lowest loss at that seed." in alone


def test_main_runs_the_chosen_automatic_freezes(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(convergence, "run_one", lambda out_dir, *_: ran.append(out_dir.split("/")[-1]) or
                        _run(4.0, 30, 150))
    assert ft.main(["--runs", "demo:1238", "--fractions", "0.3", "--automatic", "median_level", "--out",
                    str(tmp_path / "runs"), "--results", str(tmp_path / "B.md"), "--plot", str(tmp_path / "t.png")]) == 0
    assert ran == ["1bit-lamb_auto_cap_75pct_transient_end_2.5_after_trust_peak_seed_1238",
                   "1bit-lamb_auto_cap_75pct_transient_end_2.5_after_trust_peak_median_level_seed_1238",
                   "1bit-lamb_freeze_30pct_seed_1238"]
    with pytest.raises(SystemExit):
        ft.main(["--automatic", "mean", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "B.md")])


def test_without_fractions_the_automatic_freezes_stand_alone(monkeypatch, tmp_path):
    """--fractions none: the default and the chosen automatic freezes, their comparison, no fraction's column
    and no plot (it draws against a fraction). Seed 1: the median-level one 3.9 at 33 MB, the default 4.0 at
    30 MB: -2.5%, 1.10x the bytes."""
    results = {**_two_seeds(), ("demo", AUTO_TRUST_PEAK_LEVEL, 1): _run(3.9, 33, 170)}
    text = ft.render(results, [("demo", 1)], [], "cmd", [ft.OTHERS["median_level"]])
    assert "| preset | seed | automatic, 5% floor | automatic, median level | median level vs 5% floor |\n" in text
    assert "| demo | 1 | 150, 4.000, 30.0 MB | 170, 3.900, 33.0 MB | -2.5% |\n" in text
    assert "The last column: median level against the 5% floor." in text
    assert text.startswith("## Loss against bytes: the automatic freezes\n")
    assert "fraction" not in text and "by hand" not in text
    assert ("- `demo`, the median-level one against the automatic freeze with the 5% floor over 1 seed: -2.5%, no worse at 1; it sent "
            "1.10x the bytes") in text
    picture = tmp_path / "none.png"
    assert not ft.plot(results, [("demo", 1)], [], str(picture), [ft.OTHERS["median_level"]])
    assert not picture.exists()

    ran = []
    monkeypatch.setattr(convergence, "run_one", lambda out_dir, *_: ran.append(out_dir.split("/")[-1]) or
                        _run(4.0, 30, 150))
    assert ft.main(["--runs", "b1024:1235", "--fractions", "none", "--automatic", "median_level", "--out",
                    str(tmp_path / "runs"), "--results", str(tmp_path / "B.md"), "--plot", str(picture)]) == 0
    assert ran == ["1bit-lamb_auto_cap_75pct_transient_end_2.5_after_trust_peak_seed_1235",
                   "1bit-lamb_auto_cap_75pct_transient_end_2.5_after_trust_peak_median_level_seed_1235"]
    assert "Plot:" not in (tmp_path / "B.md").read_text() and not picture.exists()


def test_the_floor_is_every_default_and_the_base_is_the_default_before_it():
    """The 30% floor's row is the main job's 1-bit LAMB with --auto-freeze and nothing else changed
    (the study's cap aside); the base row differs from it in the floor alone, so its saved runs
    stay the default before the floor."""
    import dataclasses

    from onebitlamb.train.pretrain import changed_settings

    every_default = pretrain_config("onebitlamb", ["--auto-freeze", "--freeze-frac", "0.75"])
    floor, base = (pretrain_config(*convergence.VARIANTS[v]) for v in (ft.OTHERS["floor"].variant, ft.BASE.variant))
    assert ft.OTHERS["floor"].variant == convergence.DEFAULT_AUTO
    assert changed_settings(every_default, dataclasses.asdict(floor)) == {}
    assert changed_settings(floor, dataclasses.asdict(base)) == {"min_freeze_frac": (0.05, 0.3)}
