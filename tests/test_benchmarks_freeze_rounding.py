"""benchmarks.freeze_rounding: its rows and its per-seed table, on made-up runs."""
from benchmarks import freeze_rounding as fr
from benchmarks.variants import LAMB


def test_rows_are_lamb_the_default_and_the_default_with_other_rounding():
    plain = fr.rows()
    assert plain[0] is LAMB
    assert [v.row.folder for v in plain] == ["lamb", "onebitlamb-auto", "onebitlamb-auto-threads2"]
    assert plain[2].row.flags == [*plain[1].row.flags, "--threads", "2"]
    # the default's warm-up is int8: asked for by name, the same runs
    assert [v.row.folder for v in fr.rows("int8")] == [v.row.folder for v in plain]
    float32 = fr.rows("float32")
    # the float32 warm-up's runs are the ones benchmarks.warmup_quantised makes, in the same folder
    assert [v.row.folder for v in float32[1:]] == ["onebitlamb-auto-float32warmup",
                                                   "onebitlamb-auto-float32warmup-threads2"]
    assert float32[2].row.flags[-4:] == ["--warmup-dtype", "float32", "--threads", "2"]


def _results(variants, freezes):
    names = [v.row.name for v in variants]
    return {(s, n): {"final_eval_loss": loss, "freeze_step": step, "bytes_sent_per_rank": 1}
            for s, (a, b) in freezes.items()
            for n, loss, step in zip(names, (4.0, 4.04, 4.0 + s / 100), (None, a, b))}


def test_the_table_gives_each_seeds_move_and_whether_the_bound_holds():
    variants = fr.rows()
    table = fr.moved([1, 2], variants, _results(variants, {1: (154, 154), 2: (170, 165)}))
    rows = [line for line in table.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows[0].split("|")[4].strip() == "+0" and rows[1].split("|")[4].strip() == "-5"
    assert f"{100 * (4.02 / 4.04 - 1):+.2f}%" in rows[1]
    assert "steps 154-170" in table and "at most 5 steps (the bound of 5 holds)" in table
    failed = fr.moved([1, 2], variants, _results(variants, {1: (154, 160), 2: (170, 170)}))
    assert "at most 6 steps (the bound of 5 does not hold)" in failed


def test_one_bit_adams_rows_are_its_default_runs_and_their_rerun():
    adam = fr.rows(optimizer="onebitadam")
    # 1-bit Adam's default runs are the convergence benchmark's, in the folder warmup_quantised reads too
    assert [v.row.folder for v in adam] == ["lamb", "onebitadam-auto", "onebitadam-auto-threads2"]
    assert adam[1].row.flags[:2] == ["--optimizer", "onebitadam"]
    assert adam[2].row.flags == [*adam[1].row.flags, "--threads", "2"]
    assert [v.row.folder for v in fr.rows("int8", "onebitadam")[1:]] == [
        "onebitadam-auto-int8warmup", "onebitadam-auto-int8warmup-threads2"]
