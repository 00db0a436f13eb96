"""Sign bits packed 8 per byte, and their expansion back to ``scale * ±1``.

Conventions (docs/algorithm.md): bit 1 means negative, bit 0 non-negative, so ``sign(0) = +1`` and
``sign(-0.0) = +1`` (``-0.0 < 0`` is false). NaN compares false too, so a NaN packs as +1; the
all-reduce does not hide it, since a NaN makes the buffer's scale NaN (see ``comm``). Bits are
packed most significant first (numpy's ``bitorder="big"``), the same on CPU and CUDA.

Implementations with identical bits:
- CPU, float32, where gcc is available: the fused loops of ``_native.c`` (see ``native.py``),
  which the compressed all-reduce also uses for its compressor and server sum;
- CPU otherwise: numpy's SIMD comparison into a reusable bool buffer, then ``packbits``;
  expansion is a table lookup (each byte selects a row of 8 precomputed signed scales): one read
  of the packed bytes and one write of the output.
- CUDA with Triton installed (``onebitlamb[gpu]``): the fused kernels of ``triton_codec``;
- any other device (CUDA without Triton): the same maths in plain torch ops. Expansion there
  tests each bit (a broadcast AND, a compare) and selects ``±scale`` with ``torch.where``: all
  elementwise and coalesced, where the table lookup would be a gather of 32-byte rows (measured
  on an H200: the gather was 30-40 copies' worth of time).

``fused`` (``pack_signs``, ``unpack_signs``, ``comm.compressed_allreduce``) picks between the last
two: None (the default) the Triton kernels for CUDA tensors when Triton imports, True always (a
``ValueError`` says why it cannot), False never. Packing and expansion give the same bits either way.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from onebitlamb.compression import native

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Row b holds the 8 signs encoded by byte b, most significant bit first: +1 for 0, -1 for 1.
_SIGN_TABLE = torch.from_numpy(
    1.0 - 2.0 * np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32)
)
# Packed bytes expanded per slice on CPU (32768 bytes -> 256K values, an L2-sized index).
_EXPAND_SLICE = 32768
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


_FUSED: dict = {}


def fused_codec(tensor: torch.Tensor, fused: Optional[bool] = None):
    """The ``triton_codec`` module when its kernels are to run on ``tensor``, else None.

    ``fused``: None, on CUDA tensors when Triton imports; False, never; True, always, raising a
    ValueError when Triton cannot be imported or ``tensor`` is on the CPU (where the kernels run
    only under Triton's interpreter, ``TRITON_INTERPRET=1``: the tests)."""
    if fused is False or (fused is None and not tensor.is_cuda):
        return None
    if "module" not in _FUSED:
        try:
            from onebitlamb.compression import triton_codec
            _FUSED.update(module=triton_codec, reason=None)
        except (ImportError, RuntimeError, OSError) as exc:  # not installed, or a broken install
            _FUSED.update(module=None, reason=f"triton cannot be imported ({type(exc).__name__}: {exc})")
    codec = _FUSED["module"]
    if fused is None:
        return codec
    if codec is None:
        raise ValueError(f"fused=True: {_FUSED['reason']}; install Triton (the gpu extra: pip install '.[gpu]' in "
                         f"a checkout), or pass fused=None or False")
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"fused=True: the Triton kernels need CUDA tensors, got a tensor on {tensor.device} "
                         f"(pass fused=None or False)")
    return codec


def packed_size(numel: int) -> int:
    """Bytes needed for ``numel`` signs."""
    return (numel + 7) // 8


