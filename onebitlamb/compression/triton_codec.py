"""The 1-bit codec as fused Triton kernels, for CUDA tensors (the ``gpu`` extra: ``pip install '.[gpu]'``).

Eager torch runs the compressor as one kernel per step (add, norm, compare, pack, select, subtract),
each a full pass over memory: about 10 device copies' worth of time on an H200. Here each pass over
memory does everything that can be done with what it has read.

Passes, counted in bytes per element against a copy's 8 (read 4, write 4):

- compress (``compress_``): the scale is a norm over the whole buffer and every element's update
  needs it, so the minimum is two passes: (1) read ``error`` and ``addend``, form ``y = error +
  addend`` in registers and reduce ``y * y`` (8 bytes, nothing written); (2) read both again,
  form the same ``y``, pack its signs and write ``error = y - s sign(y)`` (12 bytes and 1/8 for the
  signs). 20 bytes: 2.5 copies is the floor with an addend, 2 without (the server's).
  A one-program kernel between them turns the per-program partial sums into the scale.
- server sum (``add_signs_``): ``target += sum_i s_i sign_i`` for every rank's packed row in one
  pass (read and write the target once, each row's bytes once) that also reduces the new target's
  sum of squares, so the server's compressor needs only its second pass.
- expansion (``expand_``): every gathered row into its slice of the buffer in one launch (the
  bytes read are 1/32 of those written: about 0.5 copies).

Results against the plain-torch path of ``comm.collectives`` and ``compression.packing``:

- the same bits: packed signs; the server's sum (same order over ranks, each addition rounded to the
  dtype as torch rounds it); the expansion; and each error update *given the same scale*, since
  ``y - (±s)`` is one correctly rounded operation in both;
- the scale differs by rounding only. Here the squares (exact in float64: 24-bit significands)
  are summed in float64 in a fixed order, then ``sqrt(sum / numel)`` in float64, rounded once to
  float32: the summation error is below ``depth * 2**-53`` relative (depth < 64), so the scale is
  within 1 float32 ulp of the exact one, ``|s - s_exact| <= 2**-23 * s_exact``, and equals the CPU
  path's (which also sums in float64) but for a rare tie. The torch path sums squares in float32:
  ``|s_torch - s_exact| <= (d + 7)/2 * 2**-24 * s_exact`` for a summation depth ``d`` (squaring,
  summing, sqrt, the rounded ``sqrt(numel)`` and the division each add a rounding), so the two
  scales differ by at most the sum of both bounds (about 1e-6 relative for ``d <= 20``). Where a
  float32 square underflows (every ``|y| < 1e-19``) or overflows (any ``|y| > 1.8e19``) the torch
  path's scale is 0 or infinity, and this one is still within 1 ulp of the exact scale, like the CPU
  path's;
- an error update then differs from the torch path's by at most ``|s - s_torch|`` plus one ulp of
  the result in its dtype (rounding is monotone).

Determinism: no atomics; every reduction has a fixed order for a given size, so the same inputs
give the same bits on every call and on every rank. Kernels use only ``tl.load/store``,
``tl.where``, ``tl.sum``, ``tl.sqrt`` and casts (Triton 3.x); on CPU tensors they run under
Triton's interpreter (``TRITON_INTERPRET=1``, the tests), elsewhere the torch path runs.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

# Elements per program of the elementwise kernels (BYTES packed bytes, 8 signs each) and per
# partial sum; 4096 fp32 on 4 warps is 32 per thread, 8 vector loads in flight.
BYTES = 512
BLOCK = 8 * BYTES
PARTIALS_BLOCK = 1024


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 ``x`` to ``dtype``, to nearest even as torch rounds. bfloat16 by hand: the compiled
    cast rounds to nearest even too, but Triton 3.6's interpreter truncates, and the tests run there."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)  # a NaN stays NaN (the sum could carry)
    else:
        return x.to(dtype)


@triton.jit
def _load_y(e_ptr, b_ptr, offs, mask, HAS_ADDEND: tl.constexpr):
    """``error (+ addend)`` rounded to the error's dtype, as torch's ``error.add_(addend)`` (computed
    in float32, rounded once)."""
    y = tl.load(e_ptr + offs, mask=mask, other=0.0)
    if HAS_ADDEND:
        b = tl.load(b_ptr + offs, mask=mask, other=0.0)
        y = _round(y.to(tl.float32) + b.to(tl.float32), e_ptr.dtype.element_ty)
    return y


@triton.jit
def _sumsq_kernel(e_ptr, b_ptr, partials_ptr, numel, HAS_ADDEND: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 of the compressor: each program's sum of ``y * y`` in float64 (nothing written back)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    y = _load_y(e_ptr, b_ptr, offs, offs < numel, HAS_ADDEND).to(tl.float64)
    tl.store(partials_ptr + pid, tl.sum(y * y, axis=0))


@triton.jit
def _scale_kernel(partials_ptr, num_partials, scale_ptr, numel, PARTIALS_BLOCK: tl.constexpr):
    """One program: ``sqrt(sum(partials) / numel)`` in float64, rounded once to float32."""
    acc = tl.zeros([PARTIALS_BLOCK], dtype=tl.float64)
    start = 0
    while start < num_partials:  # not range(): Triton 3.6's interpreter cannot take a runtime bound there
        offs = start + tl.arange(0, PARTIALS_BLOCK)
        acc += tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0)
        start += PARTIALS_BLOCK
    mean = tl.sum(acc, axis=0) / numel  # float64: numel is exact below 2**53
    tl.store(scale_ptr, tl.sqrt(mean).to(tl.float32))


# Negation is written ``s * -1.0``: Triton's ``-s`` is ``0 - s``, which gives +0 for s = 0 where
# torch gives -0, and a sum with -0 keeps the sign of a -0 target that one with +0 loses.


@triton.jit
def _sign_bits(packed):
    """``bool[BYTES, 8]``: bit j of each byte, most significant first (bit set = negative)."""
    shift = 7 - tl.arange(0, 8)
    return ((packed.to(tl.int32)[:, None] >> shift[None, :]) & 1) != 0


@triton.jit
def _pack_update_kernel(e_ptr, b_ptr, scale_ptr, packed_ptr, numel, nbytes, HAS_ADDEND: tl.constexpr,
                        UPDATE: tl.constexpr, BYTES: tl.constexpr):
    """Pass 2: pack the signs of ``y`` (bit 1 where ``y < 0``; past ``numel``, 0) and, with UPDATE,
    write ``error = y - (±s)``, the sign from the same comparison that was packed."""
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BYTES + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    offs = byte[:, None] * 8 + bit[None, :]
    mask = offs < numel
    y = _load_y(e_ptr, b_ptr, offs, mask, HAS_ADDEND)
    negative = y < 0  # false for -0.0 and NaN: both pack as +1, as in the torch path
    weight = tl.full([8], 1, tl.int32) << (7 - bit)
    packed = tl.sum(tl.where(negative, weight[None, :], 0), axis=1)
    tl.store(packed_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)
    if UPDATE:
        # torch: s = scale.to(dtype); error - where(negative, -s, s), in float32, rounded to dtype
        s = _round(tl.load(scale_ptr), e_ptr.dtype.element_ty).to(tl.float32)
        new = y.to(tl.float32) - tl.where(negative, s * -1.0, s)
        tl.store(e_ptr + offs, _round(new, e_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_signs_kernel(target_ptr, rows_ptr, row_stride, scales_ptr, n_rows, nbytes, partials_ptr,
                      BYTES: tl.constexpr):
    """``target += sum_i scales[i] * signs(row i)``, rank by rank, each addition rounded to the
    target's dtype (torch's order and roundings); each program's float64 sum of squares of the new
    target, for the server's scale."""
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BYTES + tl.arange(0, BYTES)
    offs = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
    in_range = byte < nbytes
    mask = offs < 8 * nbytes
    acc = tl.load(target_ptr + offs, mask=mask, other=0.0)
    i = 0
    while i < n_rows:  # in rank order, as the torch path adds them
        packed = tl.load(rows_ptr + i * row_stride + byte, mask=in_range, other=0)
        s = tl.load(scales_ptr + i).to(tl.float32)  # already in the target's dtype
        acc = _round(acc.to(tl.float32) + tl.where(_sign_bits(packed), s * -1.0, s), target_ptr.dtype.element_ty)
        i += 1
    tl.store(target_ptr + offs, acc, mask=mask)
    acc64 = tl.where(mask, acc, 0.0).to(tl.float64)  # past the end, +s was added to nothing
    tl.store(partials_ptr + pid, tl.sum(tl.sum(acc64 * acc64, axis=1), axis=0))


