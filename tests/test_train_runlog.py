"""The main job's reports (onebitlamb/train/runlog.py) without training: a progress bar on a
terminal with the held-out losses and the freeze above it, plain lines elsewhere, log.csv rewritten
to the checkpoint on resume, and TensorBoard events through a stand-in SummaryWriter (tensorboard
is optional and not installed here). The real runs: tests/test_train_e2e.py."""
import csv
import io
import re
import sys
import types
from types import SimpleNamespace

import pytest

from onebitlamb.train import runlog


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _cfg(out, progress=True, compression_space="update", optimizer="onebitlamb"):
    return SimpleNamespace(optimizer=optimizer, out=str(out), steps=6, global_batch=16, progress=progress,
                           compression_space=compression_space)


def _history(steps=6, freeze=3):
    """A run's record as pretrain keeps it: evaluations after steps 0, 4 and 6, the freeze at 3."""
    history = {"steps": [], "eval": [[0, 6.5]], "train_time_s": 0.0}
    for s in range(1, steps + 1):
        history["steps"].append({"loss": 7.0 - s / 10, "bytes": 1000 * s, "collectives": 2 * s, "lr": 0.01,
                                 "stage": "warmup" if s <= freeze else "compression",
                                 "freeze": {"frozen_at": freeze if s >= freeze else None}})
        if s in (4, 6):
            history["eval"].append([16 * s, 6.5 - s / 10])
    history["train_time_s"] = 0.1 * steps
    return history


def _run(log, history, first=0):
    for step in range(first, len(history["steps"]) + 1):
        log.report(step, history)
    log.close()


