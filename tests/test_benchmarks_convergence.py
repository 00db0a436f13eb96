"""The convergence benchmark without training: its rows' commands, the reuse and resumption of runs,
and the table it renders from metrics.json files written here by hand."""
import dataclasses
import json
import sys

import pytest

from benchmarks import convergence
from benchmarks.convergence import ROWS, main, pretrain_args, run_folder, run_one, run_state
from onebitlamb.train import config

# (preset, seed, row folder) -> final_eval_loss, freeze_step, bytes_sent_per_rank
METRICS = {
    ("demo", 1234, "lamb"): (4.0, None, 1_000_000_000),
    ("demo", 1235, "lamb"): (4.2, None, 1_000_000_000),
    ("demo", 1234, "onebitlamb-auto"): (4.08, 180, 400_000_000),     # +2% against LAMB
    ("demo", 1235, "onebitlamb-auto"): (4.242, 200, 300_000_000),    # +1%
    ("demo", 1234, "onebitadam-auto"): (4.4, 30, 100_000_000),       # +10%
    ("demo", 1235, "onebitadam-auto"): (4.62, 45, 120_000_000),      # +10%
    ("demo", 1234, "zerooneadam"): (4.04, None, 40_000_000, 300),     # +1%
    ("demo", 1235, "zerooneadam"): (4.2, None, 60_000_000, 500),      # 0%
}


def run_config(args):
    """The config a run of ``onebitlamb ARGS`` records in its metrics.json."""
    return dataclasses.asdict(config.config_from_flags([*args[1:], "--out", "x"]))


def write_metrics(folder, loss, freeze_step, sent, rounds=None, args=None):
    """A finished run's metrics.json; ``args``: the command it ran (its config), None for none."""
    folder.mkdir(parents=True, exist_ok=True)
    extra = {} if rounds is None else {"rounds_per_rank": rounds}  # runs from before rounds were counted have none
    if args is not None:
        extra["config"] = run_config(args)
    (folder / "metrics.json").write_text(json.dumps(dict(
        final_eval_loss=loss, freeze_step=freeze_step, bytes_sent_per_rank=sent,
        steps=600, samples=76_800, world_size=4, **extra)))


def write_all(out, seeds=(1234, 1235)):
    rows = {row.folder: row for row in ROWS}
    for (preset, seed, name), values in METRICS.items():
        if seed in seeds:
            write_metrics(out / preset / str(seed) / name, *values, args=pretrain_args(preset, seed, rows[name]))


@pytest.fixture
def no_training(monkeypatch):
    def launch(command):
        raise AssertionError(f"a run was started: {command}")
    monkeypatch.setattr(convergence, "launch", launch)


def section(path):
    return path.read_text().split("<!-- begin convergence -->", 1)[1].split("<!-- end convergence -->", 1)[0]


def test_each_row_is_the_main_job_with_its_flags():
    assert [pretrain_args("b1024", 1235, row) for row in ROWS] == [
        ["pretrain", "--preset", "b1024", "--seed", "1235", "--optimizer", "lamb"],
        ["pretrain", "--preset", "b1024", "--seed", "1235", "--optimizer", "onebitlamb", "--freeze", "auto"],
        ["pretrain", "--preset", "b1024", "--seed", "1235", "--optimizer", "onebitadam", "--freeze", "auto"],
        ["pretrain", "--preset", "b1024", "--seed", "1235", "--optimizer", "zerooneadam"],
    ]
    assert run_folder("runs/convergence", "b1024", 1235, ROWS[2]) == "runs/convergence/b1024/1235/onebitadam-auto"


def test_the_table_from_finished_runs_without_training(tmp_path, no_training):
    write_all(tmp_path / "runs")
    results = tmp_path / "B.md"
    results.write_text("# Benchmarks\n\n<!-- begin kernels -->\nkept\n<!-- end kernels -->\n")
    assert main(["--seeds", "2", "--out", str(tmp_path / "runs"), "--results", str(results)]) == 0
    text = section(results)
    assert "<!-- begin kernels -->\nkept\n<!-- end kernels -->" in results.read_text()
    assert f"## {convergence.TITLE}\n" in text
    command = f"python -m benchmarks.convergence --seeds 2 --out {tmp_path / 'runs'} --results {results}"
    assert f"Command: `{command}`" in text
    assert "- 1-bit Adam, automatic freeze (default): `--optimizer onebitadam --freeze auto`" in text
    assert "### demo: 600 steps, 76,800 samples, 4 workers, seeds 1234, 1235\n" in text
    # means over the two seeds, ± the standard deviation (|a - b| / sqrt 2 for two values); gaps per seed,
    # then averaged; LAMB's 1,000 MB over the row's mean bytes
    assert "| LAMB | 2 | 4.100 ± 0.141 | - | - | 1,000.0 | 1.00x | - |" in text  # rounds not counted then
    assert "| 0/1 Adam, the main job's schedules | 2 | 4.120 ± 0.113 | +0.5% ± 0.7 | - | 50.0 | 20.00x | 400 |" in text
    assert ("| 1-bit LAMB, automatic freeze (default) | 2 | 4.161 ± 0.115 | +1.5% ± 0.7 | 180, 200 | 350.0 | 2.86x |"
            in text)
    assert ("| 1-bit Adam, automatic freeze (default) | 2 | 4.510 ± 0.156 | +10.0% ± 0.0 | 30, 45 | 110.0 | 9.09x |"
            in text)


