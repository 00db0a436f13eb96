"""The trust-peak benchmark's parsing and table, on hand-made run records (no training)."""
import pytest

from onebitlamb.benchmarks import convergence
from onebitlamb.benchmarks import trust_peak as tp
from onebitlamb.benchmarks.convergence import _AUTO, _AUTO_TRUST_PEAK
from onebitlamb.benchmarks.targets import HAND_PICKED_LATE
from onebitlamb.benchmarks.trust_peak import parse_runs, render


def _run(loss, sent, freeze=None, ready=None, frozen=None):
    """A run record; with ``frozen`` (the layers' frozen trust ratios) one diagnosed stage-2 step, step 50
    at a rate of 0.01, where the layers' relative steps are 0.05, 0.1, 0.2: 5, 10 and 20 per unit rate."""
    layers = [{"name": f"layer{i}", "frozen_coeff": c, "rel_step": 0.05 * 2 ** i} for i, c in enumerate(frozen or [])]
    return {"final_eval_loss": loss, "bytes_sent_per_rank": sent, "freeze_step": freeze, "freeze_ready_step": ready,
            "diagnostics": [{"step": 50, "layers": layers}] if frozen else [],
            "stage": ["warmup"] * 40 + ["compression"] * 10, "lr": [0.01] * 50}


def test_parse_runs():
    assert parse_runs(["b1024:1234,1235", "demo:7", "b1024:1235"]) == [("b1024", 1234), ("b1024", 1235), ("demo", 7)]
    for bad in ("b999:1", "b1024", "b1024:x", "b1024:-1"):
        with pytest.raises(ValueError, match="invalid runs"):
            parse_runs([bad])


def test_render_gaps_volumes_and_summary():
    results = {
        ("b1024", "lamb", 1): _run(5.0, 1000),
        ("b1024", _AUTO, 1): _run(5.1, 250, freeze=80),                  # +2.0%, 4x less
        # -10.0%, 2x less, the median layer's frozen trust ratio 0.2, its stage-2 step 10
        ("b1024", _AUTO_TRUST_PEAK, 1): _run(4.5, 500, freeze=140, ready=80, frozen=[0.1, 0.3, 0.2]),
        ("b1024", HAND_PICKED_LATE, 1): _run(4.6, 400, freeze=140),      # -8.0%, 2.5x less
        ("demo", "lamb", 2): _run(4.0, 800),
        ("demo", HAND_PICKED_LATE, 2): _run(3.96, 400, freeze=179),     # -1.0%
        ("demo", _AUTO, 2): _run(4.02, 200, freeze=100),                 # +0.5%
        ("demo", _AUTO_TRUST_PEAK, 2): _run(float("nan"), 0, freeze=None),  # diverged
    }
    text = render(results, [("b1024", 1), ("demo", 2)], "cmd")
    rows = [line for line in text.splitlines() if line.startswith("| b1024") or line.startswith("| demo")]
    assert rows[0] == ("| b1024 | 1 | 5.000 | 80, 5.100, +2.0%, 4.00x; -, - | 140 (ready 80), 4.500, -10.0%, 2.00x; "
                       "0.200, 10.0 | 140, 4.600, -8.0%, 2.50x; -, - | -11.8% | -2.2% |")
    assert rows[1] == ("| demo | 2 | 4.000 | 100, 4.020, +0.5%, 4.00x; -, - | -, diverged "
                       "| 179, 3.960, -1.0%, 2.00x; -, - | - | - |")
    assert "- criterion alone: mean gap to LAMB +1.2%; within 1% of LAMB (or ahead) on 1 of 2 runs" in text
    assert "- after the peak: mean gap to LAMB a run diverged; within 1% of LAMB (or ahead) on 1 of 2 runs" in text
    assert "- hand-picked 35%: mean gap to LAMB -4.5%; within 1% of LAMB (or ahead) on 2 of 2 runs" in text


def _two_seeds_of_every_variant():
    """``b1024`` at seeds 1 and 2 with all four variants.
    Seed 1: after the peak 4.4 against 35% 4.0 (+10.0%) and the criterion alone 4.4 (+0.0%).
    Seed 2: after the peak 4.0 against 35% 4.0 (+0.0%) and the criterion alone 5.0 (-20.0%)."""
    results = {}
    for seed, (late, hand, auto) in {1: (4.4, 4.0, 4.4), 2: (4.0, 4.0, 5.0)}.items():
        results[("b1024", "lamb", seed)] = _run(4.2, 1000)
        results[("b1024", _AUTO_TRUST_PEAK, seed)] = _run(late, 400, freeze=130, ready=90)
        results[("b1024", HAND_PICKED_LATE, seed)] = _run(hand, 400, freeze=140)
        results[("b1024", _AUTO, seed)] = _run(auto, 300, freeze=90)
    return results


