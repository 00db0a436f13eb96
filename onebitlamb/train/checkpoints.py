"""The checkpoint store and OUT's files: OUT/ckpt-<step>/{model.pt, trainer.pt, rank<r>.pt,
manifest.json}, OUT/checkpoint.json naming the last.

A checkpoint is written in two steps. Every rank writes its file under the run's temporary name
(``files.temporary_name``), flushed; rank 0 checks each file on disk against the sha256 its writer
computed, writes those sha256 into the folder's manifest.json, renames the files to their names,
switches checkpoint.json to the folder (the same manifest), and only then removes the previous
folder: a crash at any point leaves the previous complete checkpoint in place, and every file in a
checkpoint folder is, at every moment, provably the run's own (under its temporary name, or listed
with its sha256 in a manifest the run wrote). What a run removes from OUT (``--overwrite``, a
``--resume``'s leftovers) is what it can prove so, nothing else. The manifest is checked again on
--resume; a folder copied into another OUT without checkpoint.json carries its own, and resumes.
Every file is plain data (tensors, numbers, strings, lists, dicts), loaded with
``weights_only=True``: a planted pickle runs no code. (Multi-node runs need OUT on a shared file
system.)
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import os
import random
import re
import sys
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

import onebitlamb
from onebitlamb.train import files, runlog
from onebitlamb.train.config import RunError, SetupError, TrainConfig, changed_settings, resume_refusal
from onebitlamb.train.data import atomic_save
from onebitlamb.train.ranks import check_ranks_agree, first_problem, gather_digests
from onebitlamb.train.sharding import load_model, saved_model

POINTER = "checkpoint.json"
MANIFEST = "manifest.json"  # in each checkpoint folder: what checkpoint.json held when it named the folder
CKPT_FOLDER = re.compile(r"ckpt-([0-9]{7,})")
_TEMPORARY = f"(?:{re.escape(files.TEMPORARY_MARK)}(?:\\.[0-9]+)?)?"
# what a run writes into OUT (with the temporary names it writes them under first) and into a
# checkpoint folder: --overwrite removes these, when their content shows them the run's, and nothing else
RUN_FILE = re.compile(r"(?:(?:checkpoint|metrics|config)\.json|(?:freeze|curves)\.png|log\.csv|model_final\.pt)"
                      + _TEMPORARY)
SAVED_FILE = re.compile(r"(?:model|trainer|rank[0-9]+)\.pt")  # what a manifest lists
CKPT_FILE = re.compile(rf"(?:{SAVED_FILE.pattern}|{re.escape(MANIFEST)}){_TEMPORARY}")
EVENTS_FILE = re.compile(r"events\.out\.tfevents\..+")  # in OUT/tensorboard (runlog.py)
RANK_FILE = re.compile(r"rank([0-9]+)\.pt")
TEMPORARY = files.TEMPORARY  # a file of the run's being written (files.write_json, atomic_save)


def checkpoint_folder(step: int) -> str:
    return f"ckpt-{step:07d}"


def existing_run(out: str) -> List[str]:
    """What shows an earlier run in ``out`` or stands where a run writes: a file (or link) with the
    name of one of a run's files (its pointer, config, results, logs), its checkpoint folders."""
    if not os.path.isdir(out):
        return []
    return sorted(name for name in os.listdir(out)
                  if RUN_FILE.fullmatch(name)
                  or (CKPT_FOLDER.fullmatch(name) and os.path.isdir(os.path.join(out, name))))


def is_run_config(path: str) -> bool:
    """Whether ``path`` is a config.json a run wrote (TrainConfig's fields), not a file of the user's."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"optimizer", "out", "seed", "steps", "global_batch"} <= set(saved)


def _json_of(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _starts_with(path: str, prefix: bytes, also: bytes = b"", within: int = 512) -> bool:
    """Whether the file at ``path`` starts with ``prefix`` and holds ``also`` in its first ``within`` bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(within)
    except OSError:
        return False
    return head.startswith(prefix) and also in head


