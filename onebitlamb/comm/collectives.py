"""The library's collectives: a plain averaging all-reduce and the error-compensated 1-bit
all-reduce of docs/algorithm.md, on any ``torch.distributed`` backend that has all-to-all and
all-gather (gloo on CPU, NCCL on GPU).

The 1-bit all-reduce, for ``n`` ranks each holding a buffer ``b_i`` of ``D`` elements (``D`` a
multiple of ``8n`` so that each rank's chunk packs into whole bytes)::

    worker  y_i = b_i + e_w            s_i = ||y_i|| / sqrt(D)     e_w = y_i - s_i sign(y_i)
    (all-to-all: chunk j of every rank's packed signs goes to rank j, with s_i)
    server  z_j = e_s + sum_i (s_i/n) sign(y_i)[chunk j]
            s'_j = ||z_j|| / sqrt(D/n)                             e_s = z_j - s'_j sign(z_j)
    (all-gather of the packed sign(z_j), with s'_j)
    result  chunk j = s'_j sign(z_j), the same on every rank

Error feedback: what a compression drops is kept in ``e_w`` / ``e_s`` and added to the next
call's input, so the sum of what was sent tracks the sum of what should have been sent and the
bias of the 1-bit code does not accumulate.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from onebitlamb.comm.stats import (GLOBAL_STATS, CommStats, all_gather_bytes, all_to_all_bytes,
                                   allreduce_bytes)
from onebitlamb.compression.onebit import ONEBIT, add_signs_, compress_, read_scales, scale_bytes
from onebitlamb.compression.packing import FLOAT_DTYPES, fused_codec, unpack_signs

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world_size_of(group: Optional[dist.ProcessGroup] = None) -> int:
    """1 when torch.distributed is not initialised, else the group's size."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank_of(group=None) -> int:
    """This rank's index in ``group`` (0 when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def world_timeout():
    """The timeout ``init_process_group`` was given (None where the backend does not say), for
    groups made later (``dist.new_group``), which would otherwise take the default of 30 minutes."""
    default = dist.distributed_c10d._get_default_group()
    try:  # the backend's options carry it
        return default._get_backend(torch.device("cpu") if dist.get_backend() == "gloo"
                                    else torch.device("cuda")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def duplicate_group(group: Optional[dist.ProcessGroup] = None) -> dist.ProcessGroup:
    """A second group over the same ranks as ``group`` (the world's when None), with the world
    group's timeout; collective, and ``group`` must span the world (``dist.new_group`` is called by
    every rank of the world).

    Why: collectives on one group must be issued in the same order on every rank. A thread that
    runs its own collectives (``overlap_with_backward``'s exchange) would race the caller's on a
    shared group; on a group of its own, each group's order is fixed by its one thread.
    """
    world = dist.get_world_size()
    if world_size_of(group) != world:
        raise ValueError(f"a process group of {world_size_of(group)} of the world's {world} ranks: a thread's "
                         f"own copy of it is made by every rank of the world, so it must span the world")
    return dist.new_group(list(range(world)), timeout=world_timeout())


def padded_size(numel: int, world_size: int) -> int:
    """``D``: the smallest multiple of ``8 * world_size`` that is ``>= numel``."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    unit = 8 * world_size
    return -(-numel // unit) * unit


def allreduce_mean_(buffer: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                    stats: Optional[CommStats] = None, async_op: bool = False):
    """Average ``buffer`` over the group in place with one all-reduce (a no-op on one rank).
    Returns ``buffer``; with ``async_op``, a future of it (DDP's comm hooks return one)."""
    n = world_size_of(group)
    if n == 1 or buffer.numel() == 0:
        if not async_op:
            return buffer
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done
    (stats or GLOBAL_STATS).record("all_reduce", allreduce_bytes(buffer.numel() * buffer.element_size(), n))
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if async_op:
        return work.get_future().then(lambda fut: fut.value()[0].div_(n))
    return buffer.div_(n)


class _Workspace:
    """Scratch tensors reused across calls, so a step allocates nothing buffer-sized.

    Each message is a row of ``D/(8n)`` sign bytes followed by the 4 bytes of its float32 scale:
    the all-to-all sends one such row to every rank, the server's all-gather one row per rank.
    """

    _cache: Dict[Tuple, Dict[str, Any]] = {}

    @classmethod
    def get(cls, numel: int, n: int, device: torch.device) -> Dict[str, Any]:
        # per thread too: an optimizer's exchange behind the backward runs on a thread of its own
        key = (numel, n, str(device), threading.get_ident())
        ws = cls._cache.get(key)
        if ws is None:
            row = ONEBIT.wire_bytes(numel // n)  # a chunk's sign bytes and its float32 scale
            u8 = dict(dtype=torch.uint8, device=device)
            ws = {
                "signs": torch.empty(numel // 8, **u8),
                "send": torch.empty(n, row, **u8),
                "recv": torch.empty(n, row, **u8),
                "server": torch.empty(row, **u8),
                "result": torch.empty(n, row, **u8),
            }
            if len(cls._cache) > 32:  # a handful of buffer layouts (buckets) per process is the norm
                cls._cache.clear()
            cls._cache[key] = ws
        return ws


def check_tensors(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
    """What any compressed all-reduce needs of its three tensors: 1-D, contiguous, one float dtype,
    one device (the sizes depend on the topology: each caller checks its own)."""
    for name, t in (("buffer", buffer), ("worker_error", worker_error), ("server_error", server_error)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    if worker_error.dtype != buffer.dtype or server_error.dtype != buffer.dtype:
        raise TypeError(f"buffer, worker_error and server_error must share one dtype, got "
                        f"{buffer.dtype}, {worker_error.dtype}, {server_error.dtype}")
    if worker_error.device != buffer.device or server_error.device != buffer.device:
        raise ValueError(f"buffer, worker_error and server_error must be on one device, got "
                         f"{buffer.device}, {worker_error.device}, {server_error.device}")


def _check(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, n: int) -> None:
    check_tensors(buffer, worker_error, server_error)
    D = buffer.numel()
    if D != padded_size(D, n):
        raise ValueError(f"buffer has {D} elements; with {n} ranks it must be a multiple of {8 * n} "
                         f"(pad it to padded_size({D}, {n}) = {padded_size(D, n)})")
    if worker_error.numel() != D:
        raise ValueError(f"worker_error has {worker_error.numel()} elements, buffer has {D}")
    if server_error.numel() != D // n:
        raise ValueError(f"server_error has {server_error.numel()} elements; with {n} ranks and a "
                         f"buffer of {D} it must have D/n = {D // n}")


def compressed_allreduce(
    buffer: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    stats: Optional[CommStats] = None,
    *,
    fused: Optional[bool] = None,
) -> torch.Tensor:
    """Error-compensated 1-bit average of ``buffer`` over the group, written into ``buffer``.

    Args:
        buffer: 1-D, ``D = padded_size(d, n)`` elements (fp32, fp16 or bf16); overwritten with the
            result, which is bit-identical on every rank.
        worker_error: this rank's worker error, ``D`` elements, same dtype; updated in place.
        server_error: this rank's server error for its chunk, ``D / n`` elements; updated in place.
        group: the process group (default: the world).
        stats: where the bytes sent are recorded (default: ``onebitlamb.comm.GLOBAL_STATS``).
        fused: the codec's kernels. None (default): the fused Triton kernels on CUDA tensors when
            Triton imports (``onebitlamb[gpu]``), else torch ops (CPU: compiled loops or numpy);
            True: the Triton kernels (ValueError where they cannot run); False: never. The packed
            signs and the expansion are the same bits either way; the scales differ by rounding
            only (``compression.triton_codec`` states the bound). The result is bit-identical on
            every rank whatever each rank chose, since every rank expands the same messages.

    Issues two collectives: one ``all_to_all_single`` that gives rank ``j`` chunk ``j`` of every
    rank's packed signs, each message carrying its sender's scale in 4 trailing bytes, then one
    ``all_gather`` of the server's ``D/(8n)`` sign bytes with its scale. The paper sends the
    scales in two all-gathers of their own; carrying them in the sign messages sends the same
    bytes and the same numbers in half the collectives, which is what a fast network (where a
    collective's fixed latency rivals its transfer) pays for. With one rank (or no initialised
    process group) no collective is called and the buffer is returned as is: there is nothing to
    average and no reason to lose precision. All ranks must pass the same ``D``.

    Raises ``FloatingPointError`` on every rank alike when any rank's buffer holds a NaN or an
    infinity (its scale is then not finite), instead of averaging garbage into the model.

    The hierarchical collective over ``node_groups()`` is ``hierarchy.compressed_allreduce``;
    ``onebitlamb.comm.compressed_allreduce`` takes either kind of group.
    """
    n = world_size_of(group)
    _check(buffer, worker_error, server_error, n)
    codec = fused_codec(buffer, fused)
    D = buffer.numel()
    if n == 1 or D == 0:
        return buffer
    stats = stats or GLOBAL_STATS
    ws = _Workspace.get(D, n, buffer.device)
    chunk = D // n
    row_signs = chunk // 8  # sign bytes per message; its scale follows them
    send, recv, server, result = ws["send"], ws["recv"], ws["server"], ws["result"]

    # Worker: compress the error-compensated buffer; chunk j of the packed signs goes to rank j.
    fused = codec is not None
    scale = compress_(worker_error, buffer, ws["signs"], ws, fused=fused)
    send[:, :row_signs].copy_(ws["signs"].view(n, row_signs))
    send[:, row_signs:].copy_(scale_bytes(scale, buffer.device))
    dist.all_to_all_single(recv, send, group=group)
    stats.record("all_to_all", all_to_all_bytes(send.numel(), n))
    worker_scales = read_scales(recv, row_signs)
    if not bool(torch.isfinite(worker_scales).all()):
        bad = torch.nonzero(~torch.isfinite(worker_scales)).flatten().tolist()
        raise FloatingPointError(f"compressed_allreduce: the buffer of rank(s) {bad} gave a non-finite "
                                 f"scale (scales {worker_scales.tolist()}): it holds NaN or infinite "
                                 f"values, or magnitudes above ~1e19 whose squares overflow float32")

    # Server: average this rank's chunk of everyone's signs, add the server error, compress again.
    server_sum_sq = add_signs_(server_error, recv[:, :row_signs], worker_scales / n, fused)
    server_scale = compress_(server_error, None, server[:row_signs], ws, server_sum_sq, fused)
    server[row_signs:].copy_(scale_bytes(server_scale, buffer.device))
    _all_gather_single(result.view(-1), server, group=group)
    stats.record("all_gather", all_gather_bytes(server.numel(), n))

    server_scales = read_scales(result, row_signs)
    if codec is not None:  # every chunk in one launch
        codec.expand_(result, server_scales, buffer, chunk)
        return buffer
    host_server_scales = server_scales.tolist() if buffer.device.type == "cpu" else server_scales
    for j in range(n):
        unpack_signs(result[j, :row_signs], chunk, host_server_scales[j],
                     out=buffer[j * chunk:(j + 1) * chunk])
    return buffer