@triton.jit
def _expand_kernel(rows_ptr, row_stride, scales_ptr, out_ptr, row_numel, nbytes, BYTES: tl.constexpr):
    """Row ``r`` of packed signs (``program_id(1)``) into ``out[r * row_numel:][:row_numel]`` as
    ``scales[r] * ±1`` (the scales already in the output's dtype)."""
    pid = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    byte = pid * BYTES + tl.arange(0, BYTES)
    offs = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
    packed = tl.load(rows_ptr + r * row_stride + byte, mask=byte < nbytes, other=0)
    s = tl.load(scales_ptr + r).to(tl.float32)  # exact, and so is the way back
    signed = _round(tl.where(_sign_bits(packed), s * -1.0, s), out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * row_numel + offs, signed, mask=offs < row_numel)


def _on_device(fn):
    """Run ``fn`` with its first tensor's GPU current: Triton launches on the current device, and a
    thread's (an optimizer's exchange thread, say) need not be the tensor's."""
    @functools.wraps(fn)
    def wrapper(tensor, *args, **kwargs):
        with torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext():
            return fn(tensor, *args, **kwargs)
    return wrapper


def _programs(numel: int) -> int:
    return triton.cdiv(numel, BLOCK)


def scale_from_partials(partials: torch.Tensor, numel: int) -> torch.Tensor:
    """The 1-element float32 scale ``sqrt(sum(partials) / numel)``."""
    scale = torch.empty(1, dtype=torch.float32, device=partials.device)
    _scale_kernel[(1,)](partials, partials.numel(), scale, numel, PARTIALS_BLOCK=PARTIALS_BLOCK, num_warps=8)
    return scale


