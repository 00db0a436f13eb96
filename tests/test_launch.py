"""The local launcher's promises: nothing outlives a run (workers leave with their launcher), and a
finished run is not lost to a crash on a worker's way out."""
import atexit
import os
import signal
import subprocess
import sys
import time

import pytest

from onebitlamb.comm.launch import spawn_local

HERE = os.path.dirname(os.path.abspath(__file__))


def _report_and_sleep(rank, world_size, folder):
    with open(os.path.join(folder, f"rank{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, f"rank{rank}.tmp"), os.path.join(folder, f"rank{rank}"))
    time.sleep(300)


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_for(condition, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_leave_when_the_launcher_is_killed(tmp_path):
    """SIGTERM skips the launcher's cleanup (its ``finally`` and multiprocessing's exit handler):
    the workers must notice on their own and stop, not train on as orphans."""
    launcher = subprocess.Popen([sys.executable, "-c", (
        f"import sys; sys.path.insert(0, {HERE!r})\n"
        "import test_launch\n"
        "from onebitlamb.comm.launch import spawn_local\n"
        f"spawn_local(test_launch._report_and_sleep, 2, args=({str(tmp_path)!r},), timeout_s=300)\n")])
    pids = []
    try:
        assert _wait_for(lambda: all((tmp_path / f"rank{r}").exists() for r in range(2)), 120), "no workers"
        pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
        assert all(_running(pid) for pid in pids)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)
        assert _wait_for(lambda: not any(_running(pid) for pid in pids), 15), "workers outlived their launcher"
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _crash_on_the_way_out(rank, world_size, folder):
    """Rank 1 reports at once and then dies in the interpreter's teardown, as gloo workers have
    (exit -6 after a finished run); rank 0 is still writing its files when that happens."""
    if rank == 1:
        atexit.register(os._exit, 134)
        return "one"
    time.sleep(3)
    with open(os.path.join(folder, "written"), "w") as f:
        f.write("after rank 1 left")
    return "zero"


def test_a_crash_after_the_report_loses_nothing(tmp_path):
    assert spawn_local(_crash_on_the_way_out, 2, args=(str(tmp_path),), timeout_s=120) == ["zero", "one"]
    assert (tmp_path / "written").read_text() == "after rank 1 left"


def _wait_policy(rank, world_size):
    return os.environ.get("OMP_WAIT_POLICY")


def test_oversubscribed_workers_wait_passively(monkeypatch):
    """More worker threads than cores: OpenMP's spinning waiters would take the cores from the
    working threads (12x slower measured), so the workers wait passively; the launcher's own
    environment is left as it was, and a policy the user set wins."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cores = os.cpu_count() or 1
    assert spawn_local(_wait_policy, 2, threads_per_worker=cores, timeout_s=120) == ["PASSIVE", "PASSIVE"]
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert spawn_local(_wait_policy, 2, threads_per_worker=cores, timeout_s=120) == ["ACTIVE", "ACTIVE"]


def test_workers_that_fit_the_cores_keep_the_default_wait(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert spawn_local(_wait_policy, 1, threads_per_worker=1, timeout_s=120) == [None]
