"""The undone-freeze benchmark: its bookkeeping on records small enough to check by hand."""
import pytest

from onebitlamb.benchmarks import unfreeze as uf


def _metrics(stages, loss, nbytes, rises=None):
    return {"stage": stages, "final_eval_loss": loss, "bytes_sent_per_rank": nbytes,
            "variance_rise": None if rises is None else {"layers": ["a", "b"], "per_step": rises}}


W, C = "warmup", "compression"


def test_freezes_and_undone_freezes_in_order():
    assert uf.freezes([W, W, C, C, W, W, C]) == [("freeze", 2), ("undone", 4), ("freeze", 6)]
    assert uf.freezes([W, W, W]) == []
    assert uf.undid_a_freeze(_metrics([W, C, W, C], 1.0, 1)) and not uf.undid_a_freeze(_metrics([W, C, C], 1.0, 1))


def test_largest_rise_and_its_step():
    rises = [None, [0.5, None], [1.5, 0.2], None, [0.1, 2.5]]
    assert uf.largest_rise(_metrics([], 1.0, 1, rises)) == (2.5, 5)
    assert uf.largest_rise(_metrics([], 1.0, 1)) is None


def test_the_run_without_the_option_only_where_a_freeze_was_undone(monkeypatch):
    ran = []

    def fake_run_one(out_dir, optimizer, flags, cache):
        ran.append(("--unfreeze-rise" in flags, optimizer, out_dir))
        undone = [W, C, W, C] if "plateau" in out_dir else [W, C, C, C]
        return _metrics(undone if "--unfreeze-rise" in flags else [W, C, C, C], 5.0, 10)

    monkeypatch.setattr(uf, "run_one", fake_run_one)
    plateau, exit_ = uf.CASES[0], uf.CASES[1]
    assert plateau.name == "plateau" and exit_.name == "exit"
    lamb, without, with_ = uf.run_case(plateau, "out", "cache")
    assert without is not None and [r[:2] for r in ran] == [(False, "lamb"), (True, "onebitlamb"), (False, "onebitlamb")]
    ran.clear()
    lamb, without, with_ = uf.run_case(exit_, "out", "cache")
    assert without is None and [r[:2] for r in ran] == [(False, "lamb"), (True, "onebitlamb")]
    assert uf.case_flags(exit_, 5.0)[-2:] == ["--unfreeze-rise", "5"] and "--unfreeze-rise" not in uf.case_flags(exit_, None)


def test_render_gaps_volumes_and_the_same_run():
    case = uf.CASES[0]
    lamb = _metrics([W] * 4, 4.0, 3200)
    with_ = _metrics([W, C, W, C], 5.0, 800, [None, [1.0, 6.0], None, None])
    without = _metrics([W, C, C, C], 6.0, 400)
    text = uf.render([(case, lamb, without, with_), (case, lamb, None, with_)], "cmd")
    rows = [line for line in text.splitlines() if line.startswith(f"| {case.name}:")]
    assert "| 1; 6.000 (+50.0%); 8.00x less |" in rows[0]
    assert "| 1, undone at 2, 3; 5.000 (+25.0%); 4.00x less | 6.0 (step 2) |" in rows[0]
    assert "| the same run (nothing undone) |" in rows[1]
    assert "`cmd`" in text


@pytest.mark.parametrize("case", uf.CASES)
def test_every_case_is_a_main_job_command(case):
    from onebitlamb.benchmarks.convergence import pretrain_config

    cfg = pretrain_config(case.optimizer, uf.case_flags(case, uf.RISE))
    assert cfg.auto_freeze and cfg.unfreeze_rise == uf.RISE and cfg.seed == case.seed
