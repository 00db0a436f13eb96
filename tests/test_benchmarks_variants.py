"""benchmarks/variants.py's section, on metrics written by hand."""
from __future__ import annotations

from benchmarks import variants


def test_the_section_pairs_each_seed_with_lamb_and_counts_rounds():
    lamb, default = variants.LAMB.row.name, variants.DEFAULT.row.name
    results = {}
    for seed, loss, rounds in ((1234, 4.9, 900), (1235, 5.1, 910)):
        results[seed, lamb] = {"final_eval_loss": 5.0 if seed == 1234 else 5.1, "bytes_sent_per_rank": 1000,
                               "freeze_step": None, "rounds_per_rank": 512}
        results[seed, default] = {"final_eval_loss": loss, "bytes_sent_per_rank": 250, "freeze_step": 150 + seed - 1234,
                                  "rounds_per_rank": rounds}
    body = variants.section("T", "cmd", [1234, 1235], [variants.LAMB, variants.DEFAULT], results)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in body.splitlines() if line.startswith("| ") and "---" not in line}
    # gaps: 4.9 / 5.0 - 1 = -2% and 5.1 / 5.1 - 1 = 0%, mean -1%
    assert rows[default] == f"| {default} | 5.000 ± 0.141 | -1.00% (from -2.00% to +0.00%) | 150, 151 | 4.00x | 905 |"
    assert rows[lamb].endswith("| - | 1.00x | 512 |")
    # one seed: its gap, with no range around it
    one = variants.section("T", "cmd", [1234], [variants.LAMB, variants.DEFAULT], results)
    assert f"| {default} | 4.900 | -2.00% | 150 |" in one
    # a run from before rounds were counted has none
    del results[1235, default]["rounds_per_rank"]
    body = variants.section("T", "cmd", [1234, 1235], [variants.LAMB, variants.DEFAULT], results)
    assert any(line.startswith(f"| {default} |") and line.endswith("| 4.00x | - |") for line in body.splitlines())


def test_main_for_writes_its_section_or_the_one_named(tmp_path, monkeypatch):
    """A run at other settings (fewer seeds, other rows) goes into a section of its own with
    --section, so that it does not overwrite the benchmark's own."""
    written = []
    monkeypatch.setattr(variants, "run_variants", lambda out, seeds, vs, preset: {
        (s, v.row.name): {"final_eval_loss": 5.0, "bytes_sent_per_rank": 1000, "freeze_step": None} for s in seeds
        for v in vs})
    monkeypatch.setattr(variants, "write_section", lambda name, body: written.append((name, body.splitlines()[0])))
    rows = [variants.LAMB, variants.DEFAULT]
    for argv in (["--seeds", "1"], ["--seeds", "1", "--section", "mine"], ["--seeds", "1", "--preset", "b1024"]):
        assert variants.main_for("x", "", "T", "theirs", rows, argv, presets=("demo", "b1024")) == 0
    # each under a heading of its own (BENCHMARKS.md holds one section per heading)
    assert written == [("theirs", "## T"), ("mine", "## T: mine"), ("theirs-b1024", "## T: b1024")]