def _check_float(x: torch.Tensor, name: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")


def pack_signs(
    x: torch.Tensor, out: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None, *,
    fused: Optional[bool] = None,
) -> torch.Tensor:
    """Pack the signs of ``x`` (flattened) into ``ceil(numel/8)`` uint8 bytes.

    ``out`` (uint8, that size) and ``workspace`` (bool, ``numel``) may be given to avoid allocating.
    A size that is not a multiple of 8 is padded with +1 signs (0 bits). ``fused``: whether the
    Triton kernel packs (default: on CUDA when Triton imports; the same bits either way).
    """
    _check_float(x, "x")
    flat = x.reshape(-1)
    n = flat.numel()
    nbytes = packed_size(n)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or out.numel() != nbytes or out.device != x.device:
        raise ValueError(f"out must be a uint8 tensor of {nbytes} elements on {x.device}, "
                         f"got {out.dtype} with {out.numel()} on {out.device}")
    codec = fused_codec(x, fused)
    if codec is not None:
        return codec.pack_signs(flat, out)
    if workspace is None or workspace.numel() < n:
        workspace = torch.empty(n, dtype=torch.bool, device=x.device)
    negative = workspace[:n]
    if x.device.type == "cpu" and x.dtype != torch.bfloat16:  # numpy has no bfloat16
        np.less(flat.numpy(), 0, out=negative.numpy())
        out.copy_(torch.from_numpy(np.packbits(negative.numpy())))
        return out
    torch.lt(flat, 0, out=negative)
    if x.device.type == "cpu":
        out.copy_(torch.from_numpy(np.packbits(negative.numpy())))
        return out
    return _pack_bits_torch(negative, out)


def _pack_bits_torch(negative: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The device path: 8 booleans times their bit weights, summed into one byte."""
    n = negative.numel()
    full = (n // 8) * 8
    weights = _BIT_WEIGHTS.to(negative.device)
    if full:
        weighted = negative[:full].view(torch.uint8).view(-1, 8) * weights
        torch.sum(weighted, dim=1, dtype=torch.uint8, out=out[: full // 8])
    if full < n:
        tail = torch.zeros(8, dtype=torch.uint8, device=negative.device)
        tail[: n - full] = negative[full:].to(torch.uint8)
        out[-1] = (tail * weights).sum(dtype=torch.uint8)
    return out


def unpack_signs(
    packed: torch.Tensor,
    numel: int,
    scale: float | torch.Tensor = 1.0,
    dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
    *,
    fused: Optional[bool] = None,
) -> torch.Tensor:
    """Expand packed bits to ``scale * ±1`` (bit 0 -> +scale, bit 1 -> -scale), ``numel`` values.

    ``scale`` may be a Python number or a 0-d tensor; the result has ``dtype`` (or ``out``'s).
    ``fused``: whether the Triton kernel expands (default: on CUDA when Triton imports; the same
    bits either way).
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if packed.numel() != packed_size(numel):
        raise ValueError(f"{numel} signs need {packed_size(numel)} packed bytes, got {packed.numel()}")
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=packed.device)
        _check_float(out, "out")
    else:
        _check_float(out, "out")
        if out.numel() != numel:
            raise ValueError(f"out must have {numel} elements, got {out.numel()}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    if numel == 0:
        return out
    flat = out.view(-1)
    full = numel // 8
    codec = fused_codec(packed, fused)
    if codec is not None:
        positive = signed_scales(scale, out.dtype, out.device)[1]  # the torch path's cast of the scale
        codec.expand_(packed.reshape(1, -1), positive.reshape(1), flat, numel)
        return out
    if packed.device.type != "cpu":
        if full:
            expand_bits(packed[:full], scale, flat[: 8 * full])
        if full * 8 < numel:
            tail = torch.empty(8, dtype=out.dtype, device=out.device)
            expand_bits(packed[full:], scale, tail)
            flat[full * 8:] = tail[: numel - full * 8]
        return out
    lib = native.load() if out.dtype == torch.float32 else None
    if lib is not None:
        s = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
        if full:
            native.expand(lib, packed[:full].numpy(), s, flat[: 8 * full].numpy())
        if full * 8 < numel:
            flat[full * 8:] = sign_table(s, out.dtype, packed.device)[int(packed[-1])][: numel - full * 8]
        return out
    table = sign_table(scale, out.dtype, packed.device)
    # Each byte selects a row of 8 signed scales. The byte indices are widened to int64 a slice
    # at a time, so the index stays in cache and nothing buffer-sized is allocated.
    index = torch.empty(min(_EXPAND_SLICE, full), dtype=torch.long, device=packed.device)
    for i in range(0, full, _EXPAND_SLICE):
        j = min(i + _EXPAND_SLICE, full)
        expand_rows(packed[i:j], table, flat[8 * i:8 * j], index)
    if full * 8 < numel:
        flat[full * 8:] = table[int(packed[-1])][: numel - full * 8]
    return out


def sign_table(scale: float | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 256 x 8 table of ``scale * ±1`` that ``expand_rows`` looks bytes up in."""
    if isinstance(scale, torch.Tensor):
        scale = scale.item() if device.type == "cpu" else scale.to(dtype)
    return (_SIGN_TABLE.to(device) * scale).to(dtype)


def negative_bits(packed: torch.Tensor) -> torch.Tensor:
    """``bool[packed.numel(), 8]``: True where a bit is set (a negative sign), MSB first."""
    return torch.bitwise_and(packed.reshape(-1, 1), _BIT_WEIGHTS.to(packed.device)).ne_(0).view(torch.bool)


def signed_scales(scale: float | torch.Tensor, dtype: torch.dtype, device: torch.device):
    """``(-scale, +scale)`` as 0-d tensors of ``dtype`` on ``device`` (no host synchronisation)."""
    s = torch.as_tensor(scale, device=device).to(dtype)
    return -s, s


def expand_bits(packed: torch.Tensor, scale: float | torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (8 values per byte) = ``scale * ±1`` by testing each bit: the device path's
    expansion, elementwise throughout."""
    negative, positive = signed_scales(scale, out.dtype, out.device)
    torch.where(negative_bits(packed), negative, positive, out=out.view(-1, 8))


def expand_rows(packed: torch.Tensor, table: torch.Tensor, out: torch.Tensor, index: torch.Tensor) -> None:
    """``out`` (8 values per byte of ``packed``) = the table rows the bytes select; ``index`` is
    an int64 scratch of at least ``packed.numel()`` elements. The inner loop of the expansions."""
    idx = index[: packed.numel()]
    idx.copy_(packed)
    torch.index_select(table, 0, idx, out=out.view(-1, 8))
