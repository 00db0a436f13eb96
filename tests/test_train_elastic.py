"""The main job resumes a checkpoint on another number of workers (4 -> 2, 2 -> 3): the compression
errors are re-sharded, and the run ends as close to where uninterrupted runs end as they are to
each other."""
import email
import json
import os
import re
import subprocess
import sys

import pytest

from pretrain_pool import pretrain_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flags(out, cache, workers, *extra):
    # tiny at 16 steps, frozen at step 6 (35%); a global batch of 24 splits over 2, 3 and 4 workers
    # only with micro-batches of 2
    return ["--preset", "tiny", "--steps", "16", "--eval-every", "8", "--freeze", "0.35", "--global-batch", "24",
            "--micro-batch", "2", "--workers", str(workers), "--out", str(out), "--cache-dir", str(cache),
            "--corpus", os.path.dirname(email.__file__), "--no-progress", *extra]


def _pretrain(out, cache, workers, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "onebitlamb", "pretrain", *_flags(out, cache, workers, *extra)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _final_loss(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)["final_eval_loss"]


# 2 -> 3 re-sharding is in the default run through test_elastic.py's library test; the CLI adds only
# the loading of every rank file, which 4 -> 2 covers
@pytest.mark.parametrize("before,after", [(4, 2), pytest.param(2, 3, marks=pytest.mark.slow)])
def test_a_run_resumes_on_another_number_of_workers(tmp_path, before, after):
    """The resume is the command's; the run it resumes and the uninterrupted runs it is held against
    are the same runs on the persistent ranks (tests/pretrain_pool.py), without 3 launches."""
    cache = tmp_path / "cache"
    resumed = tmp_path / "resumed"
    pretrain_on_ranks(*_flags(resumed, cache, before, "--stop-after-steps", "10"))  # 4 steps after the freeze
    proc = _pretrain(resumed, cache, after, "--resume")
    assert f"resuming a checkpoint of {before} ranks on {after}" in proc.stderr
    with open(resumed / "metrics.json") as f:
        metrics = json.load(f)
    assert metrics["world_size"] == after and metrics["freeze_step"] == 6
    straight = []
    for workers in (before, after):
        pretrain_on_ranks(*_flags(tmp_path / f"straight{workers}", cache, workers))
        straight.append(_final_loss(tmp_path / f"straight{workers}"))
    low, high = min(straight), max(straight)
    margin = max(high - low, 0.002 * high)  # the spread between the two, at least 0.2%
    assert low - margin <= metrics["final_eval_loss"] <= high + margin, (metrics["final_eval_loss"], straight)


def test_a_paused_rank_ends_the_run_with_a_message_saying_where(tmp_path):
    """A rank stopped with SIGSTOP (as a hung one): the other gives up after --timeout and the run
    ends with an error naming where it waited, instead of waiting 30 minutes in silence."""
    import signal
    import time

    args = ["pretrain", "--preset", "tiny", "--steps", "2000", "--eval-every", "4", "--ckpt-every", "1000",
            "--timeout", "5", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"),
            "--corpus", os.path.dirname(email.__file__), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "onebitlamb", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    paused = None
    try:
        for line in proc.stderr:  # until training runs
            if "step 4: held-out loss" in line:
                break
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        workers = [pid for pid in children if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
        assert len(workers) == 2, children
        paused = int(workers[-1])
        os.kill(paused, signal.SIGSTOP)
        started = time.monotonic()
        _, err = proc.communicate(timeout=120)
        waited = time.monotonic() - started
    finally:
        if paused is not None:
            try:
                os.kill(paused, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    assert proc.returncode == 1
    assert re.search(r"error: rank \d waited 5 s for the other ranks in (step|the) ", err), err[-3000:]
    assert "another rank has died, hung or been paused" in err and "Traceback" not in err, err[-3000:]
    assert waited < 60, waited
