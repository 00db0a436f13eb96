"""What the warm-up's average puts on the wire: one format per ``warmup_dtype``.

The warm-up averages every rank's gradient with one all-reduce (``comm.average_``). A format
says what tensor travels (``encode``) and how the averaged tensor comes back into the caller's
float32 buffer (``decode_``): float32 sends the buffer itself, bfloat16 a rounded copy of it, half
the bytes, summed and divided in bfloat16 (its rounding is not carried into the next step:
``docs/optimizers.md`` measures what that costs). Chosen once, by name or dtype, at construction
(``wire_format``); the name is what a saved state records.

The quantised average is the third kind (``compression.blockwise``: ``INT8``, ``INT4``, ``INT2``),
which keeps error buffers and runs its own collective (``comm.quantized_average_``).
``warmup_format`` resolves every name, ``"float32"`` to ``"int2"``: what the optimizers' ``warmup_dtype``
takes; ``wire_format`` the two float formats alone (what an all-reduce without error buffers,
such as DDP's hook, can send). Every format says what it costs on the wire: ``bytes_per_element``
and ``wire_bytes(numel)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Union

import torch

from onebitlamb.compression.blockwise import CODECS, BlockwiseCodec


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

    @property
    def bytes_per_element(self) -> int:
        """Wire bytes an element: the dtype's size."""
        return torch.empty(0, dtype=self.dtype).element_size()

    def wire_bytes(self, numel: int) -> int:
        """Bytes ``numel`` elements take in this format."""
        return numel * self.bytes_per_element


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


def warmup_format(value: Union[str, torch.dtype, WireFormat, BlockwiseCodec]) -> Union[WireFormat, BlockwiseCodec]:
    """Any format the warm-up's average can travel in: a float ``WireFormat`` (by name or dtype, as
    ``wire_format``) or a ``BlockwiseCodec`` (by name: ``"int8"``, ``"int4"``, ``"int2"``); ValueError
    naming the value and every accepted name otherwise."""
    if isinstance(value, (WireFormat, BlockwiseCodec)):
        return value
    if isinstance(value, str) and value in CODECS:
        return CODECS[value]
    try:
        return wire_format(value)
    except ValueError:
        names = ", ".join([*WIRE_FORMATS, *CODECS])
        raise ValueError(f"Invalid warmup_dtype: {value!r} (must be one of {names})") from None
