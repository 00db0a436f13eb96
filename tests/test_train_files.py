"""The main job's files, signals and stops: a user's file is never
overwritten, no file is written through a link, OUT is locked for the run's life; SIGTERM to the
local launcher checkpoints, workers stop when their torchrun agent is killed; what used to be a
raw traceback is one line naming the cause and the fix; skipped steps are recorded and counted."""
import email
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from onebitlamb import cli
from onebitlamb.train import checkpoints, data, files, loop, pretrain
from test_launch import _running, _wait_for
from pretrain_pool import pretrain_on_ranks
from test_train_safety import ROOT, _config, _write

CORPUS = os.path.dirname(email.__file__)
LONG = ["--steps", "100000", "--eval-every", "100000"]  # a run that goes on until stopped


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return ["--preset", "tiny", "--corpus", CORPUS, "--cache-dir", str(cache), "--no-progress"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, common):
    """A tiny run stopped after step 2 (its checkpoint: ckpt-0000002), on the persistent ranks
    (tests/pretrain_pool.py)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert pretrain_on_ranks(*common, "--out", str(out), "--stop-after-steps", "2").summary["step"] == 2
    return out


def _start(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(list(args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    timer = threading.Timer(240, proc.kill)  # never hang the suite
    timer.daemon = True
    timer.start()
    return proc


def _until(proc, text):
    """Read ``proc``'s stderr until a line holds ``text``; returns what was read."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"{text!r} never came: {''.join(seen)[-3000:]}")


def _children(pid, marker):
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in found if marker in open(f"/proc/{c}/cmdline").read()]


# ---- point 1: files and folders


def test_a_users_config_json_is_never_overwritten(tmp_path, common, capsys):
    mine = '{"my": "own settings"}'
    _write(str(tmp_path / "run" / "config.json"), mine)
    _write(str(tmp_path / "cmp" / "lamb" / "config.json"), mine)
    for command, out in (("pretrain", "run"), ("compare", "cmp")):
        for extra in ([], ["--overwrite"]):  # --overwrite removes a run's own files only
            code = cli.main([command, *common, "--out", str(tmp_path / out), *extra])
            err = capsys.readouterr().err
            assert code == 2 and "config.json is not a configuration a run wrote" in err, err[-2000:]
            assert "choose another --out" in err and "Traceback" not in err
    assert (tmp_path / "run" / "config.json").read_text() == mine
    assert (tmp_path / "cmp" / "lamb" / "config.json").read_text() == mine


def test_the_runs_files_are_created_anew_never_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("checkpoint.json", "metrics.json", "config.json"):  # written under a temporary name, then renamed
        tmp = files.temporary_name(str(out / name))
        os.symlink(victim, tmp)
        with pytest.raises(files.OutError, match=f"{os.path.basename(tmp)} is a link"):
            files.write_json(str(out / name), {"a": 1})
    os.symlink(tmp_path / "created-outside.pt", files.temporary_name(str(out / "model.pt")))  # a dangling link
    with pytest.raises(files.OutError, match="is a link"):
        data.atomic_save({"x": 1}, str(out / "model.pt"))
    os.symlink(victim, out / "curves.png")
    with pytest.raises(files.OutError, match="curves.png is a link"):
        files.save_figure(None, str(out / "curves.png"))
    assert victim.read_text() == "mine" and not (tmp_path / "created-outside.pt").exists()
    # the run's own stale temporary file is replaced; a link at the final name is replaced, not followed
    with open(files.temporary_name(str(out / "log.json")), "w") as f:
        f.write("half of it")
    os.symlink(victim, out / "log.json")
    files.write_json(str(out / "log.json"), {"a": 1})
    assert not os.path.islink(out / "log.json") and json.loads((out / "log.json").read_text()) == {"a": 1}
    assert victim.read_text() == "mine"
    # a folder of the run: a link or a file there is refused, a real folder reused
    os.symlink(tmp_path, out / "ckpt-0000004")
    with pytest.raises(files.OutError, match="ckpt-0000004 is a link"):
        files.make_folder(str(out / "ckpt-0000004"))
    (out / "ckpt-0000006").mkdir()
    files.make_folder(str(out / "ckpt-0000006"))


