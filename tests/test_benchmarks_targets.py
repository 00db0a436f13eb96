"""The targets benchmark: which runs it makes, where, and its verdicts on records checkable by hand."""
import math

from onebitlamb.benchmarks import targets as tg
from onebitlamb.benchmarks.convergence import _ADAM_AUTO, _AUTO, DEFAULT_PLAN


def _m(loss, nbytes=100, freeze=None):
    return {"final_eval_loss": loss, "bytes_sent_per_rank": nbytes, "freeze_step": freeze}


def _results(auto_losses, adam=5.0, hand=4.5):
    """LAMB at 5.0 (400 bytes) everywhere; the automatic freeze at the given losses (100 bytes)."""
    out = {}
    for preset, loss in auto_losses.items():
        out[(preset, "lamb")] = _m(5.0, 400)
        out[(preset, _AUTO)] = _m(loss, 100, freeze=30)
    out[("b4096", _ADAM_AUTO)] = _m(adam)
    out[("b1024", tg.HAND_PICKED)] = _m(hand, freeze=80)
    return out


def test_the_runs_are_rows_of_the_study_on_every_preset():
    for preset, variant in tg.runs():
        assert variant in DEFAULT_PLAN[preset]  # so the study and this check share their run folders
    assert {preset for preset, _ in tg.runs()} == set(DEFAULT_PLAN)
    assert tg.command("b512", _AUTO).endswith("--global-batch 512 --steps 128 --eval-every 16 --auto-freeze "
                                             "--freeze-frac 0.75 --freeze-transient-end 2.5")


def test_verdicts_within_one_percent_divergence_and_the_other_targets():
    # 5.05 is exactly 1% above LAMB's 5.0: still within; 5.06 is not; NaN (diverged) is not
    body = tg.render(_results({"b512": 5.05, "demo": 4.9, "b4096": 4.8, "b1024": 4.6}), "cmd")
    assert "| b512 | 5.000 | 30, 5.050, +1.0% | 4.00x | met |" in body
    assert "Within 1% of LAMB with the defaults: met on 4 of 4 presets." in body
    assert "1-bit LAMB 4.800 against 1-bit Adam" in body and "1-bit LAMB ahead: met." in body
    assert "the automatic freeze 4.600 against the hand-picked 20% (step 80) 4.500, +2.2%: as good as it: " \
           "**not met** at this seed" in body
    results = _results({"b512": 5.06, "demo": math.nan, "b4096": 5.2, "b1024": 4.4}, adam=5.1)
    results[("demo", _AUTO)]["freeze_step"] = 384  # 75% of demo's 512 steps: the cap made this freeze
    body = tg.render(results, "cmd")
    assert "| b512 | 5.000 | 30, 5.060, +1.2% | 4.00x | **not met** |" in body
    assert "| demo | 5.000 | 384 (the cap), NaN, +nan% | 4.00x | **not met** |" in body
    assert "Within 1% of LAMB with the defaults: **not met** on 1 of 4 presets." in body
    assert "1-bit LAMB ahead: **not met**." in body and "as good as it: met at this seed" in body
    body = tg.render(_results({"b512": 5.0, "demo": 5.0, "b4096": 5.0, "b1024": 5.0}, adam=math.nan), "cmd")
    assert "1-bit LAMB ahead: met." in body  # 1-bit Adam diverged
    body = tg.render(_results({"b512": 5.0, "demo": 5.0, "b4096": math.nan, "b1024": 5.0}, adam=math.nan), "cmd")
    assert "1-bit LAMB ahead: **not met**." in body  # both diverged


def test_main_runs_each_check_once_in_the_study_folders_and_writes_its_section(monkeypatch, tmp_path):
    ran = []

    def fake_run_one(out_dir, optimizer, flags, cache):
        ran.append((out_dir, optimizer, list(flags)))
        return _m(4.0 if "auto" in out_dir else 5.0, freeze=7)

    monkeypatch.setattr(tg, "run_one", fake_run_one)
    results = tmp_path / "B.md"
    assert tg.main(["--out", str(tmp_path / "runs"), "--results", str(results)]) == 0
    assert len(ran) == len(tg.runs()) == 10
    assert ran[1] == (str(tmp_path / "runs" / "b512" / "1bit-lamb_auto_cap_75pct_transient_end_2.5"), "onebitlamb",
                      ["--global-batch", "512", "--steps", "128", "--eval-every", "16", "--auto-freeze",
                       "--freeze-frac", "0.75", "--freeze-transient-end", "2.5"])
    text = results.read_text()
    assert "<!-- begin targets -->" in text and "met on 4 of 4 presets" in text
