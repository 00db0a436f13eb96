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

import math
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from onebitlamb.comm.stats import (GLOBAL_STATS, CommStats, all_gather_bytes, all_to_all_bytes,
                                   allreduce_bytes)
from onebitlamb.compression import native
from onebitlamb.compression.packing import (FLOAT_DTYPES, fused_codec, negative_bits, pack_signs, sign_table,
                                             signed_scales, unpack_signs)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Elements per slice of the numpy compressor: small enough that the passes over one slice stay
# in a core's L2 cache, large enough that Python's per-slice overhead is a few percent.
_CPU_SLICE = 131072
_SIGN_BIT = np.uint32(0x80000000)
_SCALE_BYTES = 4  # a float32 scale rides at the end of each sign message


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
                    stats: Optional[CommStats] = None) -> torch.Tensor:
    """Average ``buffer`` over the group in place with one all-reduce (a no-op on one rank)."""
    n = world_size_of(group)
    if n == 1 or buffer.numel() == 0:
        return buffer
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    buffer.div_(n)
    (stats or GLOBAL_STATS).record("all_reduce", allreduce_bytes(buffer.numel() * buffer.element_size(), n))
    return buffer


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
            row = numel // (8 * n) + _SCALE_BYTES
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


def _compress_cpu_(error: torch.Tensor, addend: Optional[torch.Tensor], packed: torch.Tensor,
                   sum_sq: Optional[float] = None) -> float:
    """``error += addend``; pack sign(error) into ``packed``; ``error -= s * sign(error)``; return s.

    float32 on CPU. ``sum_sq``: the sum of squares of ``error`` when the caller already has it
    (then ``addend`` must be None). With the compiled loops (``compression.native``): two fused
    passes. Without: numpy, sliced so each slice's passes run from cache, the sum of squares
    accumulated in float64 across slices. Either way the error update takes its sign from the same
    comparison that is packed, so the error matches what was sent exactly, -0.0 included.
    """
    y_all = error.numpy()
    b_all = addend.numpy() if addend is not None else None
    out = packed.numpy()
    numel = y_all.size
    lib = native.load() if numel % 8 == 0 else None  # the compiled loops work a byte at a time
    if sum_sq is None:
        sum_sq = native.add_sumsq(lib, y_all, b_all) if lib is not None else _add_sumsq_numpy(y_all, b_all)
    scale = np.float32(math.sqrt(sum_sq / numel))
    if lib is not None:
        native.sign_pack_update(lib, y_all, out, float(scale))
        return float(scale)
    scale_bits = np.array([scale], dtype=np.float32).view(np.uint32)[0]
    mask = np.empty(min(_CPU_SLICE, numel), dtype=bool)
    signed_scale = np.empty(min(_CPU_SLICE, numel), dtype=np.uint32)
    for i in range(0, numel, _CPU_SLICE):
        y = y_all[i:i + _CPU_SLICE]
        m = np.less(y, 0, out=mask[: y.size])
        out[i // 8:(i + y.size) // 8] = np.packbits(m)
        q = signed_scale[: y.size]
        np.multiply(m.view(np.uint8), _SIGN_BIT, out=q)   # sign bit where negative
        np.bitwise_or(q, scale_bits, out=q)               # ... on top of +scale: q = ±scale
        np.subtract(y, q.view(np.float32), out=y)
    return float(scale)


def _add_sumsq_numpy(y_all: np.ndarray, b_all: Optional[np.ndarray]) -> float:
    """``y += b`` (if given) a slice at a time; the sum of squares, accumulated in float64."""
    sum_sq = 0.0
    for i in range(0, y_all.size, _CPU_SLICE):
        y = y_all[i:i + _CPU_SLICE]
        if b_all is not None:
            np.add(b_all[i:i + _CPU_SLICE], y, out=y)
        sum_sq += float(np.dot(y, y))
    return sum_sq


def _compress_torch_(error: torch.Tensor, addend: Optional[torch.Tensor], packed: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """The same as ``_compress_cpu_`` in plain torch ops (CUDA, or dtypes numpy lacks); returns a
    0-d float32 tensor on the device, so no host synchronisation is forced."""
    if addend is not None:
        error.add_(addend)
    numel = error.numel()
    scale = torch.linalg.vector_norm(error, dtype=torch.float32) / math.sqrt(numel)
    # the error update reads the comparison the packing wrote into ``mask``: the torch packing's,
    # never the fused kernel's, which writes no mask
    pack_signs(error, out=packed, workspace=mask, fused=False)
    negative = mask[:numel]
    s = scale.to(error.dtype)
    error.sub_(torch.where(negative, -s, s))
    return scale


def _compress_(error, addend, packed, workspace, sum_sq=None, fused: Optional[bool] = None):
    """Compress ``error (+ addend)`` into ``packed``; the scale as a 1-element float32 tensor.
    ``sum_sq``: what ``_add_signs_`` returned with the same ``fused``, when not None."""
    codec = fused_codec(error, fused)
    if codec is not None:
        return codec.compress_(error, addend, packed, sum_sq)
    if error.device.type == "cpu" and error.dtype == torch.float32:
        return torch.tensor([_compress_cpu_(error, addend, packed, sum_sq)], dtype=torch.float32)
    mask = workspace.get("mask")
    if mask is None or mask.numel() < error.numel():  # only the torch path needs this scratch
        mask = workspace["mask"] = torch.empty(error.numel(), dtype=torch.bool, device=error.device)
    return _compress_torch_(error, addend, packed, mask).reshape(1)


def _add_signs_(target: torch.Tensor, packed_rows: torch.Tensor, scales: torch.Tensor,
                fused: Optional[bool] = None):
    """``target += sum_i scales[i] * signs(packed_rows[i])``: the server's sum over ranks. Returns
    the sum of squares of the new target where it comes for free (the compiled loop computes it
    while the values are in registers: a float; the Triton kernel: its partial sums, a tensor),
    else None; ``_compress_`` takes it as ``sum_sq``."""
    codec = fused_codec(target, fused)
    if codec is not None:
        return codec.add_signs_(target, packed_rows, scales)
    if target.device.type != "cpu":
        _add_signs_bits_(target, packed_rows, scales)
        return None
    lib = native.load() if target.dtype == torch.float32 else None
    if lib is not None:
        return native.add_signs_sumsq(lib, target.numpy(), packed_rows.numpy(), scales.numpy())
    _add_signs_table_(target, packed_rows, scales)
    return None


def _add_signs_table_(target: torch.Tensor, packed_rows: torch.Tensor, scales: torch.Tensor) -> None:
    """The CPU path: one ``embedding_bag`` does it 8 elements at a time. For each byte position the
    bag holds every rank's byte (offset into that rank's 256-row table of ``scale_i * ±1``) and
    sums their rows, so the n expansions are gathered and added in one fused pass instead of n
    decodes each written out and read back; a cache-sized slice at a time."""
    n, nbytes = packed_rows.shape
    device = target.device
    table = torch.cat([sign_table(s, target.dtype, device) for s in scales.tolist()])
    offsets = (torch.arange(n, device=device) * 256).view(1, n)
    step = _CPU_SLICE // 8
    index = torch.empty(min(step, nbytes), n, dtype=torch.long, device=device)
    rows = target.view(-1, 8)
    for start in range(0, nbytes, step):
        stop = min(start + step, nbytes)
        idx = index[: stop - start]
        idx.copy_(packed_rows[:, start:stop].t())
        idx.add_(offsets)
        rows[start:stop].add_(torch.nn.functional.embedding_bag(idx, table, mode="sum"))


def _add_signs_bits_(target: torch.Tensor, packed_rows: torch.Tensor, scales: torch.Tensor) -> None:
    """The device path: per rank, test each bit and add ``±scale_i`` (elementwise kernels, which a
    GPU runs far faster than the gather of table rows)."""
    rows = target.view(-1, 8)
    for i in range(packed_rows.shape[0]):
        negative, positive = signed_scales(scales[i], target.dtype, target.device)
        rows.add_(torch.where(negative_bits(packed_rows[i]), negative, positive))


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
    scale = _compress_(worker_error, buffer, ws["signs"], ws, fused=fused)
    send[:, :row_signs].copy_(ws["signs"].view(n, row_signs))
    send[:, row_signs:].copy_(_scale_bytes(scale, buffer.device))
    dist.all_to_all_single(recv, send, group=group)
    stats.record("all_to_all", all_to_all_bytes(send.numel(), n))
    worker_scales = _read_scales(recv, row_signs)
    if not bool(torch.isfinite(worker_scales).all()):
        bad = torch.nonzero(~torch.isfinite(worker_scales)).flatten().tolist()
        raise FloatingPointError(f"compressed_allreduce: the buffer of rank(s) {bad} gave a non-finite "
                                 f"scale (scales {worker_scales.tolist()}): it holds NaN or infinite "
                                 f"values, or magnitudes above ~1e19 whose squares overflow float32")

    # Server: average this rank's chunk of everyone's signs, add the server error, compress again.
    server_sum_sq = _add_signs_(server_error, recv[:, :row_signs], worker_scales / n, fused)
    server_scale = _compress_(server_error, None, server[:row_signs], ws, server_sum_sq, fused)
    server[row_signs:].copy_(_scale_bytes(server_scale, buffer.device))
    _all_gather_single(result.view(-1), server, group=group)
    stats.record("all_gather", all_gather_bytes(server.numel(), n))

    server_scales = _read_scales(result, row_signs)
    if codec is not None:  # every chunk in one launch
        codec.expand_(result, server_scales, buffer, chunk)
        return buffer
    host_server_scales = server_scales.tolist() if buffer.device.type == "cpu" else server_scales
    for j in range(n):
        unpack_signs(result[j, :row_signs], chunk, host_server_scales[j],
                     out=buffer[j * chunk:(j + 1) * chunk])
    return buffer


def _scale_bytes(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 1-element float32 scale as the 4 bytes that trail a sign message."""
    return scale.reshape(1).to(device=device, dtype=torch.float32).view(torch.uint8)


def _read_scales(messages: torch.Tensor, row_signs: int) -> torch.Tensor:
    """The float32 scale of each received message (the trailing 4 bytes of each row)."""
    return messages[:, row_signs:].contiguous().view(torch.float32).reshape(-1)
