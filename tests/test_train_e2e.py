"""End to end: `onebitlamb compare --preset tiny` on 2 local workers (the three optimizers, crossing
the freeze), its files, an exact `--resume` of an interrupted 1-bit LAMB run, and the two main-job
runs pinned before the API change, within stated rounding tolerances."""
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from pretrain_pool import pretrain_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "onebitlamb", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"onebitlamb {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def corpus_dir():
    import email  # a real, small text corpus on every machine: ~30 files

    return os.path.dirname(email.__file__)


@pytest.fixture(scope="module")
def compared(tmp_path_factory, corpus_dir):
    out = tmp_path_factory.mktemp("compare")
    cache = tmp_path_factory.mktemp("cache")
    proc = _cli("compare", "--preset", "tiny", "--freeze", "0.35", "--out", str(out), "--corpus", corpus_dir,
                "--cache-dir", str(cache), "--no-progress")
    return out, cache, proc


def test_compare_writes_table_metrics_and_plots(compared):
    out, _, proc = compared
    assert "1-bit LAMB" in proc.stdout and "vs LAMB" in proc.stdout
    with open(out / "metrics.json") as f:
        metrics = json.load(f)
    runs = metrics["optimizers"]
    assert set(runs) == {"lamb", "onebitlamb", "onebitadam"}
    for name, m in runs.items():
        assert m["samples"] == 8 * 16
        assert m["final_eval_loss"] == m["eval_curve"][-1][1] and m["final_eval_loss"] < m["eval_curve"][0][1]
        assert [s for s, _ in m["eval_curve"]] == [0, 64, 128]  # equal samples for every optimizer
        assert m["bytes_sent_per_rank"] > 0 and m["wall_time_s"] > 0
    # the same data and initial model: identical loss before training
    assert len({m["eval_curve"][0][1] for m in runs.values()}) == 1
    # compression after the freeze (step 3 of 8): much less sent than LAMB
    lamb, onebit = runs["lamb"]["bytes_sent_per_rank"], runs["onebitlamb"]["bytes_sent_per_rank"]
    assert lamb / onebit > 2.0
    assert metrics["comparison"]["onebitlamb"]["volume_reduction_vs_lamb"] == pytest.approx(lamb / onebit)
    curve, lamb_curve = runs["onebitlamb"]["bytes_curve"], runs["lamb"]["bytes_curve"]
    warm_step, comp_step = curve[1][1] - curve[0][1], curve[-1][1] - curve[-2][1]
    lamb_step = lamb_curve[1][1] - lamb_curve[0][1]
    assert comp_step * 10 < warm_step * 3 < lamb_step  # 1 bit after the freeze, int8 codes before it
    with open(out / "onebitlamb" / "config.json") as f:
        assert json.load(f)["warmup_dtype"] == "int8"  # the main job's default
    # per-layer diagnostics at the evaluation points
    diag = runs["onebitlamb"]["diagnostics"]
    assert [d["step"] for d in diag] == [4, 8]
    layer = diag[-1]["layers"][0]
    assert layer["frozen_coeff"] is not None and layer["factor"] is not None and layer["rel_step"] > 0
    assert runs["lamb"]["diagnostics"][-1]["layers"][0]["frozen_coeff"] is None
    # one run's own metrics: the freeze's per-step record (none for LAMB) and the layers' names
    for name in runs:
        with open(out / name / "metrics.json") as f:
            m = json.load(f)
        assert len(m["stage"]) == len(m["lr"]) == len(m["train_loss"]) == 8
        assert m["layers"] == [layer["name"] for layer in diag[-1]["layers"]]
        if name == "lamb":
            assert m["freeze"] is None and m["freeze_step"] is None
        else:
            assert m["freeze_step"] == 3 and m["warmup_steps"] == 3 and m["stage"][2:4] == ["warmup", "compression"]
            assert [r["frozen_at"] for r in m["freeze"]] == [None, None] + [3] * 6
            assert {(r["floor_step"], r["cap_step"]) for r in m["freeze"]} == {(3, 3)}
    for png in ("compare.png", "diagnostics.png"):
        with open(out / png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_run_writes_its_curves_and_a_csv_and_announces_the_freeze(compared):
    """Each run's OUT/log.csv (a row per step, the held-out loss where evaluated) and curves.png;
    the freeze announced without a progress bar; plain lines in a log that is not a terminal."""
    import csv
    import importlib.util

    out, _, proc = compared
    for name in ("lamb", "onebitlamb", "onebitadam"):
        with open(out / name / "metrics.json") as f:
            m = json.load(f)
        with open(out / name / "log.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == ["step", "loss", "heldout_loss", "bytes", "collectives", "lr", "stage"]
        assert [int(r["step"]) for r in rows] == list(range(9))
        assert [float(r["loss"]) for r in rows[1:]] == m["train_loss"]
        assert [[int(r["step"]) * 16, float(r["heldout_loss"])] for r in rows if r["heldout_loss"]] == m["eval_curve"]
        assert [[int(r["step"]), int(r["bytes"])] for r in rows[1:]] == m["bytes_curve"]
        assert [r["stage"] for r in rows[1:]] == m["stage"]
        collectives = [int(r["collectives"]) for r in rows]
        assert collectives[0] == 0 and all(a < b for a, b in zip(collectives, collectives[1:]))
        # the learning rate each step trained with: the peak after the one warm-up step, not yet 0 at the last
        lrs = [float(r["lr"]) for r in rows[1:]]
        assert lrs[0] == pytest.approx(m["config"]["lr"]) and 0 < lrs[-1] < lrs[0]
        assert (out / name / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (f"[{name}] step 3: the freeze" in proc.stderr) == (name != "lamb")
        for step in (4, 8):
            assert re.search(rf"^\[{name}\] step {step}: held-out loss [0-9.]+ \| train loss [0-9.]+, "
                             rf"[0-9.]+ MB sent, [0-9]+ samples/s, \w+, {step}/8$", proc.stderr, re.M), proc.stderr
    assert "\r" not in proc.stderr  # --no-progress: no bar
    assert "continue with --resume" not in proc.stderr  # every run completed: none says it stopped
    if importlib.util.find_spec("tensorboard") is None:  # optional: nothing about it, nothing written
        assert "tensorboard" not in proc.stderr.lower() and not (out / "onebitlamb" / "tensorboard").exists()


def test_compare_png_tells_the_one_bit_curves_apart(compared):
    """Where the two 1-bit optimizers send the same bytes (the same warm-up average; by default 1-bit
    LAMB's is int8 and 1-bit Adam's float32), their curves differ in line style and marker, the
    markers are shifted, the later one is drawn on top and its label says the curves coincide."""
    from onebitlamb.train import plots

    out, _, _ = compared
    runs = {}
    for name in ("lamb", "onebitlamb", "onebitadam"):
        with open(out / name / "metrics.json") as f:
            runs[name] = json.load(f)
    fig = plots.compare_figure(runs)
    try:
        assert not any("same bytes" in line.get_label() for ax in fig.axes for line in ax.get_lines())
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    # with the same warm-up average both send the same bytes a step, at the same freeze: what hid one curve
    runs["onebitlamb"]["bytes_curve"] = runs["onebitadam"]["bytes_curve"]
    fig = plots.compare_figure(runs)
    try:
        for ax in fig.axes:
            lines = {line.get_label().split(" (")[0]: line for line in ax.get_lines()
                     if line.get_label().startswith("1-bit")}
            lamb1, adam1 = lines["1-bit LAMB"], lines["1-bit Adam"]
            assert (lamb1.get_linestyle(), lamb1.get_marker()) != (adam1.get_linestyle(), adam1.get_marker())
        lamb1, adam1 = (next(line for line in fig.axes[1].get_lines() if line.get_label().startswith(label))
                        for label in ("1-bit LAMB", "1-bit Adam"))
        assert lamb1.get_markevery() != adam1.get_markevery()
        assert adam1.get_zorder() > lamb1.get_zorder() and "same bytes as 1-bit LAMB" in adam1.get_label()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_every_figure_of_the_tiny_runs_has_no_holes(compared):
    """Each run's curves (three panels with data, the freeze and the compression stage in each of a
    1-bit run's), compare.png's and diagnostics.png's figures: no empty panel or legend, no warning."""
    import warnings

    import matplotlib.pyplot as plt
    from test_train_plots import assert_no_holes

    from onebitlamb.train import plots

    out, _, _ = compared
    runs = {}
    for name in ("lamb", "onebitlamb", "onebitadam"):
        with open(out / name / "metrics.json") as f:
            runs[name] = json.load(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, m in runs.items():
            fig = plots.run_figure(m)
            assert len(fig.axes) == 3
            assert_no_holes(fig)
            for ax in fig.axes:
                labels = ax.get_legend_handles_labels()[1]
                assert ("freeze (step 3)" in labels and "compression stage (1-bit)" in labels) == (name != "lamb")
            plt.close(fig)
        for fig in (plots.compare_figure(runs), plots.diagnostics_figure(runs)):
            assert_no_holes(fig)
            plt.close(fig)


def test_resume_is_bit_identical(compared, tmp_path, corpus_dir, capsys):
    """The resume is the command's; the run it resumes, stopped after step 5, ran on the persistent
    ranks (tests/pretrain_pool.py), and the refusal in this process (it comes before any worker)."""
    from onebitlamb import cli

    out, cache, _ = compared
    common = ["--preset", "tiny", "--optimizer", "onebitlamb", "--freeze", "0.35", "--out", str(tmp_path),
              "--corpus", corpus_dir, "--cache-dir", str(cache), "--no-progress"]
    stopped = pretrain_on_ranks(*common, "--stop-after-steps", "5").summary  # after the freeze at step 3
    assert not stopped["completed"] and stopped["step"] == 5 and not (tmp_path / "metrics.json").exists()
    with open(tmp_path / "checkpoint.json") as f:
        assert json.load(f)["step"] == 5
    assert cli.main(["pretrain", *common, "--resume", "--lr", "0.5"]) == 2
    assert "different settings" in capsys.readouterr().err
    _cli("pretrain", *common, "--resume")

    uninterrupted = torch.load(out / "onebitlamb" / "model_final.pt")
    resumed = torch.load(tmp_path / "model_final.pt")
    assert uninterrupted.keys() == resumed.keys()
    for k in uninterrupted:
        assert torch.equal(uninterrupted[k], resumed[k]), k
    with open(out / "onebitlamb" / "metrics.json") as f:
        a = json.load(f)
    with open(tmp_path / "metrics.json") as f:
        b = json.load(f)
    assert a["eval_curve"] == b["eval_curve"]
    assert a["bytes_curve"] == b["bytes_curve"] and a["train_loss"] == b["train_loss"]
    # the resumed run rewrote its log up to the checkpoint: the same rows as the uninterrupted run's
    assert (tmp_path / "log.csv").read_text() == (out / "onebitlamb" / "log.csv").read_text()


def _model_sha256(path):
    sd = torch.load(path, weights_only=True)
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].float().numpy().tobytes())
    return h.hexdigest()


with open(os.path.join(ROOT, "tests", "data", "pinned_runs.json")) as _f:
    PINS = json.load(_f)
# the flags of the runs pinned before the API change, and what they are now
NEW_FLAGS = {"--freeze-frac 0.35": ["--freeze", "0.35"], "--auto-freeze --freeze-frac 0.75": ["--freeze", "auto"]}
# they ran the paper's stage 2, the default before compression_space was an option, unbounded, and
# averaged the warm-up in float32, the default before int8
PINNED_DEFAULTS = ["--compression-space", "momentum", "--no-bound-direction", "--warmup-dtype", "float32"]
# Rounding alone (ONEBITLAMB_NATIVE=0 here, another machine of the same kind) left the held-out
# losses of the warm-up unchanged and moved the final one by at most 1.2e-4 of its value (5.82622 against
# 5.82666 and 5.82691); ten times that still tells apart a freeze moved by 24 steps (0.8%).
WARMUP_EVAL_RTOL = 1e-5
FINAL_EVAL_RTOL = 1.2e-3


@pytest.fixture(scope="module")
def main_job_runs(tmp_path_factory, corpus_dir, compared):
    """The two pinned main-job runs (60 tiny steps), a fixed 35% freeze and the automatic one, with
    the pinned flags, on the persistent ranks (tests/pretrain_pool.py): the numbers are the command's
    (test_resume_is_bit_identical resumes a pool run with the command and ends on the command's
    uninterrupted run, bit for bit), without two launches."""
    _, cache, _ = compared
    common = PINS["main_job_common_flags"].split(" --corpus ")[0].split()
    assert common[0] == "pretrain"
    outs = {}
    for name, pin in PINS["main_job_runs"].items():
        outs[name] = tmp_path_factory.mktemp(name)
        run = pretrain_on_ranks(*common[1:], *PINNED_DEFAULTS, *NEW_FLAGS[pin["old_flags"]], "--corpus", corpus_dir,
                                "--out", str(outs[name]), "--cache-dir", str(cache), "--no-progress")
        assert run.summary["completed"], run
    return outs


def test_main_job_same_as_before_the_api_change(main_job_runs):
    """The freeze step exactly; the held-out losses within the rounding tolerances above, tight for the
    evaluations of the warm-up (uncompressed LAMB) and looser for the final one, after the 1-bit stage."""
    for name, pin in PINS["main_job_runs"].items():
        with open(main_job_runs[name] / "metrics.json") as f:
            m = json.load(f)
        assert m["freeze_step"] == pin["freeze_step"], name
        samples_per_step = m["eval_curve"][-1][0] / m["steps"]
        for (samples, got), (pinned_samples, pinned) in zip(m["eval_curve"], pin["eval_curve"]):
            assert samples == pinned_samples, name
            in_warmup = samples / samples_per_step <= pin["freeze_step"]
            assert got == pytest.approx(pinned, rel=WARMUP_EVAL_RTOL if in_warmup else FINAL_EVAL_RTOL), (name, samples)
        assert len(m["eval_curve"]) == len(pin["eval_curve"]), name


def test_the_automatic_freeze_records_every_step_and_plots_its_decision(main_job_runs):
    with open(main_job_runs["auto"] / "metrics.json") as f:
        m = json.load(f)
    assert m["config"]["freeze"] == "auto"
    records, freeze = m["freeze"], m["freeze_step"]
    assert len(records) == len(m["stage"]) == len(m["train_loss"]) == len(m["lr"]) == m["steps"] == 60
    last = records[-1]
    # AutoFreeze(total_steps=60) with every default: the floor at 30% of the steps, the cap at 75%
    assert (last["floor_step"], last["cap_step"]) == (18, 45) and 18 <= freeze <= 45
    assert m["warmup_steps"] == freeze and m["stage"][freeze - 1] == "warmup" and m["stage"][freeze] == "compression"
    assert all(r["frozen_at"] is None for r in records[:freeze - 1])
    assert all(r["frozen_at"] == freeze for r in records[freeze - 1:])
    # every warm-up step has each layer's level, the freeze's own too
    assert all(r["levels"] is not None and len(r["levels"]) == len(m["layers"]) for r in records[:freeze])
    assert m["layers"] == [layer["name"] for layer in m["diagnostics"][0]["layers"]]
    # the wait for the trust peak (1-bit LAMB): the freeze came at its end or at the floor, or at the cap
    # when it never ended
    ready, waited = last["ready_step"], last["trust_peak_step"]
    if waited is None:
        assert freeze == 45
    else:
        assert ready is not None and ready < waited and freeze == max(waited, 18), (ready, waited, freeze)
        import onebitlamb
        assert records[waited - 1]["trust_rise"] <= onebitlamb.AutoFreeze(total_steps=60).trust_tolerance
    for gone in ("freeze_spread", "freeze_levels", "variance_rise", "trust_rise", "freeze_ready_step",
                 "trust_peak_step", "unfrozen_at"):
        assert gone not in m
    assert (main_job_runs["auto"] / "freeze.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt
    from test_train_plots import assert_no_holes

    from onebitlamb.train import plots

    fig = plots.freeze_figure(m)  # 60 steps: a window passed, the spread has its panel
    assert len(fig.axes) >= 2
    assert_no_holes(fig)
    plt.close(fig)
    assert not (main_job_runs["fixed"] / "freeze.png").exists()  # nothing to explain for a fixed freeze


def test_resume_of_the_automatic_freeze_is_bit_identical(main_job_runs, tmp_path, corpus_dir, compared):
    """The automatic freeze's history lives in the optimizer's state: a run stopped in the middle
    of the warm-up's window ends as the uninterrupted run of the same machine, bit for bit. The
    stop and the resume run on the persistent ranks (tests/pretrain_pool.py), without a launch:
    what a resume with the command adds (its launcher and workers) is test_resume_is_bit_identical's."""
    _, cache, _ = compared
    common = PINS["main_job_common_flags"].split(" --corpus ")[0].split()
    flags = [*common, *PINNED_DEFAULTS, "--freeze", "auto", "--corpus", corpus_dir, "--out", str(tmp_path),
             "--cache-dir", str(cache), "--no-progress"]
    assert flags[0] == "pretrain"
    stopped = pretrain_on_ranks(*flags[1:], "--stop-after-steps", "25").summary
    assert stopped["step"] == 25 and not stopped["completed"]
    assert pretrain_on_ranks(*flags[1:], "--resume").summary["completed"]
    assert _model_sha256(tmp_path / "model_final.pt") == _model_sha256(main_job_runs["auto"] / "model_final.pt")
    with open(tmp_path / "metrics.json") as f:
        resumed = json.load(f)
    with open(main_job_runs["auto"] / "metrics.json") as f:
        uninterrupted = json.load(f)
    assert resumed["freeze"] == uninterrupted["freeze"] and resumed["eval_curve"] == uninterrupted["eval_curve"]


def test_torchrun_launch_matches_local_launch(compared, tmp_path, corpus_dir):
    """Under torchrun the ranks come from the environment; the numbers are those of the local launcher."""
    out, cache, _ = compared
    from onebitlamb.comm.launch import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "onebitlamb", "pretrain", "--preset", "tiny",
                           "--optimizer", "onebitlamb", "--freeze", "0.35", "--out", str(tmp_path), "--corpus",
                           corpus_dir, "--cache-dir", str(cache), "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    local = torch.load(out / "onebitlamb" / "model_final.pt")
    launched = torch.load(tmp_path / "model_final.pt")
    for k in local:
        assert torch.equal(local[k], launched[k]), k


def test_ctrl_c_leaves_a_usable_checkpoint(compared, tmp_path, corpus_dir):
    """SIGINT to the launcher: the workers finish the step, checkpoint, exit with 130; --resume goes on
    (on the persistent ranks, tests/pretrain_pool.py: the command's resume is test_resume_is_bit_identical's)."""
    import signal
    import threading

    _, cache, _ = compared
    common = ["--preset", "tiny", "--optimizer", "onebitlamb", "--steps", "100000", "--eval-every", "100000",
              "--ckpt-every", "100000", "--out", str(tmp_path), "--corpus", corpus_dir, "--cache-dir", str(cache),
              "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "onebitlamb", "pretrain", *common], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(240, proc.kill)  # never hang the suite
    timer.start()
    try:
        for line in proc.stderr:  # the first evaluation is printed just before the first step
            if "step 0: held-out loss" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait() == 130, rest
    finally:
        timer.cancel()
    assert "stopped (interrupt)" in rest
    with open(tmp_path / "checkpoint.json") as f:
        step = json.load(f)["step"]
    assert step >= 1
    resumed = pretrain_on_ranks(*common, "--resume", "--stop-after-steps", str(step + 2)).summary
    assert resumed["step"] == step + 2
    with open(tmp_path / "checkpoint.json") as f:
        assert json.load(f)["step"] == step + 2


def test_zero_one_adam_resumes_between_syncs_and_counts_its_rounds(compared, tmp_path, corpus_dir):
    """``--optimizer zerooneadam`` on tiny (8 steps, a checkpoint every 4): the variance frozen
    after step 2 (0.25), the local interval doubling after every step (0.1 of 8 rounds to 1): syncs
    at 3 and 4, then local steps (intervals 8 and 16). Stopped after step 6, between syncs (each
    rank's parameters go into its own file), and resumed: the same final model, bit for bit, as
    the uninterrupted run. The run ends on a local step, and the main job synchronizes the ranks
    there (``optimizer.synchronize()``): the final checkpoint holds one model, the same on every
    rank (before, each rank's own, and the final model was rank 0's). Its metrics count the rounds
    beside the bytes. The three runs are on the persistent ranks (tests/pretrain_pool.py), without
    a launch: each rank's files are written and read by the workers' own code there; the command's
    resume (its launcher and workers) is test_resume_is_bit_identical's."""
    _, cache, _ = compared
    common = ["--preset", "tiny", "--optimizer", "zerooneadam", "--corpus", corpus_dir,
              "--cache-dir", str(cache), "--no-progress", "--ckpt-every", "4"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert pretrain_on_ranks(*common, "--out", str(whole)).summary["completed"]
    assert pretrain_on_ranks(*common, "--out", str(part), "--stop-after-steps", "6").summary["step"] == 6
    assert "model" in torch.load(part / "ckpt-0000006" / "rank1.pt", weights_only=True)
    assert pretrain_on_ranks(*common, "--out", str(part), "--resume").summary["completed"]
    a, b = torch.load(whole / "model_final.pt"), torch.load(part / "model_final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the ranks' parameters were checked alike before the last checkpoint, which keeps one model
    for rank in (0, 1):
        assert "model" not in torch.load(whole / "ckpt-0000008" / f"rank{rank}.pt", weights_only=True)
    saved = torch.load(whole / "ckpt-0000008" / "model.pt")
    assert all(torch.equal(saved[k], a[k]) for k in a)
    with open(whole / "metrics.json") as f:
        m = json.load(f)
    assert m["stage"] == ["warmup"] * 2 + ["compression"] * 2 + ["local"] * 4
    # a variance step and a local step one round each, a sync three (the finite flag, all-to-all,
    # all-gather), the final synchronize() two (all-to-all, all-gather)
    assert m["rounds_per_rank"] == m["rounds_curve"][-1][1] == 2 * 1 + 2 * 3 + 4 * 1 + 2
