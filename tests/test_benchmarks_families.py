"""benchmarks.families: its table from run records written here by hand (no training), and one
short start of real ranks on a real family (the records it appends, and a second start reusing them)."""
import json
import math

import pytest

from benchmarks import families
from benchmarks.families import (ADAM_GRID, GRID_SEED, LAMB_GRID, choose_rates, load_runs, main, prose_bytes,
                                 report, run_missing, summarize)

WORLD, STEPS = 2, 30


def record(family, optimizer, lr, seed, heldout, freeze=None, diverged=None):
    return {"family": family, "optimizer": optimizer, "lr": lr, "seed": seed, "steps": STEPS, "world": WORLD,
            "heldout": heldout, "train_curve": [], "freeze": freeze, "diverged": diverged, "seconds": 1.0}


def hand_written_runs(family="lstm-prose"):
    """LAMB best at 4e-2, 1-bit Adam best at 2e-3, 0/1 Adam best at 1.6e-2 (seed 0); then seeds 1-2."""
    assert 3e-2 > 1.6e-2 in ADAM_GRID and 4e-2 in LAMB_GRID
    worse = dict.fromkeys(ADAM_GRID, 9.0)  # the grid's other rates
    grid = {"lamb": {**dict.fromkeys(LAMB_GRID, 9.0), 1e-2: 3.0, 2e-2: 2.5, 4e-2: 2.0, 8e-2: 2.2},
            "onebitadam": {**worse, 1e-3: 2.4, 2e-3: 2.1, 4e-3: 2.3, 8e-3: math.inf},
            "zerooneadam": {**worse, 4e-3: 2.4, 8e-3: 2.35, 1.6e-2: 2.3}}
    runs = [record(family, opt, lr, GRID_SEED, loss) for opt, losses in grid.items() for lr, loss in losses.items()]
    runs += [record(family, "lamb", 4e-2, 1, 2.0), record(family, "lamb", 4e-2, 2, 2.2),
             # paired gaps: +2% and 0%, then +10% and +20%
             record(family, "onebitlamb", 4e-2, 1, 2.04, freeze=12), record(family, "onebitlamb", 4e-2, 2, 2.2, freeze=14),
             record(family, "onebitlamb-momentum", 4e-2, 1, 2.2, 12), record(family, "onebitlamb-momentum", 4e-2, 2, 2.64, 13),
             record(family, "onebitadam", 2e-3, 1, 2.0, 9), record(family, "onebitadam", 2e-3, 2, math.inf, 9, "step 20: x"),
             record(family, "zerooneadam", 1.6e-2, 1, 1.9, 8), record(family, "zerooneadam", 1.6e-2, 2, 2.2, 8)]
    return {families.key(r): r for r in runs}


def test_rates_are_chosen_on_the_grid_and_1bit_lamb_takes_lambs():
    chosen = choose_rates(hand_written_runs(), "lstm-prose", STEPS, WORLD)
    assert chosen == {"lamb": 4e-2, "onebitadam": 2e-3, "zerooneadam": 1.6e-2, "onebitlamb": 4e-2,
                      "onebitlamb-momentum": 4e-2}


def test_gaps_are_paired_by_seed_with_a_t_interval_and_a_divergence_is_named():
    runs = hand_written_runs()
    rows = {r["optimizer"]: r for r in summarize(runs, "lstm-prose", choose_rates(runs, "lstm-prose", STEPS, WORLD),
                                                 [1, 2], STEPS, WORLD)}
    assert rows["onebitlamb"]["gaps"] == pytest.approx([2.0, 0.0])
    assert rows["onebitlamb"]["mean_gap"] == pytest.approx(1.0)
    # two seeds: t = 12.706, stdev of (2, 0) = sqrt(2), over sqrt(2)
    assert rows["onebitlamb"]["half_width"] == pytest.approx(12.706)
    assert rows["onebitlamb-momentum"]["mean_gap"] == pytest.approx(15.0)
    assert rows["onebitadam"]["mean_gap"] == math.inf and rows["onebitadam"]["diverged"] == ["step 20: x"]
    text = report(runs, ["lstm-prose"], {"lstm-prose": STEPS}, [1, 2], WORLD, ["--seeds", "2"])
    assert "| 1-bit LAMB (update space, default) | 0.04 | 2.12 | +1.00% ± 12.71 | +2.00%, +0.00% | 12, 14 | no |" in text
    assert "| 1-bit Adam | 0.002 | diverged | diverged | +0.00%, inf | 9, 9 | step 20: x |" in text
    assert "LAMB's own seed spread (max - min over mean): 9.52%" in text and "grid's edge" not in text
    assert "| LAMB | 3 | 2.5 | **2** | 2.2 |" in text  # the chosen rate in bold
    # the spaces paired: (2 - 10, 0 - 20) = (-8, -20): mean -14, stdev 8.485, t 12.706 / sqrt 2
    assert "update's gap minus momentum's): -14.00 points ± 76.24." in text


def test_the_prose_is_english_not_code():
    text = bytes(prose_bytes()[:200_000].to(dtype=__import__("torch").uint8).tolist()).decode("utf-8", "replace")
    words = text.split()
    assert len(words) > 20_000
    common = sum(w.lower() in {"the", "a", "of", "is", "to", "and", "in"} for w in words)
    assert common / len(words) > 0.1, "expected English prose"
    assert not any(line[:1].isspace() for line in text.splitlines()), "indented (code) blocks should be gone"


