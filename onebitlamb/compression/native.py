"""The fused CPU codec loops of ``_native.c``, compiled on first use and called through ctypes.

Why: numpy runs each step of the compressor as a separate pass (with a Python call per
cache-sized slice), which puts the whole per-rank compute of a compressed all-reduce at about 7
copies of the buffer; fused loops bring it near the memory traffic the maths needs. Why this way:
a plain C file needs only gcc (no Python or torch headers, no build step at install), and a
machine without a compiler keeps the numpy path, which gives the same bits.

The library is built with ``gcc -O3`` into ``$ONEBITLAMB_CACHE`` (default
``~/.cache/onebitlamb``) under a name that holds the machine type and a hash of the source,
atomically, so concurrent workers never load a half-written file. ``ONEBITLAMB_NATIVE=0`` turns
it off; a failed build (no compiler, a read-only cache) falls back to numpy.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

_SOURCE = Path(__file__).with_name("_native.c")
_lib: Optional[ctypes.CDLL] = None
_tried = False
#: Why the native loops are not in use, when they are not (shown by the kernel benchmark).
unavailable_reason: Optional[str] = None

_F32P = ctypes.POINTER(ctypes.c_float)
_U8P = ctypes.POINTER(ctypes.c_uint8)
_I64 = ctypes.c_int64


def _cache_dir() -> Path:
    return Path(os.environ.get("ONEBITLAMB_CACHE") or Path.home() / ".cache" / "onebitlamb")


def _build(target: Path) -> None:
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise OSError("no C compiler (gcc or cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", tmp, str(_SOURCE)],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent worker sees the old name or the whole file
    except subprocess.CalledProcessError as exc:
        raise OSError(f"{compiler} failed: {exc.stderr.strip()[-500:]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> Optional[ctypes.CDLL]:
    """The compiled library, building it if needed; None (and ``unavailable_reason``) if that
    is impossible here or turned off."""
    global _lib, _tried, unavailable_reason
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("ONEBITLAMB_NATIVE", "1") == "0":
        unavailable_reason = "turned off by ONEBITLAMB_NATIVE=0"
        return None
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    # a home folder shared by machines of different kinds must not hand one the other's build
    target = _cache_dir() / f"onebitlamb_native_{platform.machine()}_{digest}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        unavailable_reason = f"not built: {exc}"
        return None
    lib.obl_add_sumsq.argtypes = [_F32P, _F32P, _I64]
    lib.obl_add_sumsq.restype = ctypes.c_double
    lib.obl_sign_pack_update.argtypes = [_F32P, _U8P, _I64, ctypes.c_float]
    lib.obl_sign_pack_update.restype = None
    lib.obl_expand.argtypes = [_U8P, _I64, ctypes.c_float, _F32P]
    lib.obl_expand.restype = None
    lib.obl_add_signs_sumsq.argtypes = [_F32P, _U8P, _I64, _I64, _I64, _F32P]
    lib.obl_add_signs_sumsq.restype = ctypes.c_double
    _lib = lib
    return lib


def _f32(a: np.ndarray):
    return a.ctypes.data_as(_F32P)


def _u8(a: np.ndarray):
    return a.ctypes.data_as(_U8P)


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
