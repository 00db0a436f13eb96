"""The checkpoint store and OUT's files: OUT/ckpt-<step>/{model.pt, trainer.pt, rank<r>.pt},
OUT/checkpoint.json naming the last.

Every file is written to a temporary name, flushed and renamed; checkpoint.json is switched to a
new folder only after every rank has written its file and rank 0 has checked each file on disk
against the sha256 its writer computed, and the previous folder is removed only after that switch:
a crash at any point leaves the previous complete checkpoint in place. checkpoint.json holds those
sha256 (the manifest), checked again on --resume. Every file is plain data (tensors, numbers,
strings, lists, dicts), loaded with ``weights_only=True``: a planted pickle runs no code.
(Multi-node runs need OUT on a shared file system.)
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
from typing import Any, List, Optional, Tuple

import torch

import onebitlamb
from onebitlamb.train import files, runlog
from onebitlamb.train.config import RunError, SetupError, TrainConfig, changed_settings
from onebitlamb.train.data import atomic_save
from onebitlamb.train.ranks import check_ranks_agree, first_problem, gather_digests
from onebitlamb.train.sharding import load_model, saved_model

POINTER = "checkpoint.json"
CKPT_FOLDER = re.compile(r"ckpt-[0-9]{7,}")
# what a run writes into OUT (with the temporary names it writes them under first) and into a
# checkpoint folder: --overwrite removes these and nothing else
RUN_FILE = re.compile(r"(checkpoint|metrics|config)\.json(\.tmp)?|(freeze|curves)\.png|log\.csv"
                      r"|model_final\.pt(\.tmp\.[0-9]+)?")
CKPT_FILE = re.compile(r"(model|trainer|rank[0-9]+)\.pt(\.tmp\.[0-9]+)?")
EVENTS_FILE = re.compile(r"events\.out\.tfevents\..+")  # in OUT/tensorboard (runlog.py)
RANK_FILE = re.compile(r"rank([0-9]+)\.pt")
TEMPORARY = re.compile(r"\.tmp(\.[0-9]+)?$")  # a file of the run's being written (files.write_json, atomic_save)


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
    or ``log.csv`` has it too). A temporary name of the run's (``.tmp``, ``.tmp.<pid>``) is its own."""
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


def prepare_out_dir(cfg: TrainConfig, remove: bool = True) -> None:
    """A new run (no --resume): refuse an earlier run in OUT, or with --overwrite remove its files;
    refuse a file of someone else's at a name the run writes (check_run_names)."""
    check_run_names(cfg.out)
    refuse_existing_run(cfg)
    if remove:
        os.makedirs(cfg.out, exist_ok=True)
        if cfg.overwrite:
            removed, left = remove_run_files(cfg.out, keep=(cfg.cache_dir,))
            if removed:
                note = f"; left in place (not written by a run): {', '.join(left)}" if left else ""
                print(f"[{cfg.optimizer}] --overwrite: removed the earlier run's {', '.join(removed)}{note}",
                      file=sys.stderr, flush=True)


def remove_run_files(out: str, keep=()) -> Tuple[List[str], List[str]]:
    """Remove the files a run writes into ``out``: its pointer, results, and every checkpoint folder
    (and its TensorBoard folder) that holds nothing else. Returns (removed, left in place); links
    are never followed."""
    keep = {os.path.abspath(k) for k in keep if k}
    removed, left = [], []
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if os.path.abspath(path) in keep or name == files.LOCK_FILE:  # held by this run (files.RunLock)
            continue
        if os.path.islink(path):
            left.append(name)
        elif os.path.isfile(path) and RUN_FILE.fullmatch(name) and written_by_a_run(path):
            os.remove(path)
            removed.append(name)
        elif os.path.isdir(path) and (CKPT_FOLDER.fullmatch(name) or name == runlog.TENSORBOARD_DIR):
            others = _remove_checkpoint_folder(path, CKPT_FILE if CKPT_FOLDER.fullmatch(name) else EVENTS_FILE)
            if others:
                left.append(f"{name}/ (also holds {', '.join(others)})")
            else:
                removed.append(name + "/")
        else:
            left.append(name + ("/" if os.path.isdir(path) else ""))
    return removed, left


