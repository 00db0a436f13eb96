"""What the warm-up's average puts on the wire: one format per ``warmup_dtype``.

The warm-up averages every rank's gradient with one all-reduce (``comm.average_``). A format
says what tensor travels (``encode``) and how the averaged tensor comes back into the caller's
float32 buffer (``decode_``): float32 sends the buffer itself, bfloat16 a rounded copy of it, half
the bytes, summed and divided in bfloat16 (its rounding is not carried into the next step:
``docs/optimizers.md`` measures what that costs). Chosen once, by name or dtype, at construction
(``wire_format``); the name is what a saved state records.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Union

import torch


@dataclass(frozen=True)
class WireFormat:
    name: str
    dtype: torch.dtype

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The tensor to all-reduce: ``values`` itself when it is already of this dtype."""
        return values if values.dtype == self.dtype else values.to(self.dtype)

    def decode_(self, averaged: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` <- the averaged wire tensor (nothing to do when it is ``out`` itself)."""
        return out if averaged is out else out.copy_(averaged)


FLOAT32 = WireFormat("float32", torch.float32)
BFLOAT16 = WireFormat("bfloat16", torch.bfloat16)
WIRE_FORMATS: Dict[str, WireFormat] = {f.name: f for f in (FLOAT32, BFLOAT16)}


def wire_format(value: Union[str, torch.dtype, WireFormat]) -> WireFormat:
    """The format ``warmup_dtype`` names: ``torch.float32`` or ``"float32"``, ``torch.bfloat16``
    or ``"bfloat16"``; ValueError naming the value otherwise."""
    if isinstance(value, WireFormat):
        return value
    for f in WIRE_FORMATS.values():
        if value == f.name or value == f.dtype:
            return f
    raise ValueError(f"Invalid warmup_dtype: {value!r} (must be torch.float32 or torch.bfloat16, or their names)")