def _no_tensorboard(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError


@pytest.mark.parametrize("progress", [True, False])
def test_on_a_terminal_the_freeze_is_announced_with_and_without_the_bar(tmp_path, monkeypatch, progress):
    _no_tensorboard(monkeypatch)
    stream = Terminal()
    _run(runlog.RunLog(_cfg(tmp_path, progress), 0, _history(), stream=stream), _history())
    text = stream.getvalue()
    assert ("\r" in text) == progress  # the bar redraws itself with carriage returns
    lines = [line.split("\r")[-1] for line in text.split("\n")]
    assert "[onebitlamb] step 3: the freeze: the variance is frozen, Adam's direction m / (sqrt(v) + eps) goes out " \
           "compressed to 1 bit from step 4 on (0.0 MB sent so far)" in lines
    for step, loss in ((0, 6.5), (4, 6.1), (6, 5.9)):
        assert any(line.startswith(f"[onebitlamb] step {step}: held-out loss {loss:.4f}") for line in lines), text
    assert "tensorboard" not in text.lower()


@pytest.mark.parametrize("optimizer,space", [("onebitlamb", "momentum"), ("onebitadam", "update")])
def test_the_freeze_names_what_goes_out(tmp_path, monkeypatch, optimizer, space):
    """The paper's space, and 1-bit Adam (which has no other), send the momentum itself."""
    _no_tensorboard(monkeypatch)
    stream = io.StringIO()
    _run(runlog.RunLog(_cfg(tmp_path, compression_space=space, optimizer=optimizer), 0, _history(), stream=stream),
         _history())
    assert "the variance is frozen, the momentum goes out compressed to 1 bit" in stream.getvalue()


def test_without_a_terminal_one_plain_line_per_report(tmp_path, monkeypatch):
    """A log file or pipe: no bar even when progress is on, one line per evaluation and the freeze."""
    _no_tensorboard(monkeypatch)
    stream = io.StringIO()
    _run(runlog.RunLog(_cfg(tmp_path), 0, _history(), stream=stream), _history())
    lines = [re.sub(r"[0-9]+ samples/s", "N samples/s", line) for line in stream.getvalue().splitlines()]
    assert "\r" not in stream.getvalue()
    assert lines == [
        f"[onebitlamb] metrics of every step: {tmp_path}/log.csv",
        "[onebitlamb] step 0: held-out loss 6.5000",
        "[onebitlamb] step 3: the freeze: the variance is frozen, Adam's direction m / (sqrt(v) + eps) goes out "
        "compressed to 1 bit from step 4 on (0.0 MB sent so far)",
        "[onebitlamb] step 4: held-out loss 6.1000 | train loss 6.6000, 0.0 MB sent, N samples/s, compression, 4/6",
        "[onebitlamb] step 6: held-out loss 5.9000 | train loss 6.4000, 0.0 MB sent, N samples/s, compression, 6/6",
    ]


def test_a_resumed_run_rewrites_the_log_up_to_its_checkpoint(tmp_path, monkeypatch):
    _no_tensorboard(monkeypatch)
    full = _history()
    _run(runlog.RunLog(_cfg(tmp_path), 0, full, stream=io.StringIO()), full)
    uninterrupted = (tmp_path / "log.csv").read_text()
    (tmp_path / "log.csv").write_text(uninterrupted + "7,1,,1,1,1,stale row of steps after the checkpoint\n")
    at_checkpoint = {**full, "steps": full["steps"][:4], "eval": full["eval"][:2]}
    log = runlog.RunLog(_cfg(tmp_path), 4, at_checkpoint, stream=io.StringIO())
    with open(tmp_path / "log.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2", "3", "4"]
    _run(log, full, first=5)
    assert (tmp_path / "log.csv").read_text() == uninterrupted


class _Writer:
    """Records what a torch.utils.tensorboard.SummaryWriter is asked to do."""
    made = []

    def __init__(self, log_dir=None, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        _Writer.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


def test_tensorboard_events_when_it_is_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_Writer))
    _Writer.made.clear()
    stream = io.StringIO()
    history = _history()
    _run(runlog.RunLog(_cfg(tmp_path), 0, history, stream=stream), history)
    (writer,) = _Writer.made
    assert writer.log_dir == str(tmp_path / "tensorboard") and writer.purge_step is None and writer.closed
    assert f"tensorboard --logdir {tmp_path}/tensorboard" in stream.getvalue()
    by_tag = {}
    for tag, value, step in writer.scalars:
        by_tag.setdefault(tag, []).append((step, value))
    assert by_tag["loss/heldout"] == [(samples // 16, loss) for samples, loss in history["eval"]]
    assert by_tag["loss/train"] == [(s, r["loss"]) for s, r in enumerate(history["steps"], 1)]
    assert by_tag["comm/bytes_sent"][-1] == (6, 6000) and by_tag["comm/collectives"][-1] == (6, 12)
    assert [s for s, _ in by_tag["lr"]] == list(range(1, 7))
    # the stage of every step (0 warm-up, 1 compression) and the step of the freeze, once
    assert by_tag["stage/current"] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)]
    assert by_tag["stage/freeze_step"] == [(3, 3)]
    # resumed at step 4: the events after the checkpoint are purged, as the log's rows are rewritten
    runlog.RunLog(_cfg(tmp_path), 4, history, stream=io.StringIO()).close()
    assert _Writer.made[-1].purge_step == 5


def test_tensorboard_scalars_of_lamb_and_of_local_steps():
    """LAMB stays at stage 0 and never has a freeze step; 0/1 Adam's local steps are stage 2."""
    lamb = {"step": 5, "loss": 6.0, "heldout_loss": "", "bytes": 10, "collectives": 5, "lr": 0.01, "stage": "warmup"}
    assert runlog.scalars(lamb, frozen=False) == [("loss/train", 6.0), ("comm/bytes_sent", 10),
                                                 ("comm/collectives", 5), ("lr", 0.01), ("stage/current", 0)]
    assert ("stage/current", 2) in runlog.scalars({**lamb, "stage": "local"}, frozen=False)
    before_training = dict(zip(runlog.COLUMNS, [0, "", 6.5, 0, 0, "", ""]))
    assert runlog.scalars(before_training, frozen=False) == [("loss/heldout", 6.5), ("comm/bytes_sent", 0),
                                                            ("comm/collectives", 0)]
