"""Where the ranks of one run train, and the few small collectives by which they agree: to stop
at the same step, that a loss is finite everywhere, that their parameters are equal before a
checkpoint, that OUT is shared. All outside the optimizer's byte counts.
"""
from __future__ import annotations

import os
import time
import zlib
from typing import List, Optional

import torch
import torch.distributed as dist

from onebitlamb.train import files
from onebitlamb.train.config import RunError, SetupError


def under_torchrun() -> bool:
    """Whether torchrun started this process (it sets these), so that it is one rank of many."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def gpus_shared() -> bool:
    """Under torchrun with CUDA: whether this node's ranks outnumber its GPUs, so that several
    share one (round robin by local rank). NCCL refuses that; gloo takes CUDA tensors."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return under_torchrun() and torch.cuda.is_available() and local_world > torch.cuda.device_count()


def rank_device() -> torch.device:
    """Where this rank trains: its GPU under torchrun with CUDA (NCCL, or gloo when ranks share
    GPUs), else the CPU (local workers always: they are joined by gloo on loopback)."""
    if dist.get_backend() == "nccl" or (dist.get_backend() == "gloo" and gpus_shared()):
        return torch.device(f"cuda:{torch.cuda.current_device()}")
    return torch.device("cpu")


def check_shared_out(out: str, rank: int, world: int) -> None:
    """Under torchrun, at the start: every rank must write OUT and see what rank 0 writes there
    (checkpoints are written by all ranks into one folder; several machines need a shared file
    system). Without it a multi-node run crashed at its first checkpoint."""
    if world == 1:
        return
    name = [f".shared-check-{os.getpid()}-{time.time_ns()}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    mine = os.path.join(out, f"{name[0]}.rank{rank}")
    problem = None
    try:
        files.write_text(mine, str(rank))
    except (OSError, files.OutError) as exc:
        problem = f"cannot write {out} ({getattr(exc, 'strerror', None) or exc})"
    dist.barrier()
    if problem is None and not os.path.exists(os.path.join(out, f"{name[0]}.rank0")):
        problem = f"does not see the files rank 0 writes into {out}"
    problems: List[Optional[str]] = [None] * world
    dist.all_gather_object(problems, problem)
    if os.path.exists(mine):
        os.remove(mine)
    dist.barrier()  # every probe is gone before any rank goes on
    bad = [f"rank {r} {p}" for r, p in enumerate(problems) if p]
    if bad:
        raise SetupError(f"{'; '.join(bad)}: --out must be a folder every rank can write and see alike (on "
                         f"several machines, a shared file system), or the first checkpoint would fail")


def agree_any(flags: List[bool], device) -> List[bool]:
    """Each flag set on any rank, the same answer on every rank (one small all-reduce). Every rank
    must stop at the same step: a rank left alone would wait in a collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(flags)
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def first_problem(problem: Optional[str], world: int) -> Optional[str]:
    """The first rank's ``problem`` that is not None (with that rank named when it is not rank 0),
    the same on every rank (one small all-gather): every rank stops alike, with the sentence."""
    if world == 1 or not dist.is_initialized():
        return problem
    problems: List[Optional[str]] = [None] * world
    dist.all_gather_object(problems, problem)
    return next((p if r == 0 or p.startswith(f"rank {r}: ") else f"rank {r}: {p}"
                 for r, p in enumerate(problems) if p is not None), None)


def ranks_flagged(flag: bool, rank: int, world: int, device) -> List[int]:
    """The ranks whose ``flag`` is set, the same list on every rank (one small all-reduce)."""
    if world == 1 or not dist.is_initialized():
        return [rank] if flag else []
    t = torch.zeros(world, dtype=torch.int32, device=device)
    t[rank] = 1 if flag else 0
    dist.all_reduce(t)
    return [r for r, v in enumerate(t.tolist()) if v]


def gather_bytes(nbytes: int, world: int, device) -> List[int]:
    """Every rank's byte count, on every rank."""
    if world == 1:
        return [nbytes]
    t = torch.zeros(world, dtype=torch.int64, device=device)
    t[dist.get_rank()] = nbytes
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def gather_digests(digest: str, rank: int, world: int, device) -> List[str]:
    """Every rank's sha256 (hex), on every rank."""
    if world == 1 or not dist.is_initialized():
        return [digest]
    t = torch.zeros(world, 32, dtype=torch.int32, device=device)
    t[rank] = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.int32)
    dist.all_reduce(t)
    return [bytes(row).hex() for row in t.cpu().tolist()]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def check_ranks_agree(model: torch.nn.Module, rank: int, world: int, step: int, device) -> None:
    """Only rank 0's parameters are saved: before each checkpoint the ranks compare a CRC-32 of
    theirs (one all-gather of one integer each), so a rank that drifted apart is named, not lost."""
    if world == 1 or not dist.is_initialized():
        return
    from onebitlamb.optim.checks import parameter_checksum

    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(parameter_checksum(p).to_bytes(4, "little"), crc)
    mine = torch.tensor([crc], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    differ = [r for r, row in enumerate(rows) if int(row) != int(rows[0])]
    if differ:
        raise RunError(f"rank {rank}: after step {step} the parameters of rank(s) {differ} differ from rank 0's; "
                           f"the optimizers keep every rank bit-identical, so something outside them changed a "
                           f"rank's model. Not saving; the last checkpoint is kept")
