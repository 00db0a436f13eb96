"""The error-feedback 1-bit codec: what the compressed all-reduce does to a buffer at each end.

``compress_`` adds a buffer into its error, sends the signs of the sum with one scale (its RMS,
``||y|| / sqrt(D)``), and keeps in the error what that code left out; ``add_signs_`` is the
server's half, the scaled signs of every rank summed into its error. Each picks its kernels once
per call: the fused Triton kernels on CUDA (``triton_codec``), compiled C loops on CPU
(``native``), numpy or plain torch otherwise; all give the same signs, and scales equal to
rounding. ``onebitlamb.comm.collectives`` moves the messages; this module never communicates.

``ONEBIT`` is the same code behind the ``compression.codec.Codec`` protocol: a row's message is its
packed signs followed by its float32 scale, the layout of ``compressed_allreduce``'s messages, and
``wire_bytes`` is what the cost model prices them at.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch

from onebitlamb.compression import native
from onebitlamb.compression.codec import decoded_into
from onebitlamb.compression.packing import (fused_codec, negative_bits, pack_signs, packed_size, sign_table,
                                            signed_scales, unpack_signs)

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


SCALE_BYTES = 4  # a float32 scale rides at the end of each sign message


def scale_bytes(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 1-element float32 scale as the 4 bytes that trail a sign message."""
    return scale.reshape(1).to(device=device, dtype=torch.float32).view(torch.uint8)


def read_scales(messages: torch.Tensor, row_signs: int) -> torch.Tensor:
    """The float32 scale of each message (the trailing 4 bytes of each row after ``row_signs``)."""
    return messages[:, row_signs:].contiguous().view(torch.float32).reshape(-1)


@dataclass(frozen=True)
class OneBitCodec:
    """The 1-bit code as a ``compression.codec.Codec``: a row of ``c`` elements (a multiple of 8:
    whole bytes of signs) travels as its packed signs and one float32 scale, its RMS, with error
    feedback. ``fused``: the kernels, as ``compress_`` takes it.

    ``comm.compressed_allreduce`` sends these messages from its own preallocated buffers (its worker
    encodes the whole buffer with one scale and sends a chunk of its signs to each rank, each with
    that scale); this object is what the rest of the library asks about them."""

    fused: Optional[bool] = None

    name: ClassVar[str] = "onebit"
    carries_error: ClassVar[bool] = True
    block: ClassVar[int] = 8
    bytes_per_element: ClassVar[float] = 1 / 8

    def wire_bytes(self, numel: int) -> int:
        """``numel / 8`` bytes of signs and the 4 of the scale."""
        return packed_size(numel) + SCALE_BYTES

    def to_wire_(self, y: torch.Tensor) -> torch.Tensor:
        """Each row's signs and scale (``compress_``), ``y`` left holding the error; a non-finite
        scale anywhere makes every scale NaN."""
        rows = y.view(-1, y.shape[-1])
        r, c = rows.shape
        if c % 8:
            raise ValueError(f"the 1-bit codec encodes rows of whole bytes of signs: {c} elements is not a "
                             f"multiple of 8")
        row_signs = c // 8
        message = torch.empty(r, row_signs + SCALE_BYTES, dtype=torch.uint8, device=y.device)
        workspace: dict = {}
        scales = torch.cat([compress_(rows[i], None, message[i, :row_signs], workspace, fused=self.fused)
                            for i in range(r)]).to(device=y.device, dtype=torch.float32)
        if not bool(torch.isfinite(scales).all()):
            scales.fill_(float("nan"))
        message[:, row_signs:].copy_(scales.view(torch.uint8).view(r, SCALE_BYTES))
        return message

    def from_wire(self, message: torch.Tensor, numel: int, *, divisor: int = 1,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``scale / divisor * sign`` for each row (``unpack_signs``), into ``out`` when given."""
        rows = message.reshape(-1, message.shape[-1])
        row_signs = packed_size(numel)
        scales = read_scales(rows, row_signs)
        if divisor != 1:
            scales = scales / divisor
        values = torch.empty(rows.shape[0], numel, dtype=torch.float32, device=message.device)
        host = scales.tolist() if message.device.type == "cpu" else scales
        for i in range(rows.shape[0]):
            unpack_signs(rows[i, :row_signs], numel, host[i], out=values[i], fused=self.fused)
        return decoded_into(values, out)


ONEBIT = OneBitCodec()
