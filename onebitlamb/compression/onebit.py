"""The error-feedback 1-bit codec: what the compressed all-reduce does to a buffer at each end.

``compress_`` adds a buffer into its error, sends the signs of the sum with one scale (its RMS,
``||y|| / sqrt(D)``), and keeps in the error what that code left out; ``add_signs_`` is the
server's half, the scaled signs of every rank summed into its error. Each picks its kernels once
per call: the fused Triton kernels on CUDA (``triton_codec``), compiled C loops on CPU
(``native``), numpy or plain torch otherwise; all give the same signs, and scales equal to
rounding. ``onebitlamb.comm.collectives`` moves the messages; this module never communicates.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from onebitlamb.compression import native
from onebitlamb.compression.packing import fused_codec, negative_bits, pack_signs, sign_table, signed_scales

# Elements per slice of the numpy compressor: small enough that the passes over one slice stay
# in a core's L2 cache, large enough that Python's per-slice overhead is a few percent.
CPU_SLICE = 131072
_SIGN_BIT = np.uint32(0x80000000)


def compress_cpu_(error: torch.Tensor, addend: Optional[torch.Tensor], packed: torch.Tensor,
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
        sum_sq = native.add_sumsq(lib, y_all, b_all) if lib is not None else add_sumsq_numpy(y_all, b_all)
    scale = np.float32(math.sqrt(sum_sq / numel))
    if lib is not None:
        native.sign_pack_update(lib, y_all, out, float(scale))
        return float(scale)
    scale_bits = np.array([scale], dtype=np.float32).view(np.uint32)[0]
    mask = np.empty(min(CPU_SLICE, numel), dtype=bool)
    signed_scale = np.empty(min(CPU_SLICE, numel), dtype=np.uint32)
    for i in range(0, numel, CPU_SLICE):
        y = y_all[i:i + CPU_SLICE]
        m = np.less(y, 0, out=mask[: y.size])
        out[i // 8:(i + y.size) // 8] = np.packbits(m)
        q = signed_scale[: y.size]
        np.multiply(m.view(np.uint8), _SIGN_BIT, out=q)   # sign bit where negative
        np.bitwise_or(q, scale_bits, out=q)               # ... on top of +scale: q = ±scale
        np.subtract(y, q.view(np.float32), out=y)
    return float(scale)


def add_sumsq_numpy(y_all: np.ndarray, b_all: Optional[np.ndarray]) -> float:
    """``y += b`` (if given) a slice at a time; the sum of squares, accumulated in float64."""
    sum_sq = 0.0
    for i in range(0, y_all.size, CPU_SLICE):
        y = y_all[i:i + CPU_SLICE]
        if b_all is not None:
            np.add(b_all[i:i + CPU_SLICE], y, out=y)
        sum_sq += float(np.dot(y, y))
    return sum_sq


def compress_torch_(error: torch.Tensor, addend: Optional[torch.Tensor], packed: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """The same as ``compress_cpu_`` in plain torch ops (CUDA, or dtypes numpy lacks); returns a
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


def compress_(error, addend, packed, workspace, sum_sq=None, fused: Optional[bool] = None):
    """Compress ``error (+ addend)`` into ``packed``; the scale as a 1-element float32 tensor.
    ``sum_sq``: what ``add_signs_`` returned with the same ``fused``, when not None."""
    codec = fused_codec(error, fused)
    if codec is not None:
        return codec.compress_(error, addend, packed, sum_sq)
    if error.device.type == "cpu" and error.dtype == torch.float32:
        return torch.tensor([compress_cpu_(error, addend, packed, sum_sq)], dtype=torch.float32)
    mask = workspace.get("mask")
    if mask is None or mask.numel() < error.numel():  # only the torch path needs this scratch
        mask = workspace["mask"] = torch.empty(error.numel(), dtype=torch.bool, device=error.device)
    return compress_torch_(error, addend, packed, mask).reshape(1)


def add_signs_(target: torch.Tensor, packed_rows: torch.Tensor, scales: torch.Tensor,
                fused: Optional[bool] = None):
    """``target += sum_i scales[i] * signs(packed_rows[i])``: the server's sum over ranks. Returns
    the sum of squares of the new target where it comes for free (the compiled loop computes it
    while the values are in registers: a float; the Triton kernel: its partial sums, a tensor),
    else None; ``compress_`` takes it as ``sum_sq``."""
    codec = fused_codec(target, fused)
    if codec is not None:
        return codec.add_signs_(target, packed_rows, scales)
    if target.device.type != "cpu":
        add_signs_bits_(target, packed_rows, scales)
        return None
    lib = native.load() if target.dtype == torch.float32 else None
    if lib is not None:
        return native.add_signs_sumsq(lib, target.numpy(), packed_rows.numpy(), scales.numpy())
    add_signs_table_(target, packed_rows, scales)
    return None


def add_signs_table_(target: torch.Tensor, packed_rows: torch.Tensor, scales: torch.Tensor) -> None:
    """The CPU path: one ``embedding_bag`` does it 8 elements at a time. For each byte position the
    bag holds every rank's byte (offset into that rank's 256-row table of ``scale_i * ±1``) and
    sums their rows, so the n expansions are gathered and added in one fused pass instead of n
    decodes each written out and read back; a cache-sized slice at a time."""
    n, nbytes = packed_rows.shape
    device = target.device
    table = torch.cat([sign_table(s, target.dtype, device) for s in scales.tolist()])
    offsets = (torch.arange(n, device=device) * 256).view(1, n)
    step = CPU_SLICE // 8
    index = torch.empty(min(step, nbytes), n, dtype=torch.long, device=device)
    rows = target.view(-1, 8)
    for start in range(0, nbytes, step):
        stop = min(start + step, nbytes)
        idx = index[: stop - start]
        idx.copy_(packed_rows[:, start:stop].t())
        idx.add_(offsets)
        rows[start:stop].add_(torch.nn.functional.embedding_bag(idx, table, mode="sum"))


def add_signs_bits_(target: torch.Tensor, packed_rows: torch.Tensor, scales: torch.Tensor) -> None:
    """The device path: per rank, test each bit and add ``±scale_i`` (elementwise kernels, which a
    GPU runs far faster than the gather of table rows)."""
    rows = target.view(-1, 8)
    for i in range(packed_rows.shape[0]):
        negative, positive = signed_scales(scales[i], target.dtype, target.device)
        rows.add_(torch.where(negative_bits(packed_rows[i]), negative, positive))