def test_render_compares_the_option_over_seeds_per_preset():
    """Over a preset's seeds: the wait against the 35% and the criterion alone, mean ± standard error of the
    per-seed gaps, and at how many seeds it was no worse; a preset at one seed gets no such line."""
    results = _two_seeds_of_every_variant()
    results.update({("demo", v, 3): _run(4.0, 800) for v in ("lamb", _AUTO, _AUTO_TRUST_PEAK, HAND_PICKED_LATE)})
    text = render(results, [("b1024", 1), ("b1024", 2), ("demo", 3)], "cmd")
    # +10 and 0: mean +5.0, standard deviation 7.07, standard error 5.0, Student's t at 2 seeds 12.706:
    # 5.0 ± 63.5; 0 and -20: mean -10, error 10, -10.0 ± 127.1
    assert ("- `b1024`, after the peak against the 35% over 2 seeds mean +5.0% ± 5.0 (standard error; within "
            "the seeds' spread), no worse at 1, at 95% between -58.5% and +68.5%; against the criterion alone "
            "over 2 seeds mean -10.0% ± 10.0 (standard error; within the seeds' spread), no worse at 2, at 95% "
            "between -137.1% and +117.1%") in text
    assert "- `demo`," not in text
    results[("b1024", _AUTO_TRUST_PEAK, 2)] = _run(float("nan"), 0)
    assert "- `b1024`," not in render(results, [("b1024", 1), ("b1024", 2)], "cmd")


def test_render_leaves_out_the_criterion_alone_where_it_did_not_run():
    """A seed without the criterion alone shows "not run" in its place, counts in the gaps to LAMB of the
    variants that ran there and in the wait against the 35%, not in the wait against the criterion alone."""
    results = _two_seeds_of_every_variant()
    # seed 3: LAMB 4.0; the wait 3.8 (-5.0% against LAMB and against the 35%), median frozen trust ratio
    # 0.2, stage-2 step 10, half LAMB's bytes; the 35% 4.0 (+0.0%), 2.5x fewer bytes
    results[("b1024", "lamb", 3)] = _run(4.0, 1000)
    results[("b1024", _AUTO_TRUST_PEAK, 3)] = _run(3.8, 500, freeze=150, ready=100, frozen=[0.1, 0.3, 0.2])
    results[("b1024", HAND_PICKED_LATE, 3)] = _run(4.0, 400, freeze=140)
    text = render(results, [("b1024", 1), ("b1024", 2), ("b1024", 3)], "cmd")
    assert ("| b1024 | 3 | 4.000 | not run | 150 (ready 100), 3.800, -5.0%, 2.00x; 0.200, 10.0 "
            "| 140, 4.000, +0.0%, 2.50x; -, - | - | -5.0% |") in text
    # LAMB 4.2 at seeds 1 and 2: the criterion alone 4.4 and 5.0 (+4.8%, +19.0%) over two runs; the wait
    # 4.4, 4.0, 3.8 (+4.8%, -4.8%, -5.0%) over three
    assert "- criterion alone: mean gap to LAMB +11.9%; within 1% of LAMB (or ahead) on 0 of 2 runs" in text
    assert "- after the peak: mean gap to LAMB -1.7%; within 1% of LAMB (or ahead) on 2 of 3 runs" in text
    # against the 35%: +10, 0, -5: mean +1.67, standard deviation 7.64, standard error 4.41, Student's t at
    # 3 seeds 4.303: 1.67 ± 18.97
    assert ("- `b1024`, after the peak against the 35% over 3 seeds mean +1.7% ± 4.4 (standard error; within "
            "the seeds' spread), no worse at 2, at 95% between -17.3% and +20.6%; against the criterion alone "
            "over 2 seeds mean -10.0% ± 10.0") in text


def test_main_writes_further_seeds_into_their_own_section(monkeypatch, tmp_path):
    """``--runs`` with nothing after it runs only ``--runs-without-criterion`` (LAMB, the wait, the 35%: no
    criterion alone), and ``--section`` writes them beside the default section instead of over it."""
    ran = []

    def fake_run_one(out_dir, optimizer, flags, cache):
        ran.append(out_dir)
        return _run(4.0 if "auto" in out_dir else 4.2, 500 if "auto" in out_dir else 1000, freeze=100)

    monkeypatch.setattr(convergence, "run_one", fake_run_one)
    results = tmp_path / "B.md"
    results.write_text("# Benchmarks\n\n<!-- begin trust peak -->\nthe earlier table\n<!-- end trust peak -->\n")
    assert tp.main(["--runs", "--runs-without-criterion", "demo:7,8", "--section", "trust peak, more seeds",
                    "--out", str(tmp_path / "runs"), "--results", str(results)]) == 0
    automatic = [folder for folder in ran if "_auto_" in folder]
    assert len(ran) == 6 and len(automatic) == 2 and all("after_trust_peak" in folder for folder in automatic)
    text = results.read_text()
    assert "<!-- begin trust peak -->\nthe earlier table\n<!-- end trust peak -->" in text
    begin = text.index("<!-- begin trust peak, more seeds -->")
    assert begin < text.index("| demo | 8 | 4.200 | not run | 100, 4.000, -4.8%, 2.00x") < text.index(
        "<!-- end trust peak, more seeds -->")
    assert "- criterion alone: mean gap" not in text and "- after the peak: mean gap to LAMB -4.8%" in text
    with pytest.raises(SystemExit):
        tp.main(["--runs", "--runs-without-criterion", "--out", str(tmp_path / "runs"), "--results", str(results)])