def test_real_ranks_train_record_each_run_and_a_second_start_reuses_them(tmp_path, monkeypatch):
    log = str(tmp_path / "runs.jsonl")
    cases = [dict(optimizer="lamb", lr=4e-2, seed=1, steps=12), dict(optimizer="onebitlamb", lr=4e-2, seed=1, steps=12)]
    runs = {}
    run_missing(cases, "cnn-digits", runs, WORLD, log, str(tmp_path))
    lamb, onebit = (runs[("cnn-digits", c["optimizer"], 4e-2, 1, 12, WORLD)] for c in cases)
    assert lamb["diverged"] is None and onebit["diverged"] is None
    assert 0.5 * math.log(10) < lamb["heldout"] < 1.2 * math.log(10)  # 10 classes, 12 steps: near the start
    assert lamb["train_curve"][-1] < lamb["train_curve"][0]
    assert lamb["freeze"] is None and 4 <= onebit["freeze"] <= 12  # AutoFreeze of 12 steps: from its floor
    assert len(lamb["train_curve"]) == 10
    assert [json.loads(line)["optimizer"] for line in open(log)] == ["lamb", "onebitlamb"]
    assert load_runs(log) == runs

    def no_start(*args, **kwargs):
        raise AssertionError("a finished run was started again")
    monkeypatch.setattr("onebitlamb.comm.launch.spawn_local", no_start)
    run_missing(cases, "cnn-digits", runs, WORLD, log, str(tmp_path))


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="--steps"):
        main(["--steps", "3", "--out", str(tmp_path)])


def test_a_rate_chosen_at_the_grids_edge_is_said():
    runs = {}
    for r in hand_written_runs().values():
        if r["optimizer"] == "zerooneadam":
            r = {**r, "heldout": 1.0 if r["lr"] == ADAM_GRID[-1] else r["heldout"]}
            r = {**r, "lr": ADAM_GRID[-1]} if r["seed"] != GRID_SEED else r
        runs[families.key(r)] = r
    text = report(runs, ["lstm-prose"], {"lstm-prose": STEPS}, [1, 2], WORLD, [])
    assert "Chosen at the grid's edge: 0/1 Adam. LAMB's own seed spread" in text


def test_late_ids_and_shifted_bytes_first_appear_at_their_point_of_the_run():
    """The click data holds no late id before LATE_FROM of the run and a fifth of its ids are late; the
    shifted prose brings bytes the English never has only from SHIFT_FROM on."""
    import torch
    d = families.FAMILIES["dlrm"].load("")
    d["steps"] = 100
    late = d["teacher"]["late"]
    assert abs(float(late.float().mean()) - families.LATE_SHARE) < 0.01
    batch = lambda step: families.FAMILIES["dlrm"].batch(d, step, 0, 2, 1)  # noqa: E731
    assert not late[batch(79)[1]].any() and late[batch(80)[1]].any()
    p = families.FAMILIES["lstm-shift"].load("")
    p["steps"] = 100
    english = set(torch.unique(p["train"]).tolist())
    shift = lambda step: families.FAMILIES["lstm-shift"].batch(p, step, 0, 2, 1)  # noqa: E731
    assert set(torch.unique(shift(79)).tolist()) <= english
    assert set(torch.unique(shift(80)).tolist()) - english


def _late_runs():
    runs = hand_written_runs("dlrm")
    for (fam, opt, lr, seed, steps, world), r in list(runs.items()):
        # the late-id loss: LAMB 1.0 at each seed; 1-bit LAMB 1.02 and 1.04 (gaps +2%, +4%)
        late = {"lamb": 1.0, "onebitlamb": 1.0 + 0.02 * seed}.get(opt, 1.1)
        runs[(fam, opt, lr, seed, steps, world)] = {**r, "late_loss": late, "auc": 0.6 + 0.01 * seed}
    return runs


def test_the_late_figures_are_paired_with_lambs_and_with_another_commits_runs():
    runs = _late_runs()
    text = report(runs, ["dlrm"], {"dlrm": STEPS}, [1, 2], WORLD, [])
    # (2, 4): mean 3, stdev sqrt 2, t 12.706 / sqrt 2
    assert "| 1-bit LAMB (update space, default) | 0.6150 | 1.03 | +3.00% ± 12.71 | +2.00%, +4.00% |" in text
    other = {k: {**r, "late_loss": r["late_loss"] * 1.1} for k, r in runs.items()}
    lines = families.paired_with(runs, other, ["dlrm"], {"dlrm": STEPS}, [1, 2], WORLD, "the commit before")
    assert lines[1] == "### Against the commit before, paired by seed"
    row = next(line for line in lines if "| 1-bit LAMB (update space, default) | late_loss |" in line)
    assert "-9.09%, -9.09%" in row  # 1 / 1.1 - 1, at each seed
    assert not any("| LAMB |" in line for line in lines)


def test_fixed_rates_replace_the_grid_and_bad_ones_are_refused(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="lamb, onebitadam and zerooneadam"):
        main(["--rates", "lamb=0.04", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="optimizer=rate"):
        main(["--rates", "lamb=fast", "--out", str(tmp_path)])
    monkeypatch.setattr(families, "FIXED_RATES", {"lamb": 0.04, "onebitadam": 0.032, "zerooneadam": 0.016})
    assert families.grid_of("onebitadam", "lstm-prose") == (0.032,)
