"""The main job resumes a checkpoint on another number of workers (4 -> 2, 2 -> 3): the compression
errors are re-sharded, and the run ends as close to where uninterrupted runs end as they are to
each other. Issue 39."""
import email
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pretrain(out, cache, workers, *extra):
    # tiny at 16 steps, frozen at step 6 (35%); a global batch of 24 splits over 2, 3 and 4 workers
    # only with micro-batches of 2
    args = ["pretrain", "--preset", "tiny", "--steps", "16", "--eval-every", "8", "--freeze", "0.35",
            "--global-batch", "24", "--micro-batch", "2", "--workers", str(workers), "--out", str(out),
            "--cache-dir", str(cache), "--corpus", os.path.dirname(email.__file__), "--no-progress", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "onebitlamb", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _final_loss(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)["final_eval_loss"]


@pytest.mark.parametrize("before,after", [(4, 2), (2, 3)])
def test_a_run_resumes_on_another_number_of_workers(tmp_path, before, after):
    cache = tmp_path / "cache"
    resumed = tmp_path / "resumed"
    _pretrain(resumed, cache, before, "--stop-after-steps", "10")  # 4 steps after the freeze
    proc = _pretrain(resumed, cache, after, "--resume")
    assert f"resuming a checkpoint of {before} ranks on {after}" in proc.stderr
    with open(resumed / "metrics.json") as f:
        metrics = json.load(f)
    assert metrics["world_size"] == after and metrics["freeze_step"] == 6
    straight = []
    for workers in (before, after):
        _pretrain(tmp_path / f"straight{workers}", cache, workers)
        straight.append(_final_loss(tmp_path / f"straight{workers}"))
    low, high = min(straight), max(straight)
    margin = max(high - low, 0.002 * high)  # the spread between the two, at least 0.2%
    assert low - margin <= metrics["final_eval_loss"] <= high + margin, (metrics["final_eval_loss"], straight)
