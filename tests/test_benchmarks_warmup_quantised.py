"""benchmarks.warmup_quantised: its rows and its paired table, on made-up runs."""
import pytest

from benchmarks import warmup_quantised as w
from benchmarks.variants import LAMB


def test_rows_are_lamb_the_float32_warmup_and_one_row_per_codec():
    """The row of the optimizer's default warm-up is the main job's run (no flag, its folder); the
    others name their warm-up."""
    lamb_rows = w.rows("onebitlamb", ["int8"])
    assert lamb_rows[0] is LAMB
    assert [r.row.folder for r in lamb_rows] == ["lamb", "onebitlamb-auto-float32warmup", "onebitlamb-auto"]
    assert lamb_rows[1].row.flags[-2:] == ["--warmup-dtype", "float32"]
    assert "--warmup-dtype" not in lamb_rows[2].row.flags and lamb_rows[2].row.name.endswith("(default)")
    adam = w.rows("onebitadam")
    assert [r.row.folder for r in adam] == ["lamb", "onebitadam-auto", "onebitadam-auto-int8warmup",
                                           "onebitadam-auto-int4warmup", "onebitadam-auto-int2warmup"]
    assert "--optimizer" in adam[1].row.flags and "onebitadam" in adam[1].row.flags
    assert "--warmup-dtype" not in adam[1].row.flags and adam[2].row.flags[-2:] == ["--warmup-dtype", "int8"]


def test_the_paired_table_gives_each_codec_its_gap_to_the_float32_warmup_at_the_same_seed():
    variants = w.rows("onebitlamb", ["int8"])
    names = [v.row.name for v in variants]
    runs = {1: (4.0, 4.04, 4.02), 2: (5.0, 5.0, 5.1)}  # LAMB, float32 warm-up, int8, per seed
    results = {(s, n): {"final_eval_loss": loss, "bytes_sent_per_rank": b, "freeze_step": 10 + s}
               for s, losses in runs.items() for n, loss, b in zip(names, losses, (3000, 1000, 300))}
    table = w.paired_to_float32([1, 2], variants, results)
    (row,) = [line for line in table.splitlines() if "int8" in line]
    gaps = [100 * (4.02 / 4.04 - 1), 100 * (5.1 / 5.0 - 1)]
    mean = sum(gaps) / 2
    assert f"{mean:+.2f}%" in row and f"{gaps[0]:+.2f}%, {gaps[1]:+.2f}%" in row
    assert "11 (11), 12 (12)" in row and "3.33x" in row
    # the 95% interval: t(1 degree of freedom) = 12.706 times the standard error
    half = 12.706 * abs(gaps[0] - gaps[1]) / 2 ** 0.5 / 2 ** 0.5
    assert f"± {half:.2f}" in row


def test_its_own_options_are_taken_before_the_common_ones(monkeypatch):
    seen = {}

    def fake_main_for(prog, doc, title, name, variants, argv, **kw):
        seen.update(name=name, variants=variants, argv=argv, command=kw["command"])
        return 0
    monkeypatch.setattr(w, "main_for", fake_main_for)
    assert w.main(["--optimizer", "onebitadam", "--codecs", "int8", "--seeds", "2", "--no-write"]) == 0
    assert seen["name"] == "warmup-quantised-onebitadam"
    assert [v.row.folder for v in seen["variants"]] == ["lamb", "onebitadam-auto", "onebitadam-auto-int8warmup"]
    assert seen["argv"] == ["--seeds", "2", "--no-write"]
    assert "--optimizer onebitadam --codecs int8" in seen["command"]
    with pytest.raises(SystemExit):
        w.main(["--codecs", "int3"])
