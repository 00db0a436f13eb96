"""The scripts under examples/ run as their docstrings say (torchrun, 2 CPU ranks) and reach
their own checks. The framework ones are slow; their integrations' tests cover the same."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from onebitlamb.comm.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script, *args, cwd, ranks=2):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                           "--master_port", str(free_port()), os.path.join(ROOT, "examples", script), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _ran(*procs) -> None:
    """Each run ended well and never warned that the example's own settings were wrong."""
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "EarlyFreezeWarning" not in proc.stderr, proc.stderr[-3000:]


def test_ddp_example_registers_and_compresses(tmp_path):
    proc = _torchrun("ddp.py", cwd=tmp_path)
    _ran(proc)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("step")]
    assert "warmup" in lines[0] and lines[-1].split()[2] == "compression"
    assert int(lines[-1].split()[-1]) * 16 < int(lines[0].split()[-1])  # the compressed steps send far less


def test_hsdp_example_compresses_across_replicas_and_keeps_half_the_state(tmp_path):
    proc = _torchrun("fsdp2_hsdp.py", cwd=tmp_path, ranks=4)
    _ran(proc)
    lines = [l.split() for l in proc.stdout.splitlines() if l.startswith("step")]
    assert lines[0][2] == "warmup" and lines[-1][2] == "compression"
    across = [int(l[l.index("replicas") + 1]) for l in lines]
    assert across[-1] * 16 < across[0]  # after the freeze, the slow link carries 1 bit an element
    words = proc.stdout.split("parameters ")[1].split()
    parameters, state = int(words[0].rstrip(",")), int(words[6])
    # moments and errors of this rank's half of the 2,372 parameters (and a few per-layer values)
    assert parameters == 2372 and state < 3 * parameters


def test_dcp_example_resumes_bit_for_bit(tmp_path):
    proc = _torchrun("dcp_checkpoint.py", cwd=tmp_path)
    _ran(proc)
    assert proc.stdout.count("resumed run equals the uninterrupted one: True") == 2


@pytest.mark.slow
def test_accelerate_example_resumes_to_the_same_checksum(tmp_path):
    first = _torchrun("accelerate_example.py", cwd=tmp_path)
    second = _torchrun("accelerate_example.py", "--resume", cwd=tmp_path)
    _ran(first, second)
    checksums = [l for p in (first, second) for l in p.stdout.splitlines() if "checksum" in l]
    assert len(checksums) == 2 and checksums[0] == checksums[1]


@pytest.mark.slow
def test_hf_trainer_example_runs(tmp_path):
    proc = _torchrun("hf_trainer.py", cwd=tmp_path)
    _ran(proc)


@pytest.mark.slow
def test_lightning_example_runs(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "lightning_example.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    _ran(proc)
