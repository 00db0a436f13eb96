"""Every rank's optimizer state in a framework's checkpoint folder.

The Trainer, accelerate and Lightning save rank 0's ``optimizer.state_dict()`` and load it on
every rank: right for optimizers whose state is the same everywhere, wrong for a 1-bit one, whose
compression errors are per rank (a rank resumed with another's errors drifts off the run it
continues). So each framework entry also has every rank write its own state beside the
framework's files, one file per rank, and read its own back after the framework's load.

A folder written by ``n`` ranks and read by ``m != n`` is re-sharded with
``reshard_state_dicts`` (every rank reads all ``n`` files: the folder must be shared, as the
frameworks' own checkpoints already require).

Each file carries the step it was saved at (``_MARK``: steps taken plus steps skipped, the same on
every rank) and its set (rank and world size). A folder may hold sets of several world sizes
(a run resumed elastically into the folder it came from): the newest complete set wins, on
every rank alike, and a set whose files were saved at different steps is refused, naming them.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Callable, Dict, Iterator, List, Optional

import torch

from onebitlamb.comm import rank_of, world_size_of
from onebitlamb.optim import StagedOptimizer, reshard_state_dicts

_NAME = "onebitlamb-optimizer-rank{rank}-of-{world}.pt"
_PATTERN = re.compile(r"onebitlamb-optimizer-rank(\d+)-of-(\d+)\.pt")
# the key of the state dict a rank file adds, and read_rank_state removes: where the file belongs
_MARK = "onebitlamb_rank_file"


def _rank_and_world(optimizer: StagedOptimizer) -> tuple[int, int]:
    return rank_of(optimizer.process_group), world_size_of(optimizer.process_group)


def rank_state_file(folder: str, rank: int, world: int) -> str:
    return os.path.join(folder, _NAME.format(rank=rank, world=world))


def save_rank_state(optimizer: StagedOptimizer, folder: str) -> str:
    """Write this rank's ``optimizer.state_dict()`` into ``folder`` (every rank calls it); the
    file appears whole or not at all. Returns its path."""
    rank, world = _rank_and_world(optimizer)
    os.makedirs(folder, exist_ok=True)
    path = rank_state_file(folder, rank, world)
    partial = path + ".partial"
    torch.save({**optimizer.state_dict(), _MARK: {"steps": _steps_of(optimizer), "rank": rank, "world": world}},
               partial)
    os.replace(partial, path)
    return path


def saved_worlds(folder: str) -> Dict[int, List[int]]:
    """World size -> the ranks whose files ``folder`` holds."""
    found: Dict[int, List[int]] = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        match = _PATTERN.fullmatch(name)
        if match:
            found.setdefault(int(match.group(2)), []).append(int(match.group(1)))
    return {w: sorted(r) for w, r in found.items()}


def load_rank_state(optimizer: StagedOptimizer, folder: str, map_location: Optional[str] = None) -> None:
    """Load this rank's state from ``folder`` into ``optimizer`` (every rank calls it, after the
    framework loaded its own files, so this rank's errors are what stays). Of several complete
    sets the newest wins (the step each file carries); files of another world size are re-sharded
    for this one; a set whose files were saved at different steps raises ``ValueError``. A folder without a complete set raises ``FileNotFoundError``
    naming it: resuming from rank 0's state alone would not continue the run."""
    optimizer.load_state_dict(read_rank_state(optimizer, folder, map_location))


@contextlib.contextmanager
def own_state_instead_of_rank_0s(optimizer: StagedOptimizer, folder: Callable[[], Optional[str]]) -> Iterator[None]:
    """While a framework loads rank 0's optimizer state on every rank, each rank's
    ``load_state_dict`` loads its own state from ``folder()`` instead (a load pre-hook):
    ``load_state_dict`` refuses another rank's compression errors."""
    def own(opt: StagedOptimizer, state_dict: dict) -> Optional[dict]:
        where = folder()
        return None if where is None else read_rank_state(opt, where)

    handle = optimizer.register_load_state_dict_pre_hook(own)
    try:
        yield
    finally:
        handle.remove()


def read_rank_state(optimizer: StagedOptimizer, folder: str, map_location: Optional[str] = None) -> dict:
    """This rank's state dict from ``folder`` (``load_rank_state``)."""
    rank, world = _rank_and_world(optimizer)
    worlds = saved_worlds(folder)
    complete = [w for w, ranks in worlds.items() if ranks == list(range(w))]
    if not complete:
        raise FileNotFoundError(f"{folder} holds no complete set of onebitlamb optimizer states (one "
                                f"{_NAME.format(rank='<r>', world='<n>')} per rank; found {worlds or 'none'}): "
                                f"it was not saved through a onebitlamb integration, or some rank's file is "
                                f"missing")
    steps = {w: _steps_of_set(folder, w) for w in complete}
    newest = max(steps.values(), key=lambda s: -1 if s is None else s)
    candidates = [w for w in complete if steps[w] == newest]
    saved = world if world in candidates else max(candidates)
    device = map_location or _device_of(optimizer)

    def read(r: int) -> dict:
        state = torch.load(rank_state_file(folder, r, saved), map_location=device, weights_only=True)
        state.pop(_MARK, None)
        return state

    return read(rank) if saved == world else reshard_state_dicts([read(r) for r in range(saved)], world)[rank]


def _steps_of(optimizer: StagedOptimizer) -> int:
    """The optimizer's step() calls so far (taken and skipped alike): the same on every rank."""
    flat = optimizer.state.get("flat", {})
    return int(flat.get("step", 0)) + int(flat.get("skipped_steps", 0))


def _steps_of_set(folder: str, world: int) -> Optional[int]:
    """The step every file of the ``world``-rank set was saved at (None: files of a version that
    did not mark them); files saved at different steps are refused, naming each."""
    found = {}
    for r in range(world):
        path = rank_state_file(folder, r, world)
        # mmap: only the small mark is read from each file, not its tensors
        mark = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get(_MARK)
        found[r] = None if mark is None else mark["steps"]
    if len(set(found.values())) > 1:
        raise ValueError(f"{folder} holds a set of {world} onebitlamb optimizer states saved at different steps "
                         f"(rank: steps {found}): the files come from different saves, and the ranks would resume "
                         f"different points of the run. Resume from a folder that one save wrote whole")
    return found[0]


def _device_of(optimizer: StagedOptimizer) -> str:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return str(p.device)
    return "cpu"
