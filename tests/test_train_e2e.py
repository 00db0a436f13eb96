"""End to end: `onebitlamb compare --preset tiny` on 2 local workers (the three optimizers, crossing
the freeze), its files, and an exact `--resume` of an interrupted 1-bit LAMB run."""
import json
import os
import subprocess
import sys

import pytest
import torch

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
    proc = _cli("compare", "--preset", "tiny", "--out", str(out), "--corpus", corpus_dir, "--cache-dir", str(cache),
                "--no-progress")
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
    curve = runs["onebitlamb"]["bytes_curve"]
    warm_step, comp_step = curve[1][1] - curve[0][1], curve[-1][1] - curve[-2][1]
    assert comp_step * 10 < warm_step
    # per-layer diagnostics at the evaluation points
    diag = runs["onebitlamb"]["diagnostics"]
    assert [d["step"] for d in diag] == [4, 8]
    layer = diag[-1]["layers"][0]
    assert layer["frozen_coeff"] is not None and layer["factor"] is not None and layer["rel_step"] > 0
    assert runs["lamb"]["diagnostics"][-1]["layers"][0]["frozen_coeff"] is None
    for png in ("compare.png", "diagnostics.png"):
        with open(out / png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_resume_is_bit_identical(compared, tmp_path, corpus_dir):
    out, cache, _ = compared
    common = ["--preset", "tiny", "--optimizer", "onebitlamb", "--out", str(tmp_path), "--corpus", corpus_dir,
              "--cache-dir", str(cache), "--no-progress"]
    _cli("pretrain", *common, "--stop-after-steps", "5")  # after the freeze at step 3
    assert not (tmp_path / "metrics.json").exists()
    with open(tmp_path / "checkpoint.json") as f:
        assert json.load(f)["step"] == 5
    env = dict(os.environ, OMP_NUM_THREADS="1")
    refused = subprocess.run([sys.executable, "-m", "onebitlamb", "pretrain", *common, "--resume", "--lr", "0.5"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "different settings" in refused.stderr
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


def test_auto_freeze_run_records_the_levels_and_plots_them(compared, tmp_path, corpus_dir):
    _, cache, _ = compared
    _cli("pretrain", "--preset", "tiny", "--optimizer", "onebitlamb", "--auto-freeze", "--freeze-window", "2",
         "--freeze-frac", "0.75", "--unfreeze-rise", "50", "--eval-every", "1", "--out", str(tmp_path), "--corpus",
         corpus_dir, "--cache-dir", str(cache), "--no-progress")
    with open(tmp_path / "metrics.json") as f:
        m = json.load(f)
    # a diagnostic at every step says the stage that step ran in, the freeze's own step (warm-up) included
    assert [d["step"] for d in m["diagnostics"]] == list(range(1, 9))
    assert [d["stage"] for d in m["diagnostics"]] == m["stage"] and m["stage"][m["freeze_step"] - 1] == "warmup"
    levels, freeze = m["freeze_levels"], m["freeze_step"]
    assert levels["layers"] == [layer["name"] for layer in m["diagnostics"][0]["layers"]]
    recorded = [i + 1 for i, row in enumerate(levels["per_step"]) if row is not None]
    assert 1 <= freeze <= 6 and recorded == list(range(1, freeze + 1))  # every warm-up step, the freeze's own too
    assert all(len(levels["per_step"][i - 1]) == len(levels["layers"]) for i in recorded)
    # --unfreeze-rise: the rise of every layer on every step after the freeze, up to the cap (6 of 8
    # steps: from there the freeze is final and nothing is watched); none undid it
    rises = m["variance_rise"] or {"layers": levels["layers"], "per_step": []}
    assert rises["layers"] == levels["layers"]
    assert [i + 1 for i, row in enumerate(rises["per_step"]) if row is not None] == list(range(freeze + 1, 6))
    assert m["unfrozen_at"] == [] and m["warmup_steps"] == freeze
    with open(tmp_path / "freeze.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_automatic_freeze_waits_for_the_trust_peak_by_default_and_records_the_wait(compared, tmp_path, corpus_dir):
    _, cache, _ = compared
    _cli("pretrain", "--preset", "tiny", "--optimizer", "onebitlamb", "--auto-freeze",
         "--freeze-window", "2", "--steps", "16", "--freeze-frac", "0.75", "--out", str(tmp_path), "--corpus",
         corpus_dir, "--cache-dir", str(cache), "--no-progress")
    with open(tmp_path / "metrics.json") as f:
        m = json.load(f)
    freeze, ready, rise = m["freeze_step"], m["freeze_ready_step"], m["trust_rise"]
    assert ready is not None and ready + 2 <= freeze <= 12, (ready, freeze)
    # recorded on every warm-up step with a window (3 levels) in, the freeze's own included; the
    # window restarts at the step the criterion held
    recorded = [i + 1 for i, r in enumerate(rise) if r is not None]
    assert recorded == [s for s in range(3, freeze + 1) if not ready <= s < ready + 2], (recorded, ready)
    waited = m["trust_peak_step"]  # the step the wait ended; None when the cap came first
    assert all(r > 0 for r in rise[ready + 1:(waited or freeze) - 1])  # it waited only while the trust ratios rose
    assert freeze == 12 if waited is None else rise[waited - 1] <= 0  # the cap, or the wait's own step decided
    # never before the floor under the wait, 30% of the steps by default: at the wait's end or at the floor
    assert waited is None or freeze == max(waited, round(0.3 * 16)), (waited, freeze)
    assert (tmp_path / "freeze.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # with the rise on its own scale


def test_freeze_after_trust_peak_needs_the_automatic_freeze(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "onebitlamb", "pretrain", "--preset", "tiny", "--optimizer",
                           "onebitlamb", "--freeze-after-trust-peak", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--freeze-after-trust-peak delays the automatic freeze" in proc.stderr


def test_changed_settings_ignores_only_what_the_run_does_not_read():
    import dataclasses

    from onebitlamb.train import pretrain

    def cfg(*flags):
        import argparse

        parser = argparse.ArgumentParser()
        pretrain.add_arguments(parser)
        return pretrain.config_from_args(parser.parse_args(["--preset", "tiny", "--out", "a", *flags]))

    def changed(saved_flags, now_flags):
        return set(pretrain.changed_settings(cfg(*now_flags), dataclasses.asdict(cfg(*saved_flags))))

    auto = ["--optimizer", "onebitlamb", "--auto-freeze"]
    assert changed(auto + ["--freeze-tolerance", "0.25"], auto) == {"freeze_tolerance"}
    assert changed(auto + ["--lr", "1e-2"], auto + ["--out", "b", "--no-progress"]) == {"lr"}
    # a run saved before a setting existed ran with the value that stands for the old behaviour (the
    # transient's end at half the peak), not with the new default
    early = auto + ["--min-freeze-frac", "0.05"]  # the floor before the one under the wait
    older = dataclasses.asdict(cfg(*early))
    del older["freeze_transient_end"]
    assert set(pretrain.changed_settings(cfg(*early), older)) == {"freeze_transient_end"}
    assert pretrain.changed_settings(cfg(*early, "--freeze-transient-end", "0"), older) == {}
    del older["unfreeze_rise"]  # a run from before the undone freeze: it had none
    assert pretrain.changed_settings(cfg(*early, "--freeze-transient-end", "0"), older) == {}
    assert set(pretrain.changed_settings(cfg(*early, "--freeze-transient-end", "0", "--unfreeze-rise", "4"),
                                         older)) == {"unfreeze_rise"}
    del older["freeze_after_trust_peak"]  # a run from before the option waited for no trust peak
    assert pretrain.changed_settings(cfg(*early, "--freeze-transient-end", "0", "--no-freeze-after-trust-peak"),
                                     older) == {}
    assert set(pretrain.changed_settings(cfg(*early, "--freeze-transient-end", "0"), older)) == {
        "freeze_after_trust_peak"}  # now the default: that run is not this one
    fixed = ["--optimizer", "onebitlamb"]
    assert changed(fixed + ["--freeze-tolerance", "0.25"], fixed) == set()  # a fixed freeze never reads it
    # on by default only where there is an automatic freeze to delay; 1-bit Adam has no trust ratio
    assert cfg(*auto).freeze_after_trust_peak is True and cfg(*fixed).freeze_after_trust_peak is False
    adam = ["--optimizer", "onebitadam", "--auto-freeze"]
    assert changed(adam + ["--no-freeze-after-trust-peak"], adam) == set()
    # which layers the wait reads changes a run only where it waits; a run from before the option read all
    unclipped = ["--trust-peak-layers", "unclipped"]
    assert changed(auto, auto + unclipped) == {"trust_peak_layers"}
    assert changed(auto + ["--no-freeze-after-trust-peak"], auto + ["--no-freeze-after-trust-peak"] + unclipped) == set()
    assert changed(adam, adam + unclipped) == set()
    before = dataclasses.asdict(cfg(*auto))
    del before["trust_peak_layers"]
    assert pretrain.changed_settings(cfg(*auto), before) == {}
    assert set(pretrain.changed_settings(cfg(*auto, *unclipped), before)) == {"trust_peak_layers"}
    # so does how it judges the peak; a run from before the option judged by the median of the rises
    level = ["--trust-peak-measure", "median_level"]
    assert changed(auto, auto + level) == {"trust_peak_measure"}
    assert changed(auto + ["--no-freeze-after-trust-peak"], auto + ["--no-freeze-after-trust-peak"] + level) == set()
    assert changed(adam, adam + level) == set()
    del before["trust_peak_measure"]
    assert pretrain.changed_settings(cfg(*auto), before) == {}
    assert set(pretrain.changed_settings(cfg(*auto, *level), before)) == {"trust_peak_measure"}
    assert changed(fixed + ["--freeze-frac", "0.2"], fixed) == {"freeze_frac"}
    lamb = ["--optimizer", "lamb"]
    assert changed(lamb + ["--freeze-frac", "0.2", "--update-guard", "4"], lamb) == set()  # LAMB never freezes
    assert changed(lamb + ["--seed", "7"], lamb) == {"seed"}
    # the floor: 30% of the steps under 1-bit LAMB's wait, the early 5% where no wait reads it, so a
    # run with the wait from before the floor moved is not this one, and 1-bit Adam's runs stay valid
    no_wait = auto + ["--no-freeze-after-trust-peak"]
    assert (cfg(*auto).min_freeze_frac, cfg(*no_wait).min_freeze_frac, cfg(*adam).min_freeze_frac) == (0.3, 0.05, 0.05)
    assert changed(auto + ["--min-freeze-frac", "0.05"], auto) == {"min_freeze_frac"}
    assert changed(no_wait + ["--min-freeze-frac", "0.05"], no_wait) == set()
    assert changed(adam + ["--min-freeze-frac", "0.05"], adam) == set()
    assert cfg(*auto, "--min-freeze-frac", "0.1").min_freeze_frac == 0.1


def test_torchrun_launch_matches_local_launch(compared, tmp_path, corpus_dir):
    """Under torchrun the ranks come from the environment; the numbers are those of the local launcher."""
    out, cache, _ = compared
    from onebitlamb.comm.launch import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "onebitlamb", "pretrain", "--preset", "tiny",
                           "--optimizer", "onebitlamb", "--out", str(tmp_path), "--corpus", corpus_dir,
                           "--cache-dir", str(cache), "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    local = torch.load(out / "onebitlamb" / "model_final.pt")
    launched = torch.load(tmp_path / "model_final.pt")
    for k in local:
        assert torch.equal(local[k], launched[k]), k


def test_ctrl_c_leaves_a_usable_checkpoint(compared, tmp_path, corpus_dir):
    """SIGINT to the launcher: the workers finish the step, checkpoint, exit with 130; --resume goes on."""
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
    _cli("pretrain", *common, "--resume", "--stop-after-steps", str(step + 2))
    with open(tmp_path / "checkpoint.json") as f:
        assert json.load(f)["step"] == step + 2
