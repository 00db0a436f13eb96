"""The fused CPU codec loops of ``_native.c``, compiled on first use and called through ctypes.

Why: numpy runs each step of the compressor as a separate pass (with a Python call per
cache-sized slice), which puts the whole per-rank compute of a compressed all-reduce at about 7
copies of the buffer; fused loops bring it near the memory traffic the maths needs. Built on
first use by ``onebitlamb._cbuild``; without it the numpy path gives the same bits.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import numpy as np

from onebitlamb._cbuild import F32P, I64, U8P, CLibrary


def _declare(lib) -> None:
    lib.obl_add_sumsq.argtypes = [F32P, F32P, I64]
    lib.obl_add_sumsq.restype = ctypes.c_double
    lib.obl_sign_pack_update.argtypes = [F32P, U8P, I64, ctypes.c_float]
    lib.obl_sign_pack_update.restype = None
    lib.obl_expand.argtypes = [U8P, I64, ctypes.c_float, F32P]
    lib.obl_expand.restype = None
    lib.obl_add_signs_sumsq.argtypes = [F32P, U8P, I64, I64, I64, F32P]
    lib.obl_add_signs_sumsq.restype = ctypes.c_double


LIBRARY = CLibrary(Path(__file__).with_name("_native.c"), _declare)


def load():
    """The compiled codec, or None (``LIBRARY.unavailable_reason`` says why)."""
    return LIBRARY.load()


def _f32(a: np.ndarray):
    return a.ctypes.data_as(F32P)


def _u8(a: np.ndarray):
    return a.ctypes.data_as(U8P)


def add_sumsq(lib, error: np.ndarray, addend: Optional[np.ndarray]) -> float:
    """``error += addend`` (if given); the sum of squares of the result."""
    return lib.obl_add_sumsq(_f32(error), _f32(addend) if addend is not None else None, error.size)


def sign_pack_update(lib, error: np.ndarray, packed: np.ndarray, scale: float) -> None:
    """Pack the signs of ``error`` into ``packed``; ``error -= scale * sign(error)``."""
    lib.obl_sign_pack_update(_f32(error), _u8(packed), error.size, scale)


def expand(lib, packed: np.ndarray, scale: float, out: np.ndarray) -> None:
    """``out = scale * ±1`` from ``packed`` (8 values per byte)."""
    lib.obl_expand(_u8(packed), packed.size, scale, _f32(out))


def add_signs_sumsq(lib, target: np.ndarray, rows: np.ndarray, scales: np.ndarray) -> float:
    """``target += sum_i scales[i] * signs(rows[i])``; the sum of squares of the result. ``rows``
    is 2-D uint8 whose rows may be strided (each a message with a trailing scale)."""
    if rows.strides[1] != 1:
        raise ValueError("each row of packed signs must be contiguous")
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    sum_sq = lib.obl_add_signs_sumsq(_f32(target), _u8(rows), rows.strides[0], rows.shape[0], rows.shape[1],
                                     _f32(scales))
    if sum_sq < 0:
        raise MemoryError("obl_add_signs_sumsq: could not allocate the sign tables")
    return sum_sq