@_on_device
def compress_(error: torch.Tensor, addend: Optional[torch.Tensor], packed: torch.Tensor,
              partials: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``error += addend``; pack sign(error) into ``packed``; ``error -= s * sign(error)``; return
    ``s = ||error|| / sqrt(numel)`` as a 1-element float32 tensor (no host synchronisation).

    ``partials``: the per-program sums of squares of ``error`` when the caller has them (from
    ``add_signs_``; then ``addend`` must be None), which saves the first pass."""
    numel = error.numel()
    if numel == 0:
        return torch.zeros(1, dtype=torch.float32, device=error.device)
    has_addend = addend is not None
    b = addend if has_addend else error  # a pointer that is never read
    if partials is None:
        partials = torch.empty(_programs(numel), dtype=torch.float64, device=error.device)
        _sumsq_kernel[(partials.numel(),)](error, b, partials, numel, HAS_ADDEND=has_addend, BLOCK=BLOCK)
    elif has_addend:
        raise ValueError("partials are the sums of squares of error itself: give them without an addend")
    scale = scale_from_partials(partials, numel)
    _pack_update_kernel[(triton.cdiv(packed.numel(), BYTES),)](
        error, b, scale, packed, numel, packed.numel(), HAS_ADDEND=has_addend, UPDATE=True, BYTES=BYTES)
    return scale


@_on_device
def pack_signs(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The signs of contiguous ``x`` into ``out`` (``ceil(numel / 8)`` bytes, tail bits 0)."""
    if x.numel():
        _pack_update_kernel[(triton.cdiv(out.numel(), BYTES),)](
            x, x, x, out, x.numel(), out.numel(), HAS_ADDEND=False, UPDATE=False, BYTES=BYTES)
    return out


@_on_device
def add_signs_(target: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``target += sum_i scales[i] * signs(rows[i])``; returns the per-program float64 sums of
    squares of the new target (``compress_``'s ``partials``). ``rows``: 2-D uint8, each row
    contiguous (rows may be strided: messages with a trailing scale), ``8 * rows.shape[1]`` equal
    to ``target.numel()``; ``scales``: one per row, any float dtype (cast as torch casts them)."""
    n_rows, nbytes = rows.shape
    if target.numel() != 8 * nbytes or (nbytes and rows.stride(1) != 1):
        raise ValueError(f"a target of {target.numel()} elements takes rows of {target.numel() // 8} contiguous "
                         f"bytes, got rows of shape {tuple(rows.shape)} and strides {rows.stride()}")
    partials = torch.zeros(max(1, triton.cdiv(nbytes, BYTES)), dtype=torch.float64, device=target.device)
    if nbytes:
        _add_signs_kernel[(partials.numel(),)](target, rows, rows.stride(0), scales.to(target.dtype), n_rows,
                                               nbytes, partials, BYTES=BYTES)
    return partials


@_on_device
def expand_(rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, row_numel: int) -> torch.Tensor:
    """Row ``r`` of ``rows`` (2-D uint8, each row's first ``ceil(row_numel / 8)`` bytes contiguous)
    expanded into ``out[r * row_numel:(r + 1) * row_numel]`` as ``scales[r] * ±1``, all rows in one
    launch. ``scales`` is cast to ``out``'s dtype as torch casts it (``torch.as_tensor(s).to(dtype)``)."""
    n_rows = rows.shape[0]
    nbytes = (row_numel + 7) // 8
    if row_numel and n_rows:
        if rows.stride(1) != 1 or rows.shape[1] < nbytes:
            raise ValueError(f"rows of {row_numel} signs need {nbytes} contiguous bytes each, got shape "
                             f"{tuple(rows.shape)} and strides {rows.stride()}")
        _expand_kernel[(triton.cdiv(nbytes, BYTES), n_rows)](rows, rows.stride(0), scales.to(out.dtype), out,
                                                            row_numel, nbytes, BYTES=BYTES)
    return out
