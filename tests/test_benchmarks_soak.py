"""The soak benchmark's pieces without its long run: the verdicts on hand-made series, and
``--quick`` end to end into a scratch results file."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import soak

REPO = Path(__file__).resolve().parents[1]


def _records(worker, server, rss, loss):
    """One rank's records at steps 0..8 (a stage of 8 steps, a record every step)."""
    return [dict(step=k, worker=w, server=s, worker_rel=w / 2, server_rel=s * 3, rss_mb=m, loss=l)
            for k, (w, s, m, l) in enumerate(zip(worker, server, rss, loss))]


# step:          0    1    2    3    4    5    6    7    8
RANK0 = _records([0.0, 4.0, 3.0, 2.0, 2.0, 2.0, 2.0, 2.5, 3.0],
                 [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                 [100, 110, 110, 111, 111, 111, 111, 111, 112],
                 [0.5, 0.4, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.2])
RANK1 = _records([0.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                 [0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 4.0, 5.0],
                 [101, 109, 109, 109, 109, 109, 109, 109, 109],
                 [0.7, 0.6, 0.5, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4])


def test_quarters_split_the_stage_after_the_freeze():
    # 8 steps: quarter 1 is steps 1-2, quarter 2 steps 3-4, quarter 4 steps 7-8; step 0 is in none
    assert [r["step"] for r in soak.quarter(RANK0, 8, 1)] == [1, 2]
    assert [r["step"] for r in soak.quarter(RANK0, 8, 2)] == [3, 4]
    assert [r["step"] for r in soak.quarter(RANK0, 8, 4)] == [7, 8]


def test_summary_by_hand():
    s = soak.summarize([RANK0, RANK1], steps=8)
    w = s["errors"]["worker"]
    # first quarter: rank 0 {4, 3}, rank 1 {2, 2}; last: rank 0 {2.5, 3}, rank 1 {1, 1}
    assert (w["first_min"], w["first_max"], w["last_min"], w["last_max"]) == (2.0, 4.0, 1.0, 3.0)
    assert w["ratio"] == pytest.approx(0.75) and w["bounded"]
    # drift: last quarter mean (2.5+3+1+1)/4 = 1.875 over second quarter's (2+2+1+1)/4 = 1.5
    assert w["drift"] == pytest.approx(1.25)
    # relative worker norm is half the absolute: the same ratios
    assert s["errors"]["worker_rel"]["last_max"] == pytest.approx(1.5)
    assert s["errors"]["worker_rel"]["ratio"] == pytest.approx(0.75)
    # server error: rank 1 grows to 5 against a first-quarter max of 1: 5x, not bounded
    e = s["errors"]["server"]
    assert (e["first_max"], e["last_min"], e["last_max"]) == (1.0, 1.0, 5.0)
    assert e["ratio"] == pytest.approx(5.0) and not e["bounded"]
    assert e["drift"] == pytest.approx((1 + 1 + 4 + 5) / 4 / 1.0)
    assert s["errors"]["server_rel"]["ratio"] == pytest.approx(5.0)
    # memory: at the freeze 100/101, baseline (step 1) 110/109, end 112/109; growth to the median
    # of the last quarter: rank 0 (111+112)/2 - 110 = 1.5, rank 1 109 - 109 = 0
    m = s["rss"]
    assert m["freeze"] == (100, 101) and m["baseline"] == (109, 110) and m["end"] == (109, 112)
    assert m["baseline_step"] == 1 and m["growth"] == 1.5 and m["flat"]
    # loss: mean over the ranks at the freeze (0.5+0.7)/2 and at the end (0.2+0.4)/2
    assert s["loss"]["freeze"] == pytest.approx(0.6) and s["loss"]["end"] == pytest.approx(0.3)


def test_memory_growth_past_the_limit_is_not_flat():
    limit = soak.RSS_GROWTH_LIMIT_MB
    leaking = [dict(r, rss_mb=r["rss_mb"] + 2 * limit * r["step"] / 8) for r in RANK1]  # 2 x limit over the stage
    m = soak.summarize([RANK0, leaking], steps=8)["rss"]
    # baseline at step 1: 109 + 2 limit/8; last quarter median: 109 + 2 limit (7/8 + 8/8)/2
    assert m["growth"] == pytest.approx(2 * limit * (15 / 16 - 1 / 8))
    assert not m["flat"]


def test_too_few_records_for_quarters_is_an_error():
    with pytest.raises(ValueError, match="too few records"):
        soak.summarize([RANK0[:3]], steps=8)


def test_section_and_plot_from_hand_made_results(tmp_path):
    ranks = [dict(records=RANK0, warmup_s=0.5, compression_s=2.0, numel=1234, skipped=0),
             dict(records=RANK1, warmup_s=1.0, compression_s=4.0, numel=1234, skipped=0)]
    results = {"onebitlamb": dict(ranks=ranks, summary=soak.summarize([RANK0, RANK1], steps=8))}
    body = soak.render(results, "python -m benchmarks.soak --x", freeze=5, steps=8, every=1, elapsed_s=90,
                       plot_path="docs/soak.png")
    assert body.startswith("## Soak: 2,000 compression-stage steps on 4 ranks (here 8)\n")
    assert "Command: `python -m benchmarks.soak --x`" in body
    assert "1,234 parameters" in body and "1.5 min" in body and "Plot: docs/soak.png." in body
    assert "| 1-bit LAMB | worker error | 2 – 4 | 1 – 3 | 0.75 | 1.25 | yes |" in body
    assert "| 1-bit LAMB | server error | 1 – 1 | 1 – 5 | 5.00 | 2.75 | NO |" in body
    assert "| 1-bit LAMB | worker error / momentum | 1 – 2 | 0.5 – 1.5 | 0.75 | 1.25 | yes |" in body
    # steps per second, the slowest rank's: 5 warm-up steps in 1.0 s, 8 compression steps in 4.0 s
    assert ("| 1-bit LAMB | 100.0 – 101.0 | 109.0 – 110.0 (1) | 109.0 – 112.0 | +1.50 | yes | 0.6000 | 0.3000 "
            "| 5.0 | 2.0 |") in body
    assert "Verdict: 1-bit LAMB: errors NOT bounded, memory flat, 0 steps skipped." in body
    png = tmp_path / "soak.png"
    soak.plot(results, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # about 20 s on 2 cores, mostly starting the 4 ranks; the test above covers the report
def test_quick_run_writes_its_section_and_plot(tmp_path):
    results, png = tmp_path / "BENCHMARKS.md", tmp_path / "soak.png"
    results.write_text("# Benchmarks\n\n<!-- begin other -->\nkept\n<!-- end other -->\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    args = ["--quick", "--optimizers", "onebitlamb", "--results", str(results), "--plot", str(png)]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    text = results.read_text()
    assert "<!-- begin other -->\nkept\n<!-- end other -->" in text
    section = text.split("<!-- begin soak -->", 1)[1].split("<!-- end soak -->", 1)[0]
    assert f"Command: `python -m benchmarks.soak {' '.join(args)}`" in section
    assert "## Soak: 2,000 compression-stage steps on 4 ranks (here 40)" in section
    assert "| 1-bit LAMB | worker error |" in section and "| 1-bit LAMB | server error |" in section
    assert "1-bit Adam" not in section
    assert "0 steps skipped" in section
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
