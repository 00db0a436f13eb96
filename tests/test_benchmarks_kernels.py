"""Smoke test of the kernel benchmark: ``--quick`` runs end to end and writes its section."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_mode_writes_its_section(tmp_path):
    results = tmp_path / "BENCHMARKS.md"
    results.write_text("# Benchmarks\n\n<!-- begin other -->\nkept\n<!-- end other -->\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--quick",
                           "--results", str(results)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = results.read_text()
    assert "<!-- begin other -->\nkept\n<!-- end other -->" in text  # other sections untouched
    section = text.split("<!-- begin kernels -->", 1)[1].split("<!-- end kernels -->", 1)[0]
    assert f"Command: `python -m benchmarks.kernels --quick --results {results}`" in section
    assert "Machine: " in section and "torch " in section
    assert "| 64K |" in section and "| 256K |" in section
    # 64K fp32 elements on 4 ranks: 2*(3/4)*256 KiB for fp32, 2*(3/4)*8 KiB + 2*3*4 for 1-bit
    assert "| 393,216 |" in section and "| 12,312 |" in section and "| 31.94 |" in section
    assert section.strip() in proc.stdout