def _is_torch_file(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/data.pkl") for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def written_by_a_run(path: str) -> bool:
    """Whether the file at ``path``, at one of the names a run (or a comparison) writes, is what a
    run wrote there, judged by its content: a name alone is no proof (a user's own ``metrics.json``
    or ``log.csv`` has it too). A file under the run's temporary name (``files.temporary_name``) is its own."""
    name = os.path.basename(path)
    if TEMPORARY.search(name):
        return True
    if name == "config.json":
        return is_run_config(path)
    if name == POINTER:
        saved = _json_of(path)
        return isinstance(saved, dict) and {"folder", "step"} <= set(saved)
    if name == "metrics.json":  # a run's, or a comparison's
        saved = _json_of(path)
        return isinstance(saved, dict) and ({"config", "final_eval_loss"} <= set(saved)
                                            or {"optimizers", "comparison", "table"} <= set(saved))
    if name == runlog.CSV_FILE:
        return _starts_with(path, ",".join(runlog.COLUMNS).encode() + b"\r\n")
    if name.endswith(".png"):  # drawn by matplotlib, which names itself in the file's header
        return _starts_with(path, b"\x89PNG\r\n\x1a\n", b"Matplotlib")
    if name.endswith(".pt"):
        return _is_torch_file(path)
    if name == "table.md":  # a comparison's table ends with its total time
        try:
            with open(path, errors="replace") as f:
                return re.search(r"^total \d+ s for the \d+ runs including start-up", f.read(), re.M) is not None
        except OSError:
            return False
    if EVENTS_FILE.fullmatch(name):  # a TFRecord whose first event names its file version
        return _starts_with(path, b"", b"brain.Event:", within=64)
    return False


def check_run_names(out: str, names: Optional[re.Pattern] = None) -> None:
    """Where a run writes its own files in ``out`` (``names``: a run's, by default) there must be
    nothing of anybody else's: a link at one of those names, or a file there that a run did not
    write (``written_by_a_run``), is refused by name, with --overwrite too (which removes the run's
    own files only)."""
    if not os.path.isdir(out):
        return
    names = RUN_FILE if names is None else names
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if (names.fullmatch(name) or name == files.LOCK_FILE) and os.path.islink(path):
            raise SetupError(f"{path} is a link, where the run writes its own {name}: not following it; remove "
                             f"the link, or choose another --out")
        if names.fullmatch(name) and os.path.isfile(path) and not written_by_a_run(path):
            what = "a configuration" if name == "config.json" else "a file"
            raise SetupError(f"{path} is not {what} a run wrote (a file of yours?): the run writes its own {name} "
                             f"there and --overwrite removes the run's own files only; move it, or choose another "
                             f"--out")


def refuse_existing_run(cfg: TrainConfig, out: Optional[str] = None) -> List[str]:
    """Without --resume or --overwrite, an earlier run in OUT is an error that says how to go on.
    Returns what shows that run (empty when there is none)."""
    out = cfg.out if out is None else out
    found = [] if cfg.resume else existing_run(out)
    if found and not cfg.overwrite:
        raise SetupError(f"{out} holds an earlier run ({', '.join(found)}): continue it with --resume, or start "
                         f"over with --overwrite (which removes that run's own files only), or choose another --out")
    return found


class OutPlan:
    """What a run does to OUT before it starts, decided (and every refusal made) before anything
    there changes, so that a refusal leaves OUT as it was: the run's own files and folders it
    removes, what it leaves in place (named), and, on a --resume without checkpoint.json, the
    checkpoint it continues from (checkpoint.json is written to name it). ``apply()`` does it (the
    leader alone: the local launcher, or rank 0 under torchrun)."""

    def __init__(self, cfg: TrainConfig, removing: str) -> None:
        self.cfg, self.removing = cfg, removing
        self.files: List[str] = []  # relative to OUT
        self.folders: List[Tuple[str, List[str]]] = []  # a folder of OUT, and its entries: all removed
        self.left: List[str] = []  # what stays, each with why
        self.adopt: Optional[dict] = None  # the pointer to write

    def apply(self) -> None:
        cfg, out = self.cfg, self.cfg.out
        os.makedirs(out, exist_ok=True)
        if self.adopt is not None:
            files.write_json(os.path.join(out, POINTER), self.adopt)
            print(f"[{cfg.optimizer}] --resume: {out} has no {POINTER}: continuing from {self.adopt['folder']} "
                  f"(step {self.adopt['step']}), its newest complete checkpoint (each file checked against the "
                  f"folder's {MANIFEST}); {POINTER} now names it", file=sys.stderr, flush=True)
        removed = []
        for rel in self.files:
            _remove_if_there(os.path.join(out, rel))
            removed.append(rel)
        for rel, names in self.folders:
            for name in names:
                _remove_if_there(os.path.join(out, rel, name))
            try:
                os.rmdir(os.path.join(out, rel))
                removed.append(rel + "/")
            except OSError:  # something else appeared in it meanwhile: it stays
                self.left.append(f"{rel}/ (what appeared in it)")
        if removed or self.left:
            print(f"[{cfg.optimizer}] {self.removing}: {', '.join(removed) or 'nothing'}"
                  + (f"; left in place (not provably a run's): {', '.join(self.left)}" if self.left else ""),
                  file=sys.stderr, flush=True)


def _remove_if_there(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _listdir(folder: str) -> List[str]:
    """The entries of ``folder`` (none when it is gone: the leader may be removing it)."""
    try:
        return sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


def prepare_out_dir(cfg: TrainConfig, remove: bool = True) -> OutPlan:
    """A new run (no --resume): refuse an earlier run in OUT, or with --overwrite plan the removal
    of its files; refuse a file of someone else's at a name the run writes (check_run_names), and
    anything but the run's own where it will write a checkpoint (``check_future_checkpoints``).
    With ``remove``, the plan is carried out; returns it."""
    check_run_names(cfg.out)
    refuse_existing_run(cfg)
    plan = OutPlan(cfg, "--overwrite: removed the earlier run's")
    if cfg.overwrite and os.path.isdir(cfg.out):
        _plan_run_files(plan, keep=(cfg.cache_dir,))
    check_future_checkpoints(plan, 0)
    if remove:
        plan.apply()
    return plan


def _plan_run_files(plan: OutPlan, keep=()) -> None:
    """--overwrite: the files a run writes into OUT whose content shows them a run's (its pointer,
    results, logs), and every checkpoint folder (and its TensorBoard folder) that holds nothing but
    what the run can prove its own (``own_entries``). Everything else stays, named; links are never
    followed."""
    out = plan.cfg.out
    keep = {os.path.abspath(k) for k in keep if k}
    pointer = _pointer_or_none(out)  # its manifest proves the files of a checkpoint saved without manifest.json
    for name in _listdir(out):
        path = os.path.join(out, name)
        if os.path.abspath(path) in keep or name == files.LOCK_FILE:  # held by this run (files.RunLock)
            continue
        if os.path.islink(path):
            plan.left.append(name)
        elif os.path.isfile(path) and RUN_FILE.fullmatch(name) and written_by_a_run(path):
            plan.files.append(name)
        elif os.path.isdir(path) and (CKPT_FOLDER.fullmatch(name) or name == runlog.TENSORBOARD_DIR):
            if CKPT_FOLDER.fullmatch(name):
                own, others = own_entries(path, [pointer])
            else:
                own, others = _own_events(path)
            if others:
                plan.left.append(f"{name}/ (holds {', '.join(others)})")
            else:
                plan.folders.append((name, own))
        else:
            plan.left.append(name + ("/" if os.path.isdir(path) else ""))


def _own_events(folder: str) -> Tuple[List[str], List[str]]:
    """(the run's, the others) among the entries of its TensorBoard folder: event files by content."""
    own, others = [], []
    for name in _listdir(folder):
        path = os.path.join(folder, name)
        mine = (not os.path.islink(path) and os.path.isfile(path) and EVENTS_FILE.fullmatch(name) is not None
                and written_by_a_run(path))
        (own if mine else others).append(name)
    return own, others


def own_entries(folder: str, manifests: Sequence[Optional[dict]] = (),
                known: Optional[Dict[str, tuple]] = None) -> Tuple[List[str], List[str]]:
    """(the run's own, the others) among the entries of the checkpoint folder ``folder``. The run's
    own: a regular file under the run's temporary name (``files.temporary_name``) of a checkpoint's
    file, the folder's manifest.json when it is one a run wrote, a file listed in it (or in one of
    ``manifests``: checkpoint.json's, which proves the files of a checkpoint saved before folders
    held a manifest) with the sha256 listed, or one of ``known`` (name: ``_identity``, the files
    this process committed). A name alone proves nothing: a link, a folder, or a file of the right
    name with other bytes is another's."""
    own_manifest = _folder_manifest(folder)
    digests: Dict[str, Set[str]] = collections.defaultdict(set)
    for m in (own_manifest, *manifests):
        for name, digest in (m or {}).get("sha256", {}).items():
            digests[name].add(digest)
    own, others = [], []
    for name in _listdir(folder):
        path = os.path.join(folder, name)
        if os.path.islink(path) or not os.path.isfile(path):
            mine = False
        elif TEMPORARY.search(name):
            mine = CKPT_FILE.fullmatch(name) is not None
        elif name == MANIFEST:
            mine = own_manifest is not None
        elif known is not None and name in known and known[name] == _identity(path):
            mine = True
        else:
            mine = name in digests and _sha256(path) in digests[name]
        if mine or os.path.lexists(path):  # (one removed meanwhile, by the leader under torchrun, is neither)
            (own if mine else others).append(name)
    return own, others


def _identity(path: str) -> Optional[tuple]:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_future_checkpoints(plan: OutPlan, start: int, named: Optional[str] = None) -> None:
    """Where the run will make a checkpoint folder (``ckpt-<step>`` for every step after ``start``
    up to --steps: a stop may come at any step) there must be nothing but what ``plan`` removes
    first: a link, a file, or a folder holding anything the run cannot prove its own is refused
    now, by name, instead of at that step's checkpoint. ``named``: the folder the run resumes from."""
    cfg = plan.cfg
    removed = {rel for rel, _ in plan.folders}
    for name in _listdir(cfg.out):
        m = CKPT_FOLDER.fullmatch(name)
        if m is None or name == named or name in removed or not start < int(m.group(1)) <= cfg.steps:
            continue
        path, step = os.path.join(cfg.out, name), int(m.group(1))
        where = f"where the run makes its checkpoint of step {step}"
        if not os.path.lexists(path):  # removed meanwhile (by the leader, under torchrun)
            continue
        if os.path.islink(path) or not os.path.isdir(path):
            kind = "a link" if os.path.islink(path) else "a file"
            raise SetupError(f"{path} is {kind}, {where}: not following or removing it; remove it, or choose "
                             f"another --out (nothing was changed)")
        _, others = own_entries(path)
        if others:
            raise SetupError(f"{path} holds {', '.join(others)}, {where}, and the run cannot prove them its own "
                             f"(not listed with their sha256 in a manifest it wrote, nor under its temporary "
                             f"names): they are neither removed nor written over; move them away, or choose another "
                             f"--out (nothing was changed)")


@dataclass
class TrainState:
    """What a checkpoint holds of a run besides its config: the model (saved once, by rank 0, as
    every rank's is the same; 0/1 Adam between its syncs: each rank's in its own file), this rank's optimizer (with its byte counts), the learning-rate
    schedule and the run's record (``history``). Each rank's RNG state is saved with it."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    history: dict


class CheckpointStore:
    """One rank's view of the checkpoints in ``cfg.out``: ``save(step, state)`` on every rank
    together, ``load(state)`` on --resume."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, device) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.saved: Optional[int] = None  # the step of the checkpoint checkpoint.json names (every rank)
        self._committed: Optional[Tuple[str, Dict[str, tuple]]] = None  # rank 0: its last folder, its files

    def save(self, step: int, state: TrainState) -> None:
        cfg, rank, world, device = self.cfg, self.rank, self.world, self.device
        # 0/1 Adam between its syncs: every rank's parameters are its own, and saved in its file; so
        # are the shards of a sharded model (--shard), beside the whole model gathered for model.pt
        sharded = cfg.shard > 1
        own_model = sharded or not getattr(state.optimizer, "parameters_synchronized", True)
        if not own_model:
            check_ranks_agree(state.model, rank, world, step, device)
        whole_model = saved_model(state.model, whole=True)  # a collective under --shard: every rank
        name = checkpoint_folder(step)
        folder = os.path.join(cfg.out, name)
        # A file of the run's that cannot be written safely (a link planted where it goes, at the
        # next ckpt-<step> folder or at a temporary name; a file of someone else's in that folder)
        # stops the run on every rank with rank 0's sentence, which says what stays: the checkpoint
        # checkpoint.json names (``self.saved``), or that none was written yet.
        problem = None
        if rank == 0:
            try:
                files.make_folder(folder)
            except files.OutError as exc:
                problem = str(exc)
            else:  # a folder already there: a save of this step cut short holds the run's own files only
                others = own_entries(folder)[1]
                if others:
                    problem = (f"{folder} holds {', '.join(others)}, which the run cannot prove its own: not "
                               f"writing its checkpoint there (nothing of it was removed)")
        problem = first_problem(problem, world)
        if problem is None:
            own = {"optimizer": state.optimizer.state_dict(), "comm_stats": state.optimizer.comm_stats.state_dict(),
                   "rng": _rng_state()}
            if own_model:
                own["model"] = saved_model(state.model, whole=False)
            _check_plain(own, f"rank{rank}.pt")
            digest = "00" * 32
            try:  # each file under its temporary name until rank 0 commits the checkpoint (_commit)
                digest = atomic_save(own, os.path.join(folder, f"rank{rank}.pt"), rename=False)
                if rank == 0:
                    trainer = {"step": step, "scheduler": state.scheduler.state_dict(), "history": state.history,
                               "config": dataclasses.asdict(cfg)}
                    _check_plain(trainer, "trainer.pt")
                    written = {"model.pt": atomic_save(whole_model, os.path.join(folder, "model.pt"), rename=False),
                               "trainer.pt": atomic_save(trainer, os.path.join(folder, "trainer.pt"), rename=False)}
            except files.OutError as exc:  # a link planted there; a full disk (files.WriteError)
                problem = f"rank {rank}: {exc}" if isinstance(exc, files.WriteError) else str(exc)
            digests = gather_digests(digest, rank, world, device)  # every rank has written its file
            if rank == 0 and problem is None:
                written.update({f"rank{r}.pt": d for r, d in enumerate(digests)})
                # what is on disk is what each rank wrote: only then does checkpoint.json move to it
                pending = {f: files.temporary_name(os.path.join(folder, f), unique=False) for f in written}
                bad = next((f for f, d in written.items() if _sha256(pending[f]) != d), None)
                if bad is not None:
                    problem = f"{pending[bad]} differs on disk from what was written"
                else:
                    problem = self._commit(name, step, written)
            problem = first_problem(problem, world)
        if problem is not None:
            kept = (f"{POINTER} still names the checkpoint of step {self.saved}, which is kept: continue with "
                    f"--resume once that is fixed" if self.saved is not None else
                    f"no checkpoint of this run was written before it, so there is none to continue from: once "
                    f"that is fixed, run it again with --overwrite")
            raise RunError(f"checkpoint of step {step}: {problem}. {kept}")
        self.saved = step

    def _commit(self, name: str, step: int, written: dict) -> Optional[str]:
        """Rank 0, every file of the checkpoint written under its temporary name and checked: the
        folder's manifest.json, the files renamed to their names, checkpoint.json switched to the
        folder, then the previous folder removed. Returns what went wrong (checkpoint.json
        unchanged), or None."""
        out = self.cfg.out
        folder = os.path.join(out, name)
        previous = _pointer_or_none(out)
        manifest = {"folder": name, "step": step, "world_size": self.world, "sha256": written}
        try:
            files.write_json(os.path.join(folder, MANIFEST), manifest)
            for f in written:
                path = os.path.join(folder, f)
                try:
                    os.replace(files.temporary_name(path, unique=False), path)
                except OSError as exc:
                    raise files.write_failed(path, exc) from None
            files.write_json(os.path.join(out, POINTER), manifest)
        except files.OutError as exc:
            return f"rank 0: {exc}" if isinstance(exc, files.WriteError) else str(exc)
        committed = self._committed
        self._committed = (name, {f: _identity(os.path.join(folder, f)) for f in written})
        if previous and previous["folder"] != name:  # keep only the latest, removed after the switch
            known = committed[1] if committed and committed[0] == previous["folder"] else None
            path = os.path.join(out, previous["folder"])
            own, others = own_entries(path, [previous], known)
            if others:
                print(f"[{self.cfg.optimizer}] {previous['folder']} left in place: it also holds {', '.join(others)}",
                      file=sys.stderr, flush=True)
            else:
                for f in own:
                    _remove_if_there(os.path.join(path, f))
                try:
                    os.rmdir(path)
                except OSError:  # something appeared in it meanwhile: it stays
                    print(f"[{self.cfg.optimizer}] {previous['folder']} left in place: something appeared in it",
                          file=sys.stderr, flush=True)
        return None

    def load(self, state: TrainState) -> int:
        """Restore ``state`` from the last checkpoint; returns its step (0 when there is none)."""
        cfg, rank, world, device = self.cfg, self.rank, self.world, self.device
        pointer = read_pointer(cfg.out)
        if pointer is None:
            if rank == 0:
                print(f"[{cfg.optimizer}] --resume: no checkpoint in {cfg.out}, starting from scratch",
                      file=sys.stderr)
            return 0
        trainer = _load_checkpoint_file(cfg.out, pointer, "trainer.pt", "cpu")
        _check_settings(cfg, trainer["config"])
        saved_ranks = len(_rank_files(cfg.out, pointer))
        if saved_ranks != world and cfg.shard > 1:
            raise SetupError(f"--resume: the checkpoint was saved by {saved_ranks} ranks with --shard {cfg.shard}, "
                             f"this run has {world}: each rank's file holds its shard of the model and of the "
                             f"optimizer state, which are not re-sharded; resume on {saved_ranks} workers")
        if saved_ranks == world:
            own = _load_checkpoint_file(cfg.out, pointer, f"rank{rank}.pt", device)
            optimizer_state = own["optimizer"]
        else:  # another number of ranks: every rank's compression errors, re-sharded
            saved = [_load_checkpoint_file(cfg.out, pointer, f"rank{r}.pt", device) for r in range(saved_ranks)]
            own = saved[rank % saved_ranks]  # the byte counts and RNG state of a rank that was
            optimizer_state = onebitlamb.reshard_state_dicts([s["optimizer"] for s in saved], world)[rank]
            if rank == 0:
                print(f"[{cfg.optimizer}] resuming a checkpoint of {saved_ranks} ranks on {world}: the compression "
                      f"errors are re-sharded (onebitlamb.reshard_state_dicts)", file=sys.stderr)
        load_model(state.model, own.get("model") or _load_checkpoint_file(cfg.out, pointer, "model.pt", device))
        state.optimizer.load_state_dict(optimizer_state)
        state.optimizer.comm_stats.load_state_dict(own["comm_stats"])
        state.scheduler.load_state_dict(trainer["scheduler"])
        _set_rng_state(own["rng"])
        state.history = trainer["history"]
        self.saved = trainer["step"]
        return trainer["step"]


def check_resumable(cfg: TrainConfig, remove: bool = True) -> OutPlan:
    """Before any worker starts, refuse a checkpoint that cannot be resumed: checkpoint.json naming
    anything but a ``ckpt-<digits>`` folder inside OUT, without its manifest or with a world_size
    that does not match it, a file missing, damaged (its sha256 is not the manifest's) or not plain
    data, or settings that change the numbers (changed_settings). A checkpoint of another number of
    ranks resumes, re-sharded (CheckpointStore.load).

    Without checkpoint.json (a checkpoint folder copied alone into a new OUT; the pointer deleted),
    the newest complete checkpoint folder (its own manifest.json, every file matching it) is the
    one resumed, and checkpoint.json is written to name it; a checkpoint folder without a manifest
    that proves its files, or an earlier run's results with no checkpoint at all, is refused: a
    run from step 0 would replace them. Then the plan (``OutPlan``) of what an interrupted run left
    (``_plan_leftovers``), and nothing but the run's own where it writes its next checkpoints
    (``check_future_checkpoints``); with ``remove`` (one process: the launcher, or rank 0) it is
    carried out. Returns the plan."""
    check_run_names(cfg.out)
    plan = OutPlan(cfg, "--resume: removed what an interrupted run left")
    pointer = read_pointer(cfg.out)
    if pointer is None:
        pointer = plan.adopt = _newest_complete(cfg.out)
    if pointer is None:
        _refuse_nothing_to_continue(cfg)
        start = 0
    else:
        start = _check_checkpoint(cfg, pointer)
    _plan_leftovers(plan, pointer)
    check_future_checkpoints(plan, start, None if pointer is None else pointer["folder"])
    if remove:
        plan.apply()
    return plan


def _check_checkpoint(cfg: TrainConfig, pointer: dict) -> int:
    """Every file of the checkpoint ``pointer`` names, checked as the workers will load it; returns its step."""
    folder = os.path.join(cfg.out, pointer["folder"])
    ranks = _rank_files(cfg.out, pointer)
    if not ranks or ranks != list(range(pointer.get("world_size", len(ranks)))):
        raise SetupError(f"the checkpoint {folder} of {pointer.get('world_size', '?')} ranks holds the files of "
                         f"ranks {ranks}: some rank's file is missing")
    step = 0
    for name in ("trainer.pt", "model.pt", *(f"rank{r}.pt" for r in ranks)):
        loaded = _load_checkpoint_file(cfg.out, pointer, name, "cpu")
        if name == "trainer.pt":
            _check_settings(cfg, loaded["config"])
            step = loaded["step"]
        elif RANK_FILE.fullmatch(name):
            _check_rank_file(cfg, os.path.join(folder, name), int(RANK_FILE.fullmatch(name).group(1)), loaded)
    return step


def _checkpoint_folders(out: str) -> List[str]:
    """The real ``ckpt-<digits>`` folders in ``out`` (no link), newest first."""
    found = [n for n in _listdir(out) if CKPT_FOLDER.fullmatch(n) and not os.path.islink(os.path.join(out, n))
             and os.path.isdir(os.path.join(out, n))]
    return sorted(found, key=lambda n: int(CKPT_FOLDER.fullmatch(n).group(1)), reverse=True)


def _complete(out: str, name: str) -> Optional[dict]:
    """The checkpoint in folder ``name`` as checkpoint.json would name it, when it is complete: its
    manifest.json a run wrote, every file listed there present with that sha256. Else None."""
    folder = os.path.join(out, name)
    manifest = _folder_manifest(folder)
    if manifest is None:
        return None
    for f, digest in manifest["sha256"].items():
        path = os.path.join(folder, f)
        if os.path.islink(path) or not os.path.isfile(path) or _sha256(path) != digest:
            return None
    return {**manifest, "folder": name}


def _newest_complete(out: str) -> Optional[dict]:
    return next(filter(None, (_complete(out, n) for n in _checkpoint_folders(out))), None)


def _refuse_nothing_to_continue(cfg: TrainConfig) -> None:
    """--resume with no checkpoint to continue from: a start from step 0 is refused where it would
    replace what a user may want, a checkpoint folder whose files cannot be proved (no
    manifest.json: an earlier version's; damaged) or an earlier run's results."""
    out = cfg.out
    for name in _checkpoint_folders(out):
        folder = os.path.join(out, name)
        saved = [n for n in own_entries(folder)[1] if SAVED_FILE.fullmatch(n)]
        if not saved:
            continue
        if _folder_manifest(folder) is not None:
            raise SetupError(f"--resume: {out} has no {POINTER}, and the checkpoint {folder} is damaged: its "
                             f"{MANIFEST} does not list {', '.join(saved)} with the sha256 they have. Not resuming "
                             f"from it, nor starting over on top of it: restore it, or choose another --out "
                             f"(nothing was changed)")
        raise SetupError(f"--resume: {out} has no {POINTER}, and {folder} holds {', '.join(saved)} without the "
                         f"{MANIFEST} a complete checkpoint holds (one saved by an earlier version, or not a "
                         f"run's), so its files cannot be checked: not resuming from them nor removing them. If "
                         f"it is a run's checkpoint, put that run's {POINTER} beside it and --resume again; to "
                         f"start over, move the folder away or choose another --out (nothing was changed)")
    results = [n for n in ("metrics.json", "model_final.pt")
               if os.path.isfile(os.path.join(out, n)) and written_by_a_run(os.path.join(out, n))]
    if results:
        raise SetupError(f"--resume: {out} holds an earlier run's results ({', '.join(results)}) but no checkpoint "
                         f"(no {POINTER}, no complete ckpt-* folder): there is nothing to continue, and a run "
                         f"from step 0 would replace them. Start over with --overwrite (which removes that run's "
                         f"own files), or choose another --out (nothing was changed)")


def _plan_leftovers(plan: OutPlan, pointer: Optional[dict]) -> None:
    """What a run stopped at the wrong moment (killed, a full disk) left in OUT besides the
    checkpoint ``pointer`` names (None: there is none): the checkpoint folders it no longer names
    (the previous one, when the run was killed between the switch of checkpoint.json and that
    folder's removal; a newer one whose save never completed) and the files under the run's
    temporary names (writes that never finished). Only what the run can prove its own
    (``own_entries``): a folder that also holds something else is left in place, and named. When
    checkpoint.json was missing (``plan.adopt``), another complete checkpoint stays too: nothing
    said it was superseded."""
    out = plan.cfg.out
    named = None if pointer is None else pointer["folder"]
    plan.files += [n for n in _listdir(out) if TEMPORARY.search(n) and RUN_FILE.fullmatch(n)
                   and not os.path.islink(os.path.join(out, n)) and os.path.isfile(os.path.join(out, n))]
    if named:
        folder = os.path.join(out, named)
        plan.files += [f"{named}/{n}" for n in _listdir(folder) if TEMPORARY.search(n) and CKPT_FILE.fullmatch(n)
                       and not os.path.islink(os.path.join(folder, n)) and os.path.isfile(os.path.join(folder, n))]
    for name in reversed(_checkpoint_folders(out)):
        if name == named:
            continue
        own, others = own_entries(os.path.join(out, name), [pointer])
        if others:
            plan.left.append(f"{name}/ (holds {', '.join(others)})")
        elif plan.adopt is not None and _complete(out, name) is not None:
            plan.left.append(f"{name}/ (a complete checkpoint: move it away to keep it, as the run keeps "
                             f"only its latest)")
        else:
            plan.folders.append((name, own))


OPTIMIZER_CLASSES = {"lamb": "Lamb", "onebitlamb": "OneBitLamb", "onebitadam": "OneBitAdam",
                     "zerooneadam": "ZeroOneAdam"}


def _check_rank_file(cfg: TrainConfig, path: str, rank: int, loaded: Any) -> None:
    """Rank ``rank``'s file must hold a state of the optimizer this run trains with, and that rank's
    own: what the workers' ``load_state_dict`` would refuse, refused before they start (with the
    manifest made to match, another run's rank files pass the sha256 check)."""
    from onebitlamb.optim.state_format import flat_of

    try:
        flat = flat_of(loaded["optimizer"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SetupError(f"{path} holds no optimizer state of this program ({type(exc).__name__}: {exc}); not "
                         f"resuming from it") from None
    if flat is None:
        return
    saved_by, expected = flat.get("optimizer"), OPTIMIZER_CLASSES[cfg.optimizer]
    if saved_by is not None and saved_by != expected:
        raise SetupError(f"{path} holds the state of {saved_by}, and this run trains with {expected} (--optimizer "
                         f"{cfg.optimizer}): it is another run's file; not resuming from it")
    # under --shard N, rank r holds shard r % N of replica r // N: its state names both
    shard = flat.get("shard")
    if shard is not None and shard[0] != rank % shard[1]:
        raise SetupError(f"{path} holds the optimizer state of shard {shard[0]}, not rank {rank}'s shard "
                         f"{rank % shard[1]} (files swapped?); not resuming from it")
    own = rank if shard is None else rank // shard[1]  # the rank within the optimizer's process group
    if ("worker_error" in flat or "server_error" in flat) and flat.get("rank", own) != own:
        raise SetupError(f"{path} holds rank {flat['rank']}'s optimizer state, not rank {rank}'s (files swapped?); "
                         f"not resuming from it")


def _rank_files(out: str, pointer: dict) -> List[int]:
    """The ranks whose files the checkpoint holds, by its manifest."""
    return sorted(int(m.group(1)) for m in map(RANK_FILE.fullmatch, pointer["sha256"]) if m)


def _check_settings(cfg: TrainConfig, saved: dict) -> None:
    changed = changed_settings(cfg, saved)
    if changed:
        raise SetupError(resume_refusal(changed, f"--resume with different settings than the checkpoint in "
                                                 f"{cfg.out}"))


def _manifest_problem(saved: Any) -> Optional[str]:
    """What makes ``saved`` (checkpoint.json's content, or a folder's manifest.json) no manifest a
    run wrote, in words naming the value; None when it is one."""
    if not isinstance(saved, dict):
        return f"it holds {type(saved).__name__}, not a manifest"
    digests = saved.get("sha256")
    if not isinstance(digests, dict) or not all(isinstance(d, str) for d in digests.values()):
        return "its sha256 manifest is missing or not a mapping of files to sha256"
    strange = sorted(f for f in digests if not SAVED_FILE.fullmatch(f))
    if strange:
        return f"its sha256 manifest lists {', '.join(map(repr, strange))}, which no checkpoint holds"
    step = saved.get("step")
    if type(step) is not int or step < 0:
        return f"its step is {step!r}, not a step"
    world = saved.get("world_size", len(_rank_files("", saved)) or 1)
    if type(world) is not int or world < 1:
        return f"its world_size is {world!r}, not a number of ranks"
    beyond = [r for r in _rank_files("", saved) if r >= world]
    if beyond:
        return (f"its world_size is {world!r}, and its manifest lists the files of ranks "
                f"{_rank_files('', saved)}")
    return None


def _folder_manifest(folder: str) -> Optional[dict]:
    """The folder's manifest.json when it is one a run wrote (a regular file), else None."""
    path = os.path.join(folder, MANIFEST)
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    saved = _json_of(path)
    return saved if _manifest_problem(saved) is None else None


def read_pointer(out: str) -> Optional[dict]:
    """checkpoint.json, or None when there is none. The folder it names must be a plain
    ``ckpt-<digits>`` folder inside ``out`` (no path, no link), and its manifest whole (the sha256
    of each file; a step and a world_size that are numbers, the world_size that of its rank files):
    anything else is refused, and nothing is then loaded from it or removed."""
    path = os.path.join(out, POINTER)
    try:
        with open(path) as f:
            pointer = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SetupError(f"{path} cannot be read ({exc}); the checkpoint it named cannot be found") from None
    folder = pointer.get("folder") if isinstance(pointer, dict) else None
    if not isinstance(folder, str) or not CKPT_FOLDER.fullmatch(folder):
        raise SetupError(f"{path} names the checkpoint folder {folder!r}: only a plain ckpt-<digits> folder inside "
                         f"{out} is accepted (no path, no '..'); nothing was loaded or removed")
    full = os.path.join(out, folder)
    if os.path.islink(full) or not os.path.isdir(full):
        raise SetupError(f"{path} names {folder!r}, which is not a folder inside {out} (missing, or a link); "
                         f"nothing was loaded or removed")
    problem = _manifest_problem(pointer)
    if problem is not None:
        raise SetupError(f"{path} is damaged: {problem}, so the files of {folder} cannot be checked; not resuming "
                         f"from them (nothing was removed)")
    return pointer


def _pointer_or_none(out: str) -> Optional[dict]:
    """checkpoint.json when there is one that can be trusted, else None (also when it names
    something that must not be touched)."""
    try:
        return read_pointer(out)
    except SetupError:
        return None


def _load_checkpoint_file(out: str, pointer: dict, name: str, map_location):
    """One file of the checkpoint ``pointer`` names: read once, checked against the manifest
    (required: ``read_pointer``), loaded as plain data."""
    path = os.path.join(out, pointer["folder"], name)
    manifest = pointer["sha256"]
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as exc:
        raise SetupError(f"{path} cannot be read ({exc.strerror or exc}): the checkpoint is incomplete") from None
    if name not in manifest:
        raise SetupError(f"{path} is not in the manifest of {os.path.join(out, POINTER)}: not loading it")
    if hashlib.sha256(blob).hexdigest() != manifest[name]:
        raise SetupError(f"{path} is damaged: its sha256 is not the one recorded when it was written "
                         f"({POINTER}); not resuming from it")
    try:
        return torch.load(io.BytesIO(blob), map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 (unpickling raises many types)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SetupError(f"{path} cannot be loaded as plain data with weights_only=True ({type(exc).__name__}: "
                         f"{first}); it was not written by this program as it is: not loading it") from None


def _check_plain(obj, where: str, at: str = "") -> None:
    """A checkpoint holds plain data only (what ``torch.load(weights_only=True)`` reads back):
    refuse anything else when saving, not when resuming."""
    if obj is None or type(obj) in (bool, int, float, str, torch.dtype, torch.device, torch.Size):
        return
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return
    if type(obj) in (dict, collections.OrderedDict):
        for k, v in obj.items():
            _check_plain(k, where, at)
            _check_plain(v, where, f"{at}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_plain(v, where, f"{at}[{i}]")
        return
    raise TypeError(f"{where}{at} is a {type(obj).__qualname__}: a checkpoint holds plain data only "
                    f"(tensors, numbers, strings, lists, dicts), loaded back with weights_only=True")


def _sha256(path: str) -> Optional[str]:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
