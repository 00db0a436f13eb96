"""The main job's safety: an earlier run is never removed without --overwrite, and then
only its own files; checkpoints are loaded as plain data from a folder inside --out, checked against
their manifest; a non-finite loss stops the run with an error and leaves the last good checkpoint."""
import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import types

import pytest
import torch

from onebitlamb import cli
from onebitlamb.train import checkpoints, config, files, loop, pretrain, ranks
from pretrain_pool import pretrain_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(out, **kw):
    return config.TrainConfig(**{**config.PRESETS["tiny"], "out": str(out), **kw})


def _write(path, text="x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _as_a_run_writes(out, name):
    """``OUT/name`` with content of the kind a run writes there (what --overwrite recognises as the run's)."""
    path = os.path.join(out, name)
    saved = dataclasses.asdict(_config(out))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if name.endswith(".pt"):
        torch.save({"w": torch.zeros(2)}, path)
        return
    if name.endswith(".png"):
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n tEXtSoftware Matplotlib")
        return
    if checkpoints.EVENTS_FILE.fullmatch(os.path.basename(name)):
        with open(path, "wb") as f:
            f.write(b"\x18\x00\x00\x00\x00\x00\x00\x00\xa3\x7fK\"\t\x00\x00\x00\x00\x00\x00\x00\x00\x1a\rbrain.Event:2")
        return
    _write(path, {"config.json": json.dumps(saved),
                  "checkpoint.json": json.dumps({"folder": "ckpt-0000002", "step": 2, "sha256": {}}),
                  "metrics.json": json.dumps({"config": saved, "final_eval_loss": 5.0}),
                  "log.csv": "step,loss,heldout_loss,bytes,collectives,lr,stage\r\n0,5.0,,0,0,0.0,warmup\r\n"
                  }.get(name, "x"))


def _saved_checkpoint(out, name, ranks=2):
    """A checkpoint folder as a run saves it: its files, and its manifest.json listing their sha256."""
    folder = os.path.join(out, name)
    saved = ["model.pt", "trainer.pt", *(f"rank{r}.pt" for r in range(ranks))]
    for f in saved:
        _as_a_run_writes(folder, f)
    manifest = {"folder": name, "step": int(name[5:]), "world_size": ranks,
                "sha256": {f: checkpoints._sha256(os.path.join(folder, f)) for f in saved}}
    _write(os.path.join(folder, "manifest.json"), json.dumps(manifest))
    return manifest


def _earlier_run(out):
    """An OUT as a run leaves it, plus a user's own files among them."""
    for name in ("config.json", "checkpoint.json", "metrics.json", "model_final.pt", "freeze.png", "curves.png",
                 "log.csv", "tensorboard/events.out.tfevents.1700000000.host.42.0"):
        _as_a_run_writes(out, name)
    _saved_checkpoint(out, "ckpt-0000002")
    for name in ("ckpt-0000004/rank0.pt" + files.TEMPORARY_MARK,  # an interrupted write
                 "metrics.json.tmp",  # a user's: not a name the run writes under
                 "ckpt-0000012/model.pt", "ckpt-0000012/notes.txt",  # a user's files where the run never writes
                 "ckpt-notes/todo.txt", "notes.txt", "cache/corpus-x/blocks.pt", "plots/loss.png"):
        _write(os.path.join(out, name))


def _tree(out):
    return sorted(os.path.relpath(os.path.join(d, f), out) for d, _, files in os.walk(out) for f in files)


def test_an_earlier_run_is_refused_before_anything_starts(tmp_path, capsys):
    _earlier_run(tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="--resume.*--overwrite"):
        checkpoints.prepare_out_dir(_config(tmp_path))
    code = cli.main(["pretrain", "--preset", "tiny", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "holds an earlier run" in err and "--resume" in err and "--overwrite" in err
    assert "Traceback" not in err and "preparing corpus" not in err  # refused before the data, before any worker
    assert _tree(tmp_path) == before
    for i, sign in enumerate(["metrics.json", "ckpt-0000003/model.pt", "checkpoint.json"]):
        _as_a_run_writes(str(tmp_path / f"only{i}"), sign)
        with pytest.raises(ValueError, match="earlier run"):
            checkpoints.prepare_out_dir(_config(tmp_path / f"only{i}"))
        assert _tree(tmp_path / f"only{i}") == [sign]
    # a folder with nothing of a run in it is used as it is
    _write(str(tmp_path / "fresh" / "ckpt-notes" / "todo.txt"))
    checkpoints.prepare_out_dir(_config(tmp_path / "fresh"))
    assert _tree(tmp_path / "fresh") == ["ckpt-notes/todo.txt"]


def test_overwrite_removes_the_runs_own_files_and_nothing_else(tmp_path, capsys):
    _earlier_run(tmp_path)
    checkpoints.prepare_out_dir(_config(tmp_path, overwrite=True))
    assert _tree(tmp_path) == ["cache/corpus-x/blocks.pt", "ckpt-0000012/model.pt", "ckpt-0000012/notes.txt",
                               "ckpt-notes/todo.txt", "metrics.json.tmp", "notes.txt", "plots/loss.png"]
    err = capsys.readouterr().err
    assert "left in place" in err and "ckpt-notes/" in err and "ckpt-0000012/ (holds model.pt, notes.txt)" in err
    assert "cache" not in err.split("left in place")[1]  # the corpus cache is no business of the run's


@pytest.mark.parametrize("name", ["metrics.json", "log.csv", "checkpoint.json", "freeze.png", "model_final.pt"])
def test_a_users_file_at_a_runs_name_is_refused_never_removed(tmp_path, capsys, name):
    """A file of the user's at one of the names a run writes (its content is not what a run writes
    there): refused at the start by name, --overwrite too, and left as it was. Before, --overwrite
    removed it as the earlier run's."""
    _earlier_run(tmp_path)
    _write(str(tmp_path / name), "my own notes\n")
    before = _tree(tmp_path)
    code = cli.main(["pretrain", "--preset", "tiny", "--out", str(tmp_path), "--overwrite", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"{tmp_path / name} is not a file a run wrote" in err and "Traceback" not in err, err
    assert _tree(tmp_path) == before and (tmp_path / name).read_text() == "my own notes\n"


def test_compare_overwrite_keeps_a_users_table(tmp_path, capsys):
    """``compare --overwrite`` over a folder holding the user's own table.md: refused by name, the
    file kept; a comparison's own table.md is removed."""
    _write(str(tmp_path / "table.md"), "| my | table |\n")
    code = cli.main(["compare", "--preset", "tiny", "--out", str(tmp_path), "--overwrite", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "table.md is not a file a run wrote" in err, err
    assert (tmp_path / "table.md").read_text() == "| my | table |\n"
    from onebitlamb.train import compare
    _write(str(tmp_path / "table.md"), "| optimizer |\n\ntotal 12 s for the 2 runs including start-up\n")
    args = argparse.Namespace(out=str(tmp_path), resume=False, overwrite=True)
    compare.check_out_dir(args, {}, remove=True)
    assert not (tmp_path / "table.md").exists()


def test_a_link_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _write(str(elsewhere / "model.pt"))
    out = tmp_path / "out"
    _as_a_run_writes(str(out), "metrics.json")
    os.symlink(elsewhere, out / "ckpt-0000002")
    os.symlink(elsewhere / "model.pt", out / "model_final.pt")
    # a link where the run writes one of its files, or makes a checkpoint: refused, by name, --overwrite or not
    with pytest.raises(ValueError, match="model_final.pt is a link"):
        checkpoints.prepare_out_dir(_config(out, overwrite=True))
    assert os.path.islink(out / "model_final.pt") and (out / "metrics.json").exists()
    os.remove(out / "model_final.pt")
    with pytest.raises(ValueError, match="ckpt-0000002 is a link, where the run makes its checkpoint of step 2"):
        checkpoints.prepare_out_dir(_config(out, overwrite=True))
    assert (out / "metrics.json").exists()  # nothing removed by a refusal
    os.rename(out / "ckpt-0000002", out / "ckpt-0000020")  # where the run never writes: left as it is
    checkpoints.prepare_out_dir(_config(out, overwrite=True))
    assert (elsewhere / "model.pt").exists() and os.path.islink(out / "ckpt-0000020")
    assert not (out / "metrics.json").exists()


def test_compare_refuses_an_earlier_comparison_before_any_run(tmp_path, capsys):
    _write(str(tmp_path / "lamb" / "metrics.json"), "{}")
    code = cli.main(["compare", "--preset", "tiny", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "lamb/metrics.json" in err and "--overwrite" in err
    _write(str(tmp_path / "x" / "table.md"))
    assert cli.main(["compare", "--preset", "tiny", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "table.md" in capsys.readouterr().err and (tmp_path / "x" / "table.md").exists()


def test_compare_resume_reuses_a_finished_run_only_with_the_same_settings(tmp_path, capsys):
    saved = dataclasses.asdict(_config(tmp_path / "lamb", optimizer="lamb", lr=0.5))
    _write(str(tmp_path / "lamb" / "metrics.json"), json.dumps({"config": saved, "final_eval_loss": 5.0}))
    code = cli.main(["compare", "--preset", "tiny", "--optimizers", "lamb", "--out", str(tmp_path), "--resume",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "different settings" in err and "'lr': (0.5, 0.02)" in err


def test_a_vocabulary_smaller_than_the_corpus_alphabet_is_refused_at_the_start(tmp_path, common, capsys):
    """--vocab-size is a flag: a vocabulary smaller than the characters the tokenizer keeps would
    give token ids beyond the model's embedding and fail in every worker at its first step. (In this
    process, as the other refusals here: it comes before any worker starts.)"""
    code = cli.main(["pretrain", *common, "--vocab-size", "40", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "--vocab-size must be at least" in err and "got 40" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "checkpoint.json").exists()


# ---- the checkpoint: a real one, from a tiny run stopped after 3 steps


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    import email

    cache = tmp_path_factory.mktemp("cache")
    return ["--preset", "tiny", "--freeze", "0.35", "--corpus",
            os.path.dirname(email.__file__), "--cache-dir", str(cache), "--no-progress"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, common):
    """The checkpoint of the command's run, trained on the persistent ranks (tests/pretrain_pool.py):
    what is tested here is what the files hold and how a resume treats them."""
    out = tmp_path_factory.mktemp("stopped")
    stopped = pretrain_on_ranks(*common, "--optimizer", "onebitlamb", "--out", str(out), "--stop-after-steps", "3")
    assert stopped.summary["step"] == 3 and not stopped.summary["completed"], stopped
    return out


@pytest.fixture
def run_copy(stopped_run, tmp_path, common):
    """A copy of the stopped run, the pointer, its manifest, and the config to resume it."""
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    with open(out / "checkpoint.json") as f:
        pointer = json.load(f)
    cfg = config.config_from_flags([*common, "--optimizer", "onebitlamb", "--out", str(out), "--resume"])
    return out, pointer, cfg


def _set_pointer(out, pointer):
    with open(out / "checkpoint.json", "w") as f:
        json.dump(pointer, f)


def test_the_checkpoint_has_a_manifest_and_resumes(run_copy):
    out, pointer, cfg = run_copy
    folder = out / "ckpt-0000003"
    assert pointer["folder"] == "ckpt-0000003" and pointer["step"] == 3 and pointer["world_size"] == 2
    assert set(pointer["sha256"]) == {"model.pt", "trainer.pt", "rank0.pt", "rank1.pt"}
    assert set(os.listdir(folder)) == {*pointer["sha256"], "manifest.json"}
    assert json.loads((folder / "manifest.json").read_text()) == pointer  # the folder carries its own
    for name, digest in pointer["sha256"].items():
        assert checkpoints._sha256(str(folder / name)) == digest
        torch.load(folder / name, weights_only=True)  # plain data
    checkpoints.check_resumable(cfg)


@pytest.mark.parametrize("damage", ["flip a byte of model.pt", "truncate rank1.pt", "remove trainer.pt"])
def test_a_damaged_file_is_named_at_the_start(run_copy, damage, capsys):
    out, _, cfg = run_copy
    name = damage.split()[-1]
    path = out / "ckpt-0000003" / name
    blob = bytearray(path.read_bytes())
    if damage.startswith("flip"):
        blob[len(blob) // 2] ^= 0x01  # a low bit of a weight, which would still load
        path.write_bytes(bytes(blob))
    elif damage.startswith("truncate"):
        path.write_bytes(bytes(blob[:len(blob) // 3]))
    else:
        path.unlink()
    with pytest.raises(ValueError, match=name):
        checkpoints.check_resumable(cfg)
    code = cli.main(["pretrain", *_flags(cfg), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and name in err and "Traceback" not in err and "EOFError" not in err


@pytest.mark.parametrize("manifest", ["removed", "not a mapping"])
def test_a_checkpoint_without_its_manifest_is_refused(run_copy, capsys, manifest):
    """The sha256 manifest is required: without it (or damaged) a flipped byte in model.pt cannot
    be seen, so the checkpoint is refused at the start. Before, a pointer without ``sha256`` was
    trusted and the run resumed from the damaged model, exit 0."""
    out, pointer, cfg = run_copy
    model = out / "ckpt-0000003" / "model.pt"
    blob = bytearray(model.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    model.write_bytes(bytes(blob))
    if manifest == "removed":
        del pointer["sha256"]
    else:
        pointer["sha256"] = list(pointer["sha256"])
    _set_pointer(out, pointer)
    before = _tree(out)
    with pytest.raises(ValueError, match="sha256 manifest is missing"):
        checkpoints.check_resumable(cfg)
    code = cli.main(["pretrain", *_flags(cfg), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "checkpoint.json is damaged" in err and "Traceback" not in err, err
    assert _tree(out) == before


def test_a_resume_removes_what_the_pointer_no_longer_names_and_only_that(run_copy, capsys):
    """A run killed between the switch of checkpoint.json and the removal of the previous folder
    (or during a save that never completed) leaves a ckpt-* folder, and a write cut short leaves a
    file under the run's temporary name: the next resume removes those, and nothing of the user's.
    Before, they stayed for good."""
    out, pointer, cfg = run_copy
    shutil.copytree(out / "ckpt-0000003", out / "ckpt-0000001")  # the previous checkpoint, not removed
    os.makedirs(out / "ckpt-0000005")  # a save cut short
    _write(str(out / "ckpt-0000005" / ("rank0.pt" + files.TEMPORARY_MARK)))
    shutil.copytree(out / "ckpt-0000003", out / "ckpt-0000002")
    _write(str(out / "ckpt-0000003" / f"rank1.pt{files.TEMPORARY_MARK}.4243"))
    _write(str(out / f"checkpoint.json{files.TEMPORARY_MARK}.4244"))
    _write(str(out / "ckpt-0000002" / "notes.txt"))  # the user's file in an old folder: that folder stays
    _write(str(out / "ckpt-notes" / "todo.txt"))
    _write(str(out / "ckpt-0000003" / "notes.txt"))  # a user's file in the current folder stays too
    checkpoints.check_resumable(cfg)
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt")) == ["ckpt-0000002", "ckpt-0000003",
                                                                          "ckpt-notes"]
    assert sorted(os.listdir(out / "ckpt-0000003")) == ["manifest.json", "model.pt", "notes.txt", "rank0.pt",
                                                         "rank1.pt", "trainer.pt"]
    assert not [n for n in os.listdir(out) if "tmp" in n] and (out / "ckpt-notes" / "todo.txt").exists()
    assert len(os.listdir(out / "ckpt-0000002")) == 6
    err = capsys.readouterr().err
    assert "ckpt-0000001/" in err and "ckpt-0000005/" in err and "ckpt-0000002/ (holds notes.txt)" in err


@pytest.mark.parametrize("how", ["another optimizer", "swapped"])
def test_another_runs_rank_files_are_refused_at_the_start(run_copy, capsys, how):
    """Rank files of another optimizer's run (or of the other rank), with the manifest made to
    match them: refused before any worker starts, in one line (exit 2). Before, both workers ended
    in raw tracebacks of load_state_dict's ValueError."""
    out, pointer, cfg = run_copy
    folder = out / "ckpt-0000003"
    blobs = {r: torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)}
    for r in range(2):
        own = blobs[r if how == "another optimizer" else 1 - r]
        if how == "another optimizer":
            entry = next(v for v in own["optimizer"]["state"].values() if "layer_numels" in v)
            entry["optimizer"] = "OneBitAdam"
        torch.save(own, folder / f"rank{r}.pt")
        pointer["sha256"][f"rank{r}.pt"] = checkpoints._sha256(str(folder / f"rank{r}.pt"))
    _set_pointer(out, pointer)
    named = "state of OneBitAdam" if how == "another optimizer" else "holds rank 1's optimizer state"
    with pytest.raises(ValueError, match=named):
        checkpoints.check_resumable(cfg)
    code = cli.main(["pretrain", *_flags(cfg), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_write_that_fails_leaves_no_temporary_file_and_says_what_is_missing(tmp_path, monkeypatch):
    """A full disk under a checkpoint file: one sentence naming the file and the missing space, and
    no ``*.pt.tmp.<pid>`` left behind (before: the raw OSError, the temporary file left)."""
    import errno
    from onebitlamb.train import data, files

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(files.WriteError, match=r"rank0\.pt could not be written: no space left on the disk"):
        data.atomic_save({"w": torch.zeros(4)}, str(tmp_path / "rank0.pt"))
    with pytest.raises(files.WriteError, match=r"metrics\.json could not be written: no space left"):
        files.write_json(str(tmp_path / "metrics.json"), {"a": 1})
    assert os.listdir(tmp_path) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 320 KiB tmpfs (room for the run's first files, not for its first checkpoint): a real full disk."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    yield disk
    subprocess.run(["umount", str(disk)])


def test_a_full_disk_is_one_line_on_every_rank_naming_the_rank_and_the_file(small_disk, common, capfd):
    """The checkpoint of step 1 does not fit on OUT's disk: every rank stops with the sentence of the
    rank that could not write (its rank, its file, no space left), exit 1, nothing half-written left.
    Before, a 50-line traceback, or only rank 1's gloo "Connection closed by peer", and a
    ``rank0.pt.tmp.<pid>`` left in the checkpoint folder. (The command in this process; its workers
    write to the same captured stderr.)"""
    out = small_disk / "run"
    code = cli.main(["pretrain", *common, "--optimizer", "onebitlamb", "--out", str(out), "--ckpt-every", "1",
                     "--steps", "3"])
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert "Traceback" not in err and "Connection closed" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.search(r"error: checkpoint of step 1: rank [01]: \S+ could not be written: no space left on the disk",
                     last), last
    assert not [n for _, _, names in os.walk(out) for n in names if ".tmp" in n]


def test_a_missing_rank_file_is_refused_at_the_start(run_copy):
    out, _, cfg = run_copy
    pointer = json.loads((out / "checkpoint.json").read_text())
    os.remove(out / pointer["folder"] / "rank1.pt")
    pointer["sha256"].pop("rank1.pt", None)
    (out / "checkpoint.json").write_text(json.dumps(pointer))
    with pytest.raises(ValueError, match="some rank's file is missing"):
        checkpoints.check_resumable(cfg)


def _flags(cfg):
    return ["--preset", "tiny", "--optimizer", cfg.optimizer, "--freeze", str(cfg.freeze), "--corpus", *cfg.corpus,
            "--cache-dir", cfg.cache_dir, "--out", cfg.out, "--no-progress"]


def test_a_checkpoint_folder_copied_alone_into_a_new_out_resumes(run_copy, tmp_path, common, capsys):
    """--resume in an OUT holding a checkpoint folder but no checkpoint.json (the folder copied
    alone into a new --out, or the pointer deleted): the newest complete checkpoint (its own
    manifest.json, every file matching it) is resumed, checkpoint.json written to name it, and the
    run ends bit for bit where the original resumed run ends. Before, every ckpt-* folder was
    removed as an interrupted run's leftovers and the run trained from step 0, exit 0."""
    out, pointer, cfg = run_copy
    new = tmp_path / "new"
    new.mkdir()
    shutil.copytree(out / "ckpt-0000003", new / "ckpt-0000003")
    deleted = tmp_path / "deleted"
    shutil.copytree(out, deleted)
    os.remove(deleted / "checkpoint.json")
    checkpoints.check_resumable(dataclasses.replace(cfg, out=str(deleted), cache_dir=cfg.cache_dir))
    assert checkpoints.read_pointer(str(deleted)) == pointer and len(os.listdir(deleted / "ckpt-0000003")) == 5
    flags = [*common, "--optimizer", "onebitlamb", "--resume"]
    assert pretrain_on_ranks(*flags, "--out", str(new)).summary["completed"]
    err = capsys.readouterr().err
    assert f"{new} has no checkpoint.json: continuing from ckpt-0000003 (step 3)" in err, err[-3000:]
    assert pretrain_on_ranks(*flags, "--out", str(out)).summary["completed"]
    resumed, original = (torch.load(d / "model_final.pt", weights_only=True) for d in (new, out))
    assert resumed.keys() == original.keys() and all(torch.equal(resumed[k], original[k]) for k in original)
    assert json.loads((new / "metrics.json").read_text())["final_eval_loss"] == \
        json.loads((out / "metrics.json").read_text())["final_eval_loss"]


@pytest.mark.parametrize("left", ["results", "a checkpoint without its manifest", "a damaged checkpoint"])
def test_a_resume_with_nothing_to_continue_never_starts_over_on_top_of_it(run_copy, tmp_path, capsys, left):
    """--resume without checkpoint.json and without a complete checkpoint folder: where OUT holds
    an earlier run's results, or checkpoint files whose manifest cannot prove them (a checkpoint of
    an earlier version, a damaged one), it is refused in one line (exit 2) saying how to go on, and
    nothing is removed. Before, the folders were removed and the run trained from step 0 over the
    results, exit 0."""
    out, pointer, cfg = run_copy
    new = tmp_path / "new"
    if left == "results":
        for name in ("metrics.json", "model_final.pt", "config.json", "log.csv"):
            _as_a_run_writes(str(new), name)
        said = "holds an earlier run's results (metrics.json, model_final.pt) but no checkpoint"
    else:
        shutil.copytree(out / "ckpt-0000003", new / "ckpt-0000003")
        if left == "a damaged checkpoint":
            blob = bytearray((new / "ckpt-0000003" / "rank1.pt").read_bytes())
            blob[len(blob) // 2] ^= 0x01
            (new / "ckpt-0000003" / "rank1.pt").write_bytes(bytes(blob))
            said = "ckpt-0000003 is damaged: its manifest.json does not list rank1.pt with the sha256 they have"
        else:
            (new / "ckpt-0000003" / "manifest.json").unlink(missing_ok=True)  # as an earlier version saved it
            said = "holds model.pt, rank0.pt, rank1.pt, trainer.pt without the manifest.json a complete checkpoint"
    before = _tree(new)
    moved = dataclasses.replace(cfg, out=str(new))
    with pytest.raises(ValueError, match=re.escape(said)):
        checkpoints.check_resumable(moved)
    code = cli.main(["pretrain", *_flags(moved), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and said in err and "nothing was changed" in err, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and _tree(new) == before
    if left == "a checkpoint without its manifest":  # its run's checkpoint.json beside it: it resumes
        shutil.copy(out / "checkpoint.json", new / "checkpoint.json")
        checkpoints.check_resumable(moved)


def test_only_what_the_run_can_prove_its_own_is_removed(run_copy, tmp_path, capsys):
    """--overwrite, and a --resume's removal of what an interrupted run left, remove a file only
    when the run can prove it its own: under the run's temporary name, or listed with its sha256 in
    a manifest the run wrote. A user's ``*.json.tmp`` and the user's own files named model.pt,
    trainer.pt or rankN.pt in a ckpt-* folder stay, named; where the run will make such a folder
    they are refused at the start, and nothing is removed. Before, both removed them by name."""
    mine = "my own file\n"
    fresh = tmp_path / "fresh"
    _earlier_run(fresh)  # a run's checkpoint (its manifest) in ckpt-0000002, an interrupted write in ckpt-0000004
    users = ["metrics.json.tmp", "checkpoint.json.tmp", "ckpt-0000012/model.pt", "ckpt-0000012/trainer.pt",
             "ckpt-0000012/rank0.pt"]
    for name in users:
        _write(str(fresh / name), mine)
    checkpoints.prepare_out_dir(_config(fresh, overwrite=True))
    assert all((fresh / name).read_text() == mine for name in users)
    assert not (fresh / "ckpt-0000002").exists() and not (fresh / "ckpt-0000004").exists()
    err = capsys.readouterr().err
    assert "removed the earlier run's" in err and "ckpt-0000002/" in err.split("left in place")[0]
    assert "checkpoint.json.tmp" in err and "metrics.json.tmp" in err.split("left in place")[1]
    assert "ckpt-0000012/ (holds model.pt, notes.txt, rank0.pt, trainer.pt)" in err
    # where the run makes its checkpoint of step 4: refused, before anything is removed
    _write(str(fresh / "ckpt-0000004" / "rank0.pt"), mine)
    _as_a_run_writes(str(fresh), "metrics.json")
    before = _tree(fresh)
    with pytest.raises(ValueError, match="ckpt-0000004 holds rank0.pt, where the run makes its checkpoint of step 4"):
        checkpoints.prepare_out_dir(_config(fresh, overwrite=True))
    assert _tree(fresh) == before
    # a resume's leftovers: the user's files stay, the run's own go
    out, pointer, cfg = run_copy
    shutil.copytree(out / "ckpt-0000003", out / "ckpt-0000001")  # the run's previous checkpoint
    for name in ("checkpoint.json.tmp", "ckpt-0000002/rank0.pt", "ckpt-0000002/model.pt"):
        _write(str(out / name), mine)
    checkpoints.check_resumable(cfg)
    assert not (out / "ckpt-0000001").exists() and (out / "checkpoint.json.tmp").read_text() == mine
    assert sorted(os.listdir(out / "ckpt-0000002")) == ["model.pt", "rank0.pt"]
    assert "ckpt-0000002/ (holds model.pt, rank0.pt)" in capsys.readouterr().err


@pytest.mark.parametrize("world_size", ["2", None, 2.5, 1, 0, True])
def test_an_edited_world_size_is_one_line_naming_it(run_copy, capsys, world_size):
    """checkpoint.json's world_size edited: refused at the start in one line naming the value
    (exit 2), nothing removed. Before, a string, null or a float ended in a raw TypeError traceback
    (one per rank under torchrun), and 1 was reported as a missing rank file."""
    out, pointer, cfg = run_copy
    pointer["world_size"] = world_size
    _set_pointer(out, pointer)
    before = _tree(out)
    said = f"checkpoint.json is damaged: its world_size is {world_size!r}"
    with pytest.raises(ValueError, match=re.escape(said)):
        checkpoints.check_resumable(cfg)
    code = cli.main(["pretrain", *_flags(cfg), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _tree(out) == before


def test_a_link_at_a_later_checkpoint_folder_is_refused_before_a_new_run_starts(tmp_path, common, capfd):
    """A link at a ckpt-<step> folder the run would make (here a dangling one, which shows no
    earlier run): refused at the start in one line naming it, exit 2, nothing trained. Before, the
    run trained to that step, then stopped (exit 1) saying that checkpoint.json still named a
    previous checkpoint that did not exist."""
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(tmp_path / "missing", out / "ckpt-0000004")
    code = cli.main(["pretrain", *common, "--optimizer", "lamb", "--out", str(out)])
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    assert "ckpt-0000004 is a link, where the run makes its checkpoint of step 4" in err
    assert "held-out loss" not in err and "previous" not in err and "Traceback" not in err
    assert os.listdir(out) == ["ckpt-0000004"] and not os.path.exists(tmp_path / "missing")


def _store(cfg):
    """A checkpoint store of one rank, and a state to save (a linear model, a stub optimizer)."""
    model = torch.nn.Linear(2, 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1.0), lambda s: 1.0)
    return checkpoints.CheckpointStore(cfg, 0, 1, "cpu"), checkpoints.TrainState(model, _Stub(), scheduler,
                                                                                {"steps": []})


def test_a_checkpoint_that_cannot_be_written_says_which_one_is_kept(tmp_path):
    """A link, or a file of someone else's, at the next checkpoint folder while the run trains: the
    run stops naming it, and says truly what stays: the checkpoint checkpoint.json names, or that
    none was written yet. Before, the first checkpoint's message spoke of a previous checkpoint that
    did not exist."""
    store, state = _store(_config(tmp_path, workers=1))
    os.symlink(tmp_path / "elsewhere", tmp_path / "ckpt-0000002")
    with pytest.raises(RuntimeError, match="ckpt-0000002 is a link") as first:
        store.save(2, state)
    assert "no checkpoint of this run was written before it" in str(first.value)
    assert "previous" not in str(first.value) and not os.path.exists(tmp_path / "checkpoint.json")
    os.remove(tmp_path / "ckpt-0000002")
    store.save(2, state)
    _write(str(tmp_path / "ckpt-0000004" / "model.pt"), "mine")
    with pytest.raises(RuntimeError, match="ckpt-0000004 holds model.pt, which the run cannot prove its own") as later:
        store.save(4, state)
    assert "checkpoint.json still names the checkpoint of step 2, which is kept" in str(later.value)
    assert (tmp_path / "ckpt-0000004" / "model.pt").read_text() == "mine"
    assert checkpoints.read_pointer(str(tmp_path))["step"] == 2


def test_a_resume_with_other_settings_names_the_way_forward(run_copy, tmp_path, capsys):
    """--resume with a setting that changes the numbers: the refusal lists the difference, the
    settings a resume may change, the saved values that continue the run, and a new run (another
    --out, or --overwrite) for the new ones; compare --resume's refusal of a finished run too.
    Before, it listed the difference and stopped there."""
    out, _, cfg = run_copy
    with pytest.raises(ValueError) as refused:
        checkpoints.check_resumable(dataclasses.replace(cfg, steps=12))
    said = str(refused.value)
    assert "(saved, now): {'steps': (8, 12)}" in said and "give the saved values (--steps 8)" in said
    may = said.split("only ")[1].split(" may differ")[0]
    assert all(f in may for f in ("--workers", "--threads", "--timeout", "--stop-after-steps", "--cache-dir"))
    assert "--steps" not in may and "another --out, or --overwrite" in said
    code = cli.main(["pretrain", *_flags(cfg), "--resume", "--steps", "12"])
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    saved = dataclasses.asdict(_config(tmp_path / "cmp" / "lamb", preset="tiny", optimizer="lamb", lr=0.5))
    _write(str(tmp_path / "cmp" / "lamb" / "metrics.json"), json.dumps({"config": saved, "final_eval_loss": 5.0}))
    code = cli.main(["compare", "--preset", "tiny", "--optimizers", "lamb", "--out", str(tmp_path / "cmp"),
                     "--resume", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "'lr': (0.5, 0.02)" in err and "give the saved values (--lr 0.5)" in err, err
    assert "another --out, or --overwrite" in err


class _Payload:
    """Unpickling this creates ``marker``: what a planted checkpoint file could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def _plant(path, marker):
    """Add to a checkpoint file an object whose unpickling runs code; returns the original bytes."""
    original = path.read_bytes()
    real = torch.load(path, weights_only=True)
    torch.save({**real, "payload": _Payload(str(marker))}, path)
    return original


@pytest.mark.parametrize("manifest", ["updated", "stale", "absent"])
def test_a_planted_trainer_pt_runs_no_code(run_copy, tmp_path, manifest, capsys):
    out, pointer, cfg = run_copy
    trainer = out / "ckpt-0000003" / "trainer.pt"
    # the payload is live: an unsafe load runs it
    original = _plant(trainer, tmp_path / "proof")
    torch.load(trainer, weights_only=False)
    assert (tmp_path / "proof").exists()
    trainer.write_bytes(original)
    marker = tmp_path / "planted-code-ran"
    _plant(trainer, marker)
    if manifest == "updated":  # whoever can write the file can write the pointer too
        pointer["sha256"]["trainer.pt"] = checkpoints._sha256(str(trainer))
    elif manifest == "absent":  # refused before any file is loaded (the manifest is required)
        del pointer["sha256"]
    _set_pointer(out, pointer)
    named = {"updated": "trainer.pt", "stale": "trainer.pt", "absent": "manifest"}[manifest]
    with pytest.raises(ValueError, match=named):
        checkpoints.check_resumable(cfg)
    code = cli.main(["pretrain", *_flags(cfg), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and named in err
    assert {"updated": "weights_only", "stale": "damaged", "absent": "cannot be checked"}[manifest] in err
    assert not marker.exists()


def test_a_planted_rank_file_runs_no_code_in_the_workers(run_copy, tmp_path):
    """The workers load with weights_only=True too (here past the start's check, which is skipped)."""
    out, pointer, cfg = run_copy
    rank1 = out / "ckpt-0000003" / "rank1.pt"
    marker = tmp_path / "planted-code-ran"
    _plant(rank1, marker)
    pointer["sha256"]["rank1.pt"] = checkpoints._sha256(str(rank1))
    _set_pointer(out, pointer)
    with pytest.raises(ValueError, match="rank1.pt.*weights_only"):
        checkpoints._load_checkpoint_file(str(out), pointer, "rank1.pt", "cpu")
    assert not marker.exists()


@pytest.mark.parametrize("folder", ["../elsewhere", "/tmp", "ckpt-0000003/../../elsewhere", "ckpt-0000003/",
                                    "elsewhere", "ckpt-12", "", None, 7])
def test_checkpoint_json_must_name_a_plain_folder_inside_out(run_copy, tmp_path, folder, capsys):
    out, pointer, cfg = run_copy
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / "ckpt-0000003", elsewhere)
    pointer["folder"] = folder
    _set_pointer(out, pointer)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="checkpoint folder|not a folder inside"):
        checkpoints.check_resumable(cfg)
    assert cli.main(["pretrain", *_flags(cfg), "--resume"]) == 2
    assert repr(folder) in capsys.readouterr().err
    assert _tree(tmp_path) == before  # nothing removed, here or there


def test_a_linked_checkpoint_folder_is_refused(run_copy, tmp_path):
    out, pointer, cfg = run_copy
    shutil.move(out / "ckpt-0000003", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", out / "ckpt-0000003")
    with pytest.raises(ValueError, match="link"):
        checkpoints.check_resumable(cfg)


def test_a_non_plain_object_is_refused_when_saving_not_when_resuming():
    checkpoints._check_plain({"a": [1, 2.0, (3, None)], "t": torch.zeros(2), "s": "x", "d": torch.float32}, "x.pt")
    with pytest.raises(TypeError, match=r"trainer.pt\['history'\]\['f'\] is a Fraction"):
        from fractions import Fraction

        checkpoints._check_plain({"history": {"f": Fraction(1, 3)}}, "trainer.pt")


class _Stub:
    def __init__(self):
        self.comm_stats = self

    def state_dict(self):
        return {"x": torch.ones(3)}


def test_the_previous_checkpoint_is_removed_only_after_the_switch(tmp_path, monkeypatch):
    store, state = _store(_config(tmp_path, workers=1))
    save = lambda step: store.save(step, state)
    save(2)
    removed = set()
    real_remove = checkpoints._remove_if_there

    def remove(path):
        with open(tmp_path / "checkpoint.json") as f:
            assert json.load(f)["folder"] == "ckpt-0000004"  # the switch came first
        removed.add(os.path.basename(os.path.dirname(path)))
        return real_remove(path)

    monkeypatch.setattr(checkpoints, "_remove_if_there", remove)
    # a crash while writing the next checkpoint: the previous one is still named and whole
    real_save = checkpoints.atomic_save
    monkeypatch.setattr(checkpoints, "atomic_save",
                        lambda obj, path, **kw: (_ for _ in ()).throw(OSError("disk full")) if "trainer" in path
                        else real_save(obj, path, **kw))
    with pytest.raises(OSError):
        save(4)
    assert checkpoints.read_pointer(str(tmp_path))["folder"] == "ckpt-0000002" and removed == set()
    for name in ("model.pt", "trainer.pt", "rank0.pt"):
        checkpoints._load_checkpoint_file(str(tmp_path), checkpoints.read_pointer(str(tmp_path)), name, "cpu")
    monkeypatch.setattr(checkpoints, "atomic_save", real_save)
    save(4)  # into the folder the crash left, which holds the run's own files only
    assert removed == {"ckpt-0000002"} and not (tmp_path / "ckpt-0000002").exists()
    assert sorted(os.listdir(tmp_path / "ckpt-0000004")) == ["manifest.json", "model.pt", "rank0.pt", "trainer.pt"]
    assert checkpoints.read_pointer(str(tmp_path))["step"] == 4


# ---- a non-finite loss


def test_a_diverging_run_stops_with_an_error_and_keeps_the_last_good_checkpoint(tmp_path, common, capfd):
    """LAMB at lr 1e4 on the tiny preset: the loss is 6.2, 5e7, 3e11, then NaN at step 4. The first
    run is the command's (its exit status and its message) and the comparison, both in this process
    (their workers write to the captured stderr; a launch would only add a third interpreter to
    start); the resume runs on the persistent ranks (tests/pretrain_pool.py)."""
    flags = [*common, "--optimizer", "lamb", "--lr", "1e4", "--out", str(tmp_path)]
    capfd.readouterr()
    code = cli.main(["pretrain", *flags])
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert "step 4" in err and "not finite" in err and "done" not in err
    assert "ckpt-0000002, step 2) is kept" in err and "Traceback" not in err
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "model_final.pt").exists()
    with open(tmp_path / "checkpoint.json") as f:
        pointer = json.load(f)
    assert pointer["step"] == 2 and os.listdir(tmp_path / "ckpt-0000002")
    model = torch.load(tmp_path / "ckpt-0000002" / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in model.values())
    for name in ("rank0.pt", "rank1.pt"):
        state = torch.load(tmp_path / "ckpt-0000002" / name, weights_only=True)["optimizer"]["state"]
        tensors = [t for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        assert tensors and all(torch.isfinite(t).all() for t in tensors)
    # it stops the same way when resumed from there, and compare reports it as a failure too
    resumed = pretrain_on_ranks(*flags, "--resume").summary
    assert pretrain.exit_code(resumed) == 1 and "step 4" in resumed["error"], resumed
    assert checkpoints.read_pointer(str(tmp_path))["step"] == 2
    compared = tmp_path / "compare"
    capfd.readouterr()
    code = cli.main(["compare", *common, "--optimizers", "lamb", "--lr", "1e4", "--out", str(compared)])
    assert code == 1 and "step 4" in capfd.readouterr().err
    assert not (compared / "metrics.json").exists() and not (compared / "lamb" / "metrics.json").exists()


def test_non_finite_parameters_are_never_saved(tmp_path, common, monkeypatch):
    """A step that leaves a parameter non-finite while the loss before it was finite: the check
    before each checkpoint stops the run there (one rank in this process)."""
    import signal

    import torch.distributed as dist

    corpus, cache = common[common.index("--corpus") + 1], common[common.index("--cache-dir") + 1]
    cfg = _config(tmp_path / "out", optimizer="lamb", workers=1, ckpt_every=1, corpus=[corpus], cache_dir=cache,
                  progress=False)
    make_optimizer = loop.make_optimizer

    def poisoned(cfg, groups, replicate_group=None):
        optimizer = make_optimizer(cfg, groups, replicate_group)
        step, calls = optimizer.step, []

        def poisoning_step(self, *a, **k):
            out = step(*a, **k)
            calls.append(1)
            if len(calls) == 3:
                with torch.no_grad():
                    self.param_groups[0]["params"][0][0, 0] = float("inf")
            return out

        optimizer.step = types.MethodType(poisoning_step, optimizer)  # a method, as the scheduler expects
        return optimizer

    monkeypatch.setattr(loop, "make_optimizer", poisoned)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        checkpoints.prepare_out_dir(cfg)
        result = loop.train_rank(0, 1, cfg)
    finally:
        dist.destroy_process_group()
        for s, h in handlers.items():
            signal.signal(s, h)
    assert result["error"] and "parameters are not finite after step 3" in result["error"]
    assert "ckpt-0000002, step 2) is kept" in result["error"] and pretrain.exit_code(result) == 1
    assert checkpoints.read_pointer(cfg.out)["step"] == 2 and not (tmp_path / "out" / "ckpt-0000003").exists()
    model = torch.load(tmp_path / "out" / "ckpt-0000002" / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in model.values())
    assert not (tmp_path / "out" / "metrics.json").exists()


def _shared_out_check(rank, world, folders):
    try:
        ranks.check_shared_out(folders[rank], rank, world)
    except ValueError as exc:
        return str(exc)
    return sorted(os.listdir(folders[rank]))


def test_every_rank_must_write_and_see_out(tmp_path):
    """What torchrun's ranks on machines without a shared file system meet: each sees its own folder."""
    from rank_pool import run_ranks

    shared = tmp_path / "shared"
    shared.mkdir()
    assert run_ranks(_shared_out_check, 2, ([str(shared)] * 2,), timeout_s=60) == [[], []]  # probes removed
    apart = [tmp_path / "node0", tmp_path / "node1"]
    for folder in apart:
        folder.mkdir()
    errors = run_ranks(_shared_out_check, 2, ([str(f) for f in apart],), timeout_s=60)
    assert errors[0] == errors[1] and "rank 1 does not see the files rank 0 writes" in errors[0]
    errors = run_ranks(_shared_out_check, 2, ([str(shared), str(tmp_path / "missing")],), timeout_s=60)
    assert errors[0] == errors[1] and "rank 1 cannot write" in errors[0] and "shared file system" in errors[0]


def _ranks_agree_check(rank, world, drift):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if drift and rank == 1:
        with torch.no_grad():
            model.bias[0] += 1e-6
    try:
        ranks.check_ranks_agree(model, rank, world, 12, torch.device("cpu"))
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_rank_whose_parameters_drifted_is_named_before_a_checkpoint():
    from rank_pool import run_ranks

    assert run_ranks(_ranks_agree_check, 2, (False,), timeout_s=60) == [None, None]
    errors = run_ranks(_ranks_agree_check, 2, (True,), timeout_s=60)
    assert all("after step 12 the parameters of rank(s) [1] differ from rank 0's" in e for e in errors), errors
