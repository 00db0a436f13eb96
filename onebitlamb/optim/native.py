"""1-bit LAMB's fused stage-2 loop (``_native.c``), compiled on first use by ``onebitlamb._cbuild``.

``functional.fresh_variance_statistics_`` uses it for contiguous float32 CPU buffers and falls
back to torch (the same values, up to float rounding) anywhere else or without a compiler.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from onebitlamb._cbuild import F32P, F64P, I64, I64P, CLibrary

ISAS = {"best": 0, "scalar": 1, "sse2": 2, "avx2": 3}


def _declare(lib) -> None:
    f = lib.obl_fresh_variance_stats
    f.argtypes = [F32P, F32P, F32P, F32P, F32P, I64P, I64] + [ctypes.c_float] * 5 + [F32P, F64P, ctypes.c_int]
    f.restype = ctypes.c_int


LIBRARY = CLibrary(Path(__file__).with_name("_native.c"), _declare)


def usable(*tensors: torch.Tensor) -> Optional[ctypes.CDLL]:
    """The library, if it is built and every tensor is a contiguous float32 CPU buffer."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return None
    return LIBRARY.load()


def _ptr(t: torch.Tensor, kind):
    return ctypes.cast(t.data_ptr(), kind)


def fresh_variance_stats_(lib, v: torch.Tensor, m: torch.Tensor, m_prev: torch.Tensor, inv_den: torch.Tensor,
                          update: torch.Tensor, offsets: torch.Tensor, beta1: float, beta2: float, weight: float,
                          shift: float, inv_bc1: float, isa: str = "best") -> tuple[torch.Tensor, torch.Tensor]:
    """See ``obl_fresh_variance_stats``: updates ``v`` and writes ``update`` in place; returns each
    layer's minimum quotient (float32) and the update's sum of squares (float64)."""
    layers = offsets.numel() - 1
    min_quotient = torch.empty(layers, dtype=torch.float32)
    sumsq = torch.empty(layers, dtype=torch.float64)
    used = lib.obl_fresh_variance_stats(
        _ptr(v, F32P), _ptr(m, F32P), _ptr(m_prev, F32P), _ptr(inv_den, F32P), _ptr(update, F32P),
        _ptr(offsets, I64P), layers, beta1, beta2, weight, shift, inv_bc1,
        _ptr(min_quotient, F32P), _ptr(sumsq, F64P), ISAS[isa])
    if used < 0:
        raise ValueError(f"instruction set {isa!r} is not available on this CPU")
    return min_quotient, sumsq