def test_a_link_at_the_next_checkpoint_is_refused_and_the_run_stays_resumable(stopped, tmp_path, common, capfd):
    """A link where the run writes one of its files, or makes a later checkpoint folder: refused at
    the start (exit 2), by name, nothing followed or changed; the resume goes on once it is removed.
    Before, a link at ckpt-0000004 was found only at that step's checkpoint (exit 1). The command in
    this process (its workers write to the captured stderr); the last resume, which only shows
    that the run goes on, on the persistent ranks (tests/pretrain_pool.py)."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out, symlinks=True)
    victim = tmp_path / "victim.csv"
    victim.write_text("mine")
    os.remove(out / "log.csv")
    os.symlink(victim, out / "log.csv")
    code = cli.main(["pretrain", *common, "--out", str(out), "--resume"])
    err = capfd.readouterr().err
    assert code == 2 and "log.csv is a link" in err and "Traceback" not in err, err[-3000:]
    os.remove(out / "log.csv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "ckpt-0000004")
    before = sorted(os.listdir(out))
    code = cli.main(["pretrain", *common, "--out", str(out), "--resume"])
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    assert "ckpt-0000004 is a link, where the run makes its checkpoint of step 4" in err
    assert "held-out loss" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    assert os.listdir(elsewhere) == [] and victim.read_text() == "mine" and sorted(os.listdir(out)) == before
    assert checkpoints.read_pointer(str(out))["step"] == 2 and (out / "ckpt-0000002" / "model.pt").exists()
    os.remove(out / "ckpt-0000004")
    assert pretrain_on_ranks(*common, "--out", str(out), "--resume").summary["completed"]
    assert (out / "metrics.json").exists()
    assert not (out / files.LOCK_FILE).exists()  # released and removed at the end


@pytest.fixture(scope="module")
def running(tmp_path_factory, common):
    """A long run of the command, past its first evaluation, shared by the two tests that need one
    in progress (a launch is most of each one's time): the first asks for its OUT while it runs,
    the second stops it with SIGTERM."""
    out = tmp_path_factory.mktemp("running") / "run"
    first = _start(sys.executable, "-m", "onebitlamb", "pretrain", *common, *LONG, "--ckpt-every", "100000",
                   "--out", str(out))
    try:
        _until(first, "step 0: held-out loss")
        yield first, out
    finally:
        first.kill()


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(running, common, capsys):
    """The lock is removed at the run's end: test_sigterm_to_the_local_launcher_checkpoints_the_current_step,
    which stops this run."""
    first, out = running
    assert first.poll() is None, "the shared run ended before this test"
    for extra in (["--resume"], ["--overwrite"]):  # here, in this process: a lock is per open file
        code = cli.main(["pretrain", *common, "--out", str(out), *extra])
        err = capsys.readouterr().err
        assert code == 2 and f"is in use by another run (pid {first.pid}" in err, err[-3000:]
        assert "Traceback" not in err and os.path.exists(os.path.join(out, files.LOCK_FILE))


# ---- point 6: the launcher's signals


def test_sigterm_to_the_local_launcher_checkpoints_the_current_step(running):
    first, out = running
    assert first.poll() is None, "the shared run ended before this test"
    time.sleep(1)  # a few steps
    first.send_signal(signal.SIGTERM)
    rest = first.stderr.read()
    assert first.wait(timeout=120) == 130, rest[-3000:]
    assert "SIGTERM: checkpointing at the end of this step" in rest and "stopped (interrupt)" in rest
    step = checkpoints.read_pointer(str(out))["step"]
    assert step >= 1 and f"after step {step}; continue with --resume" in rest
    assert not os.path.exists(os.path.join(out, files.LOCK_FILE))  # the run's end frees its OUT


def test_a_second_sigterm_kills_the_workers_with_one_line(tmp_path, common):
    """SIGTERM twice, the second while the first is being handled: the workers are killed, one
    line says so and what stays, exit 130 (before: a raw KeyboardInterrupt traceback)."""
    first = _start(sys.executable, "-m", "onebitlamb", "pretrain", *common, *LONG, "--ckpt-every", "100000",
                   "--out", str(tmp_path))
    try:
        _until(first, "step 0: held-out loss")
        first.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        rest = first.stderr.read()
        assert first.wait(timeout=60) == 130, rest[-3000:]
    finally:
        first.kill()
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest[-3000:]
    assert rest.strip().splitlines()[-1].startswith("onebitlamb pretrain: error: SIGTERM again: the workers were "
                                                    "killed"), rest[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_stop_when_their_torchrun_agent_is_killed(tmp_path, common):
    from onebitlamb.comm.launch import free_port

    agent = _start(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), "-m", "onebitlamb", "pretrain", *common, *LONG, "--ckpt-every", "2",
                   "--out", str(tmp_path))
    workers = []
    try:
        _until(agent, "step 0: held-out loss")
        assert _wait_for(lambda: (tmp_path / "checkpoint.json").exists(), 60), "no checkpoint"
        workers = _children(agent.pid, "onebitlamb")
        assert len(workers) == 2, workers
        agent.kill()  # SIGKILL: the agent forwards nothing
        agent.wait(timeout=30)
        assert _wait_for(lambda: not any(_running(pid) for pid in workers), 15), "workers outlived their agent"
        rest = agent.stderr.read()
        assert "its torchrun agent" in rest and "is gone, so it stops" in rest, rest[-3000:]
        step = checkpoints.read_pointer(str(tmp_path))["step"]
        time.sleep(1.5)
        assert checkpoints.read_pointer(str(tmp_path))["step"] == step  # nobody trains on
    finally:
        agent.kill()
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


# ---- point 7: one line naming the cause and the fix


def test_an_out_that_cannot_be_used_is_one_line(tmp_path, common, capsys):
    cases = [(["--out", str(tmp_path / "missing"), "--resume"], "does not exist, so there is nothing to continue"),
             (["--out", str(tmp_path / "a-file")], "is a file, not a folder")]
    (tmp_path / "a-file").write_text("mine")
    if os.geteuid() != 0:  # root writes into a read-only folder
        (tmp_path / "ro").mkdir(mode=0o555)
        cases.append((["--out", str(tmp_path / "ro")], "cannot be written by this user"))
    for args, said in cases:
        code = cli.main(["pretrain", *common, *args])
        err = capsys.readouterr().err
        assert code == 2 and said in err and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "missing").exists() and (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_worker_is_named_with_its_signal(tmp_path, common):
    launcher = _start(sys.executable, "-m", "onebitlamb", "pretrain", *common, *LONG, "--out", str(tmp_path))
    try:
        _until(launcher, "step 0: held-out loss")
        workers = _children(launcher.pid, "spawn_main")
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        rest = launcher.stderr.read()
        assert launcher.wait(timeout=60) == 1
    finally:
        launcher.kill()
    assert f"(pid {workers[-1]}) was killed by signal SIGKILL" in rest, rest[-3000:]
    assert "continue with --resume" in rest and "Traceback" not in rest


def test_a_damaged_corpus_cache_is_refused_by_name(tmp_path, common, capsys):
    shared = common[common.index("--cache-dir") + 1]
    loop.prepare_corpus(_config(tmp_path, corpus=[CORPUS], cache_dir=shared), log=lambda *a: None)  # built once
    cache = tmp_path / "cache"
    shutil.copytree(shared, cache)
    blocks = next(cache.glob("corpus-*/blocks.pt"))
    saved = torch.load(blocks, weights_only=True)
    flags = [*common[:common.index("--cache-dir")], "--cache-dir", str(cache), "--no-progress"]
    for damage, said in ((lambda s: s["train"].__setitem__((0, 3), 100000), "train split holds token ids"),
                         (lambda s: s["train"].__setitem__((1, 1), -2), "train split holds token ids from -2"),
                         (lambda s: s.__setitem__("heldout", s["heldout"][:0]), "heldout split is empty")):
        damaged = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
        damage(damaged)
        torch.save(damaged, blocks)
        code = cli.main(["pretrain", *flags, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and "is damaged" in err and said in err and "delete" in err, err[-3000:]
        assert "Traceback" not in err and "held-out loss" not in err


# ---- points 4 and 7: skipped steps in the main job (one rank in this process)


def _run_with_huge_gradients(tmp_path, common, monkeypatch, steps, bad, clip=0.0):
    """A tiny LAMB run whose gradient holds 3e38 at the steps ``bad`` (1-based): finite, and its
    loss too, but not its square: the optimizer skips the step (with clipping too, which leaves
    such a gradient as it is)."""
    import torch.distributed as dist

    tmp_path.mkdir(parents=True, exist_ok=True)  # the file store's folder must exist
    corpus, cache = common[common.index("--corpus") + 1], common[common.index("--cache-dir") + 1]
    cfg = _config(tmp_path / "out", optimizer="lamb", workers=1, steps=steps, clip=clip, ckpt_every=1000,
                  eval_every=steps, corpus=[corpus], cache_dir=cache, progress=False)
    real, calls = loop.forward_backward, []

    def huge(model, *args):
        loss = real(model, *args)
        calls.append(1)
        if len(calls) in bad:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = 3e38
        return loss

    monkeypatch.setattr(loop, "forward_backward", huge)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs (--threads); many threads on a busy machine crawl
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        checkpoints.prepare_out_dir(cfg)
        with pytest.warns(RuntimeWarning, match="step skipped"):
            result = loop.train_rank(0, 1, cfg)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)
    return cfg, result


def test_skipped_steps_are_recorded_and_too_many_fail_the_run(tmp_path, common, monkeypatch, capfd):
    cfg, result = _run_with_huge_gradients(tmp_path / "one", common, monkeypatch, 12, {5}, clip=1.0)
    err = capfd.readouterr().err
    assert pretrain.exit_code(result) == 0 and "1 of 12 steps skipped" in err, err[-3000:]
    with open(os.path.join(cfg.out, "metrics.json")) as f:
        assert json.load(f)["skipped_steps"] == [5]
    last = torch.load(os.path.join(cfg.out, "ckpt-0000012", "model.pt"), weights_only=True)
    assert all(torch.isfinite(t).all() for t in last.values())
    monkeypatch.undo()
    cfg, result = _run_with_huge_gradients(tmp_path / "nine", common, monkeypatch, 12, set(range(2, 11)))
    err = capfd.readouterr().err
    assert pretrain.exit_code(result) == 1 and "9 of 12 steps were skipped" in result["error"]
    assert "steps 2-10" in result["error"] and result["error"] in err
    with open(os.path.join(cfg.out, "metrics.json")) as f:
        assert json.load(f)["skipped_steps"] == list(range(2, 11))


def test_ten_skipped_steps_in_a_row_end_the_run_with_one_line(tmp_path, common, monkeypatch, capfd):
    cfg, result = _run_with_huge_gradients(tmp_path, common, monkeypatch, 12, set(range(2, 12)))
    assert pretrain.exit_code(result) == 1 and "steps in a row" in result["error"]
    assert "step 11:" in result["error"] and "no checkpoint was written" in result["error"]
    assert result["error"] in capfd.readouterr().err and not os.path.exists(os.path.join(cfg.out, "metrics.json"))
