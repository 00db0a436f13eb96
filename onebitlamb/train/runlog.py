"""What a run of the main job reports while it runs, on rank 0: the console, ``OUT/log.csv`` and,
when ``tensorboard`` is installed, TensorBoard events in ``OUT/tensorboard``.

The console gets a progress bar when it is a terminal (and ``--no-progress`` is not given), the
held-out losses and the freeze written above it; anywhere else (a log file, a pipe, a CI job) one
plain line per report: every evaluation, the freeze, and at least one line a minute. Every row
of ``log.csv`` is made from the run's history alone, so a resumed run rewrites the rows up to its
checkpoint and its file ends equal to an uninterrupted run's.
"""
from __future__ import annotations

import csv
import os
import sys
import time
from typing import IO, List, Optional

from onebitlamb.train import files

COLUMNS = ("step", "loss", "heldout_loss", "bytes", "collectives", "lr", "stage")
CSV_FILE = "log.csv"
TENSORBOARD_DIR = "tensorboard"
# the stage as a TensorBoard scalar: LAMB is 0 throughout, a 1-bit optimizer steps from 0 to 1 at the freeze
STAGE_VALUES = {"warmup": 0, "compression": 1, "local": 2}
PLAIN_EVERY_S = 60.0  # without a bar: a line at least this often, for runs with evaluations far apart


class RunLog:
    """Rank 0's reports of one run. ``report(step, history)`` after each step (and after the
    first evaluation, as step 0); ``close()`` at the end."""

    def __init__(self, cfg, start_step: int, history: dict, stream: Optional[IO[str]] = None) -> None:
        self.name, self.out, self.steps, self.global_batch = cfg.optimizer, cfg.out, cfg.steps, cfg.global_batch
        # what stage 2 compresses: Adam's direction in the update space (the default), else the momentum
        update_space = getattr(cfg, "compression_space", "update") == "update" and cfg.optimizer != "onebitadam"
        self.sent = "Adam's direction m / (sqrt(v) + eps)" if update_space else "the momentum"
        self.stream = sys.stderr if stream is None else stream
        self.start_step, self.train_before = start_step, history["train_time_s"]
        self.last_line = time.monotonic()
        self.bar = _progress_bar(self.name, cfg.steps, start_step, self.stream) \
            if cfg.progress and _is_terminal(self.stream) else None
        self.file = files.create(os.path.join(cfg.out, CSV_FILE), binary=False, newline="")
        self.csv = csv.writer(self.file)
        self.csv.writerow(COLUMNS)
        for step in range(start_step + 1) if start_step else ():  # the rows up to the checkpoint
            self.csv.writerow(row(step, history, cfg.global_batch))
        self.file.flush()
        self.tensorboard = _tensorboard(os.path.join(cfg.out, TENSORBOARD_DIR), start_step, self.say)
        where = f"{os.path.join(cfg.out, CSV_FILE)}"
        if self.tensorboard is not None:
            where += f", TensorBoard: tensorboard --logdir {os.path.join(cfg.out, TENSORBOARD_DIR)}"
        self.say(f"[{self.name}] metrics of every step: {where}")

    def report(self, step: int, history: dict) -> None:
        """Step ``step`` is done (its record, and its evaluation if there was one, in ``history``)."""
        values = row(step, history, self.global_batch)
        try:
            self.csv.writerow(values)
            self.file.flush()  # `tail -f log.csv` sees every step
        except OSError as exc:  # a full disk: one sentence naming the file (files.write_failed)
            raise files.write_failed(os.path.join(self.out, CSV_FILE), exc) from None
        record = dict(zip(COLUMNS, values))
        frozen = step > 0 and _frozen_at(history["steps"][step - 1]) == step
        if self.tensorboard is not None:
            for tag, value in scalars(record, frozen):
                self.tensorboard.add_scalar(tag, value, step)
        if self.bar is not None and step > self.start_step:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", sps=f"{self._samples_per_s(step, history):.0f}",
                                 stage=record["stage"], MB=f"{record['bytes'] / 1e6:.1f}", refresh=False)
        if record["heldout_loss"] != "":
            self._line(step, history, record, f"held-out loss {record['heldout_loss']:.4f}")
        elif self.bar is None and step and time.monotonic() - self.last_line >= PLAIN_EVERY_S:
            self._line(step, history, record, "")
        if frozen:
            self.say(f"[{self.name}] step {step}: the freeze: the variance is frozen, {self.sent} goes out "
                     f"compressed to 1 bit from step {step + 1} on ({record['bytes'] / 1e6:.1f} MB sent so far)")

    def say(self, line: str) -> None:
        """A line of its own: above the bar when there is one."""
        self.last_line = time.monotonic()
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _line(self, step: int, history: dict, record: dict, first: str) -> None:
        """One report. With a bar, the held-out loss alone (the bar shows the rest)."""
        if self.bar is None and step:
            rest = (f"train loss {record['loss']:.4f}, {record['bytes'] / 1e6:.1f} MB sent, "
                    f"{self._samples_per_s(step, history):.0f} samples/s, {record['stage']}, {step}/{self.steps}")
            first = f"{first} | {rest}" if first else rest
        self.say(f"[{self.name}] step {step}: {first}")

    def _samples_per_s(self, step: int, history: dict) -> float:
        seconds = history["train_time_s"] - self.train_before
        return (step - self.start_step) * self.global_batch / max(seconds, 1e-9)