def test_the_default_seed_is_1234(tmp_path, no_training):
    write_all(tmp_path / "runs", seeds=(1234,))
    results = tmp_path / "B.md"
    main(["--out", str(tmp_path / "runs"), "--results", str(results)])
    text = section(results)
    assert "### demo: 600 steps, 76,800 samples, 4 workers, seed 1234\n" in text
    assert "±" not in text.split("### demo")[1]  # no spread over one seed
    assert "| 1-bit LAMB, automatic freeze (default) | 1 | 4.080 | +2.0% | 180 | 400.0 | 2.50x |" in text


def test_list_shows_each_runs_state_and_runs_nothing(tmp_path, no_training, capsys):
    out = tmp_path / "runs"
    write_metrics(out / "demo" / "1234" / "lamb", 4.0, None, 1)
    (out / "demo" / "1234" / "onebitlamb-auto").mkdir(parents=True)
    (out / "demo" / "1234" / "onebitlamb-auto" / "checkpoint.json").write_text(json.dumps({"step": 40}))
    assert main(["--list", "--out", str(out), "--results", str(tmp_path / "B.md")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert "finished" in lines[0] and "interrupted at step 40" in lines[1]
    assert all("to run" in line for line in lines[2:])
    assert lines[2].endswith("onebitlamb pretrain --preset demo --seed 1234 --optimizer onebitadam --freeze auto")
    assert lines[3].endswith("onebitlamb pretrain --preset demo --seed 1234 --optimizer zerooneadam")
    assert not (tmp_path / "B.md").exists()


def test_a_missing_run_is_trained_and_an_interrupted_one_resumed(tmp_path, monkeypatch):
    started = []

    def launch(command):  # stands in for the training: records the command, writes the metrics
        started.append(command)
        folder = command[command.index("--out") + 1]
        write_metrics(tmp_path / folder, 4.5, 7, 10, args=command[3:command.index("--out")])

    monkeypatch.setattr(convergence, "launch", launch)
    monkeypatch.chdir(tmp_path)
    args = pretrain_args("tiny", 1234, ROWS[1])
    (tmp_path / "interrupted").mkdir()
    (tmp_path / "interrupted" / "checkpoint.json").write_text(json.dumps({"step": 4}))

    assert run_one("fresh", args, "cache")["final_eval_loss"] == 4.5
    assert run_one("interrupted", args, "cache")["freeze_step"] == 7
    assert started == [
        [sys.executable, "-m", "onebitlamb", *args, "--out", "fresh", "--cache-dir", "cache", "--no-progress"],
        [sys.executable, "-m", "onebitlamb", *args, "--out", "interrupted", "--cache-dir", "cache", "--no-progress",
         "--resume"],
    ]
    assert run_one("fresh", args, "cache")["final_eval_loss"] == 4.5 and len(started) == 2  # finished: reused
    # a finished run of other settings (as after a default changed) is refused, not read back as this one's
    saved = run_config(args)["warmup_dtype"]
    with pytest.raises(RuntimeError, match=rf"fresh holds a finished run with other settings.*'warmup_dtype': "
                                           rf"\('{saved}', 'int4'\)"):
        run_one("fresh", [*args, "--warmup-dtype", "int4"], "cache")
    assert len(started) == 2


def test_a_run_that_ends_without_metrics_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(convergence, "launch", lambda command: None)
    with pytest.raises(RuntimeError, match="without metrics.json"):
        run_one(str(tmp_path / "run"), pretrain_args("tiny", 1234, ROWS[0]), str(tmp_path / "cache"))
    assert run_state(str(tmp_path / "run")) == "to run"


def test_a_gpu_machines_rows_under_torchrun_into_their_own_section(tmp_path, monkeypatch):
    """What .ci/gpu-check runs: two rows, other steps (their own folders), each training under
    torchrun, the table into a section of its own (the CPU section kept)."""
    started = []

    def launch(command):
        started.append(command)
        folder = command[command.index("--out") + 1]
        write_metrics(tmp_path / folder, 4.0 if "lamb" == folder.rsplit("/", 1)[1] else 4.1, 20, 1000)

    monkeypatch.setattr(convergence, "launch", launch)
    results = tmp_path / "B.md"
    results.write_text("<!-- begin convergence -->\nCPU figures\n<!-- end convergence -->\n")
    out = tmp_path / "runs"
    assert main(["--presets", "large", "--rows", "lamb", "onebitlamb-auto", "--steps", "60", "--torchrun", "4",
                 "--section", "convergence-large", "--out", str(out), "--results", str(results)]) == 0
    assert [c[:6] for c in started] == [[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                         "--nproc-per-node=4", "-m"]] * 2
    assert [c[c.index("--optimizer") + 1] for c in started] == ["lamb", "onebitlamb"]
    assert all(c[c.index("--steps") + 1] == "60" and str(out / "large-60steps" / "1234") in c[c.index("--out") + 1]
               for c in started)
    text = results.read_text()
    assert "CPU figures" in text
    large = text.split("<!-- begin convergence-large -->", 1)[1]
    assert "torchrun with 4 ranks" in large and "1-bit Adam" not in large
    assert f"## {convergence.TITLE}: large, under torchrun\n" in large  # its own heading
    assert "| 1-bit LAMB, automatic freeze (default) | 1 | 4.100 | +2.5% | 20 |" in large


def test_rows_without_lamb_are_refused(tmp_path, no_training):
    with pytest.raises(SystemExit):
        main(["--rows", "onebitlamb-auto", "--out", str(tmp_path)])
