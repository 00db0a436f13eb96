"""benchmarks/fidelity.py's figures, on diagnostics written by hand."""
from __future__ import annotations

import math

import pytest

from benchmarks import fidelity


def _diag(step, stage, layers):
    return {"step": step, "stage": stage, "layers": [
        {"name": n, "trust_ratio": c, "factor": f, "norm": norm, "rel_step": s, "window_step": w}
        for n, (c, f, norm, s, w) in layers.items()]}


def test_fidelity_against_lamb_at_the_same_steps():
    lamb = {"final_eval_loss": 5.0, "bytes_sent_per_rank": 1000, "freeze_step": None,
            "diagnostics": [_diag(s, "warmup", {"a": (0.2, None, 3.0, 0.01, 0.1), "b": (0.1, None, 4.0, 0.02, 0.2)})
                            for s in (16, 32, 48)]}
    run = {"final_eval_loss": 4.9, "bytes_sent_per_rank": 250, "freeze_step": 20, "diagnostics": [
        _diag(16, "warmup", {"a": (9.0, None, 3.0, 9.0, 9.0), "b": (9.0, None, 4.0, 9.0, 9.0)}),  # before the freeze
        _diag(32, "compression", {"a": (0.3, 1.5, 3.0, 0.05, 0.15), "b": (0.1, 1.0, 4.0, 0.02, 1.0)}),
        _diag(48, "compression", {"a": (0.4, 2.0, 3.0, 0.08, 0.12), "b": (0.05, 0.5, 4.0, 0.04, 0.8)})]}
    f = fidelity.fidelity(run, lamb)
    # window ratios: a 1.5 and 1.2 (median 1.35, inside), b 5 and 4 (outside)
    assert f["layers_inside"] == 0.5
    # whole model at 32: sqrt((0.15*3)^2 + (1*4)^2)/5 over sqrt((0.1*3)^2 + (0.2*4)^2)/5; at 48 likewise
    r32 = math.hypot(0.45, 4.0) / math.hypot(0.3, 0.8)
    r48 = math.hypot(0.36, 3.2) / math.hypot(0.3, 0.8)
    assert f["whole_window"] == pytest.approx((r32 + r48) / 2)
    assert f["one_step"] == pytest.approx(statistics_median([5, 1, 8, 2]))
    # at the last diagnosis: coefficients 0.4/0.2 and 0.05/0.1, factors 2 and 0.5
    assert f["coeff_median"] == pytest.approx(1.25) and f["coeff_max"] == pytest.approx(2.0)
    assert f["factor_median"] == pytest.approx(1.25) and f["factor_max"] == 2.0
    assert f["gap"] == pytest.approx(-2.0) and f["bytes"] == 0.25


def statistics_median(values):
    values = sorted(values)
    return (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def test_the_interval_is_students_t():
    mean, half = fidelity.mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert fidelity.mean_interval([1.5]) == (1.5, None)


def test_compare_says_where_a_seed_falls_only_for_the_measured_settings(tmp_path):
    """benchmarks/fidelity.py writes the measured gaps; compare reads them back for a run with the
    same settings (another seed), and says nothing for a run with other settings."""
    from onebitlamb.train import compare

    config = {"preset": "demo", "seed": 1234, "out": "x", "optimizer": "onebitlamb", "compression_space": "update",
              "bound_direction": True}
    lamb = {"final_eval_loss": 5.0, "config": {**config, "optimizer": "lamb"}}
    runs = {(fidelity.LAMB.name, s): {"final_eval_loss": 5.0} for s in (1234, 1235)}
    runs.update({(fidelity.DEFAULT.name, 1234): {"final_eval_loss": 4.9, "config": config},
                 (fidelity.DEFAULT.name, 1235): {"final_eval_loss": 5.05, "config": {**config, "seed": 1235}}})
    path = tmp_path / "measured.json"
    fidelity.write_measured("demo", [1234, 1235], runs, "python -m benchmarks.fidelity", str(path))
    measured = compare.read_measured(str(path))
    entry = measured["demo"]["onebitlamb"]
    assert entry["gaps_pct"] == pytest.approx([-2.0, 1.0]) and entry["mean_pct"] == pytest.approx(-0.5)
    assert "seed" not in entry["settings"] and "out" not in entry["settings"]
    mine = {"lamb": lamb, "onebitlamb": {"final_eval_loss": 4.95, "config": {**config, "seed": 7}}}
    (line,) = compare.where_the_seed_falls(mine, measured)
    assert "-1.00% against LAMB at this seed" in line and "-0.50% ± " in line and "from -2.00% to +1.00%" in line
    other = {"lamb": lamb, "onebitlamb": {"final_eval_loss": 4.95, "config": {**config, "compression_space": "momentum"}}}
    assert compare.where_the_seed_falls(other, measured) == []

    def falls(**settings):  # a run of ``mine``'s saved with these settings of the bound (none: before it)
        saved = {k: v for k, v in mine["onebitlamb"]["config"].items() if k != "bound_direction"}
        run = {**mine["onebitlamb"], "config": {**saved, **settings}}
        return compare.where_the_seed_falls({"lamb": lamb, "onebitlamb": run}, measured) != []

    assert falls(bound_direction=True) and not falls(bound_direction=False)
    # a run's metrics saved when the bound was stage2_bound ("adam": bounded), or before it (unbounded)
    assert falls(stage2_bound="adam") and not falls(stage2_bound="none") and not falls()
    # measured before the stage-2 bound existed, hence without it: those runs had none, so a run with it
    # (the default) is not theirs
    for entry in measured["demo"].values():
        entry["settings"].pop("bound_direction")
    assert not falls(bound_direction=True) and not falls(stage2_bound="adam")
    assert falls(bound_direction=False) and falls(stage2_bound="none") and falls()
    assert compare.read_measured(str(tmp_path / "missing.json")) == {}
    # runs saved under the bound's old name are measured under its new one
    old = {key: {**run, "config": {**{k: v for k, v in run["config"].items() if k != "bound_direction"},
                                   "stage2_bound": "adam"}} if "config" in run else run for key, run in runs.items()}
    fidelity.write_measured("demo", [1234, 1235], old, "python -m benchmarks.fidelity", str(path))
    settings = compare.read_measured(str(path))["demo"]["onebitlamb"]["settings"]
    assert settings["bound_direction"] is True and "stage2_bound" not in settings


def test_candidates_left_out_have_no_row_and_no_panel(tmp_path):
    """--candidate-seeds 0: the table and the plot hold LAMB's pairs with the default alone."""
    figures = {(fidelity.DEFAULT.name, s): {
        "gap": g, "layers_inside": 1.0, "whole_window": 1.0, "one_step": 1.0, "coeff_median": 1.0, "coeff_max": 1.0,
        "factor_median": 1.0, "factor_max": 1.0, "bytes": 0.3, "curves": {"a": [(32, 1.1), (48, 0.9)]}}
        for s, g in ((1234, -1.0), (1235, 1.0))}
    body = fidelity.render("demo", [1234, 1235], figures, "python -m benchmarks.fidelity --candidate-seeds 0")
    rows = [line for line in body.splitlines() if line.startswith("| 1-bit")]
    assert len(rows) == 1 and rows[0].startswith(f"| {fidelity.DEFAULT.name} | 2 | +0.00% ± 12.71")
    fidelity.plot("demo", 1234, figures, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 0