def row(step: int, history: dict, global_batch: int) -> List:
    """The CSV row of ``step`` from the history alone (step 0: the evaluation before training).
    Empty cells: no evaluation after that step, no record of the collectives (older checkpoints)."""
    heldout = next((loss for samples, loss in history["eval"] if samples == step * global_batch), "")
    if step == 0:
        return [0, "", heldout, 0, 0, "", ""]
    r = history["steps"][step - 1]
    return [step, r["loss"], heldout, r["bytes"], r.get("collectives", ""), r["lr"], r["stage"]]


def scalars(record: dict, frozen: bool) -> List[tuple]:
    """The TensorBoard scalars of one step's log row: ``(tag, value)``. Beside the row's numbers,
    ``stage/current`` (0 warm-up, 1 compression, 2 0/1 Adam's local steps; from step 1) and, at the
    step the freeze happened (``frozen``), ``stage/freeze_step``, its value the step."""
    out = [(tag, record[key]) for tag, key in (("loss/train", "loss"), ("loss/heldout", "heldout_loss"),
                                               ("comm/bytes_sent", "bytes"), ("comm/collectives", "collectives"),
                                               ("lr", "lr")) if record[key] != ""]
    if record["stage"] in STAGE_VALUES:
        out.append(("stage/current", STAGE_VALUES[record["stage"]]))
    if frozen:
        out.append(("stage/freeze_step", record["step"]))
    return out


def _frozen_at(record: dict) -> Optional[int]:
    freeze = record.get("freeze")
    return None if freeze is None else freeze.get("frozen_at")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _progress_bar(name: str, steps: int, start: int, stream):
    from tqdm import tqdm

    return tqdm(total=steps, initial=start, desc=name, unit="step", dynamic_ncols=True, file=stream,
                mininterval=0.5)


def _tensorboard(log_dir: str, start_step: int, say):
    """A SummaryWriter when ``tensorboard`` is installed, else None without a word: it is optional.
    A resumed run purges the events after its checkpoint's step, as log.csv rewrites its rows."""
    if os.path.islink(log_dir):  # SummaryWriter would write through it
        say(f"TensorBoard events not written: {log_dir} is a link (not followed); log.csv has the same numbers")
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=log_dir, purge_step=start_step + 1 if start_step else None)
    except ImportError:  # torch's message when tensorboard is not installed
        return None
    except Exception as exc:  # noqa: BLE001 (installed but broken, e.g. its protobuf: the run goes on)
        say(f"TensorBoard events not written ({type(exc).__name__}: {exc}); log.csv has the same numbers")
        return None
