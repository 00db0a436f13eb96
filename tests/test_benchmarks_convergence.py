"""The convergence study's plan and table (the runs themselves are the main job, tested elsewhere)."""
import math

import pytest

from onebitlamb.benchmarks import convergence


def test_every_planned_row_is_a_valid_pretrain_command():
    import argparse

    from onebitlamb.train import pretrain

    rows = convergence.plan(list(convergence.PRESETS), sweep=list(convergence.PRESETS))
    assert {r[0] for r in rows} == set(convergence.PRESETS)
    for preset, label, optimizer, flags in rows:
        parser = argparse.ArgumentParser()
        pretrain.add_arguments(parser)
        args = parser.parse_args(["--preset", "demo", "--optimizer", optimizer, "--out", "x", *flags])
        cfg = pretrain.config_from_args(args)
        assert cfg.optimizer == optimizer
        if "auto" in label:
            assert cfg.auto_freeze
    sweep = [r for r in rows if r[0] == "b512" and r[1].startswith("lamb, lr")]
    assert [r[3][-1] for r in sweep] == convergence.SWEEP["lamb"]
    assert not any(", lr " in r[1] for r in convergence.plan(["b512"]))  # no sweep unless asked
    only_lamb = convergence.plan(["b512", "b4096"], sweep=["b512:lamb", "b4096:lamb,onebitlamb"])
    assert [r[1] for r in only_lamb if r[0] == "b512" and ", lr " in r[1]] == ["lamb, lr 1e-2", "lamb, lr 4e-2"]
    assert len([r for r in only_lamb if r[0] == "b4096"]) == len(convergence.plan(["b4096"])) + 4
    for bad in (["b999"], ["b512:sgd"]):
        with pytest.raises(ValueError, match="invalid sweep"):
            convergence.plan(["b512"], sweep=bad)


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