def _remove_checkpoint_folder(folder: str, files: re.Pattern = CKPT_FILE) -> List[str]:
    """Remove a checkpoint folder (or another folder of a run's ``files``) if it holds only the
    files a run writes there; otherwise remove nothing and return the other entries."""
    names = os.listdir(folder)
    others = sorted(n for n in names
                    if not files.fullmatch(n) or os.path.islink(os.path.join(folder, n))
                    or not os.path.isfile(os.path.join(folder, n)))
    if others:
        return others
    for name in names:
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    return []


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
        # next ckpt-<step> folder or at checkpoint.json.tmp) stops the run on every rank with rank
        # 0's sentence; checkpoint.json still names the previous checkpoint, which is kept.
        problem = None
        if rank == 0:
            try:
                files.make_folder(folder)
            except files.OutError as exc:
                problem = str(exc)
        problem = first_problem(problem, world)
        if problem is None:
            own = {"optimizer": state.optimizer.state_dict(), "comm_stats": state.optimizer.comm_stats.state_dict(),
                   "rng": _rng_state()}
            if own_model:
                own["model"] = saved_model(state.model, whole=False)
            _check_plain(own, f"rank{rank}.pt")
            digest = "00" * 32
            try:
                digest = atomic_save(own, os.path.join(folder, f"rank{rank}.pt"))
                if rank == 0:
                    trainer = {"step": step, "scheduler": state.scheduler.state_dict(), "history": state.history,
                               "config": dataclasses.asdict(cfg)}
                    _check_plain(trainer, "trainer.pt")
                    written = {"model.pt": atomic_save(whole_model, os.path.join(folder, "model.pt")),
                               "trainer.pt": atomic_save(trainer, os.path.join(folder, "trainer.pt"))}
            except files.OutError as exc:  # a link planted there; a full disk (files.WriteError)
                problem = f"rank {rank}: {exc}" if isinstance(exc, files.WriteError) else str(exc)
            digests = gather_digests(digest, rank, world, device)  # every rank has written its file
            if rank == 0 and problem is None:
                written.update({f"rank{r}.pt": d for r, d in enumerate(digests)})
                # what is on disk is what each rank wrote: only then does checkpoint.json move to it
                bad = next((f for f, d in written.items() if _sha256(os.path.join(folder, f)) != d), None)
                if bad is not None:
                    problem = f"{os.path.join(folder, bad)} differs on disk from what was written"
                else:
                    problem = self._switch_to(name, step, written)
            problem = first_problem(problem, world)
        if problem is not None:
            raise RunError(f"checkpoint of step {step}: {problem}. {POINTER} still names the previous checkpoint, "
                           f"which is kept: continue with --resume once that is fixed")

    def _switch_to(self, name: str, step: int, written: dict) -> Optional[str]:
        """Rank 0: point checkpoint.json at the new folder, then remove the previous one. Returns
        what went wrong (the pointer unchanged), or None."""
        cfg = self.cfg
        previous = _previous_folder(cfg.out)
        try:
            files.write_json(os.path.join(cfg.out, POINTER),
                             {"folder": name, "step": step, "world_size": self.world, "sha256": written})
        except files.OutError as exc:
            return f"rank 0: {exc}" if isinstance(exc, files.WriteError) else str(exc)
        if previous and previous != name:  # keep only the latest, removed after the switch
            others = _remove_checkpoint_folder(os.path.join(cfg.out, previous))
            if others:
                print(f"[{cfg.optimizer}] {previous} left in place: it also holds {', '.join(others)}",
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
        return trainer["step"]


def check_resumable(cfg: TrainConfig, remove: bool = True) -> None:
    """Before any worker starts, refuse a checkpoint that cannot be resumed: checkpoint.json naming
    anything but a ``ckpt-<digits>`` folder inside OUT, without its manifest, a file missing,
    damaged (its sha256 is not the manifest's) or not plain data, or settings that change the
    numbers (changed_settings). A checkpoint of another number of ranks resumes, re-sharded
    (CheckpointStore.load). Then, with ``remove`` (one process: the launcher, or rank 0), what an
    interrupted run left behind goes (``remove_leftovers``)."""
    check_run_names(cfg.out)
    pointer = read_pointer(cfg.out)
    if pointer is None:
        if remove:
            remove_leftovers(cfg, None)
        return
    folder = os.path.join(cfg.out, pointer["folder"])
    ranks = _rank_files(cfg.out, pointer)
    if not ranks or ranks != list(range(pointer.get("world_size", len(ranks)))):
        raise SetupError(f"the checkpoint {folder} of {pointer.get('world_size', '?')} ranks holds the files of "
                         f"ranks {ranks}: some rank's file is missing")
    for name in ("trainer.pt", "model.pt", *(f"rank{r}.pt" for r in ranks)):
        loaded = _load_checkpoint_file(cfg.out, pointer, name, "cpu")
        if name == "trainer.pt":
            _check_settings(cfg, loaded["config"])
        elif RANK_FILE.fullmatch(name):
            _check_rank_file(cfg, os.path.join(folder, name), int(RANK_FILE.fullmatch(name).group(1)), loaded)
    if remove:
        remove_leftovers(cfg, pointer)


def remove_leftovers(cfg: TrainConfig, pointer: Optional[dict]) -> None:
    """What a run stopped at the wrong moment (killed, a full disk) left in OUT besides the
    checkpoint ``pointer`` names (None: there is none): the checkpoint folders it no longer names
    (the previous one, when the run was killed between the switch of checkpoint.json and that
    folder's removal; a newer one whose save never completed) and the temporary files of writes
    that never finished (``*.tmp``, ``*.pt.tmp.<pid>``). Only the run's own: a folder that also
    holds something else is left in place, and named."""
    out = cfg.out
    named = None if pointer is None else pointer["folder"]
    removed, left = [], []
    for folder, names in ((out, RUN_FILE), *(((os.path.join(out, named), CKPT_FILE),) if named else ())):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if TEMPORARY.search(name) and names.fullmatch(name) and os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)
                removed.append(os.path.relpath(path, out))
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name == named or not CKPT_FOLDER.fullmatch(name) or os.path.islink(path) \
                or not os.path.isdir(path):
            continue
        others = _remove_checkpoint_folder(path)
        if others:
            left.append(f"{name}/ (also holds {', '.join(others)})")
        else:
            removed.append(name + "/")
    if removed or left:
        print(f"[{cfg.optimizer}] --resume: removed what an interrupted run left: {', '.join(removed) or 'nothing'}"
              + (f"; left in place (not only the run's files): {', '.join(left)}" if left else ""),
              file=sys.stderr, flush=True)


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
        raise SetupError(f"--resume with different settings than the checkpoint in {cfg.out} (saved, now): {changed}")


def read_pointer(out: str) -> Optional[dict]:
    """checkpoint.json, or None when there is none. The folder it names must be a plain
    ``ckpt-<digits>`` folder inside ``out`` (no path, no link): anything else is refused, and
    nothing is then loaded from it or removed."""
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
    if not isinstance(pointer.get("sha256"), dict):
        raise SetupError(f"{path} is damaged: its sha256 manifest is missing or not a mapping of files to sha256, so "
                         f"the files of {folder} cannot be checked; not resuming from them (nothing was removed)")
    return pointer


def _previous_folder(out: str) -> Optional[str]:
    """The folder the current checkpoint.json names, or None (also when it names something that
    must not be touched)."""
    try:
        pointer = read_pointer(out)
    except SetupError:
        return None
    return None if pointer is None else pointer["folder"]


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
