"""The float wire formats: float32 and bfloat16, the codecs without error feedback.

The warm-up averages every rank's gradient with one all-reduce (``comm.average_``). A format
says what tensor travels (``to_wire_``, also ``encode``) and how the averaged tensor comes back
into the caller's float32 buffer (``from_wire``, also ``decode_``): float32 sends the buffer itself,
bfloat16 a rounded copy of it, half the bytes, summed and divided in bfloat16 (its rounding is not
carried into the next step: ``docs/optimizers.md`` measures what that costs). Chosen once, by name
or dtype, at construction; the name is what a saved state records. Both implement
``compression.codec.Codec`` and are registered under their names and their dtypes.

``warmup_format`` resolves every registered codec (``"float32"``, ``"bfloat16"``, the blockwise
``"int8"`` to ``"int2"``, and any codec registered since): what the optimizers' ``warmup_dtype``
takes. ``wire_format`` resolves the codecs without error feedback alone: what one all-reduce without
error buffers can send (``comm.average_``, and DDP's hook bucket by bucket through it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, Union

import torch

from onebitlamb.compression.codec import Codec, codec_for, codec_names, register_codec


@dataclass(frozen=True)
class WireFormat:
    """Values sent as ``dtype`` and summed by the network in it: no error buffers."""

    name: str
    dtype: torch.dtype

    carries_error: ClassVar[bool] = False
    block: ClassVar[int] = 1

    def to_wire_(self, y: torch.Tensor) -> torch.Tensor:
        """The tensor to all-reduce: ``y`` itself when it is already of this dtype, else a rounded
        copy (``y`` is left as it is: nothing is kept)."""
        return y if y.dtype == self.dtype else y.to(self.dtype)

    def from_wire(self, message: torch.Tensor, numel: int, *, divisor: int = 1,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The float32 values, ``(rows, numel)``, or ``out`` filled with them (nothing to do when the
        message is ``out`` itself: float32 averaged in place)."""
        if divisor != 1:
            message = message.to(torch.float32) / divisor
        if out is None:
            return message.to(torch.float32).reshape(-1, numel)
        return out if message is out else out.copy_(message.reshape_as(out))

    # the names the all-reduce used before the Codec protocol, kept for the callers that use them
    encode = to_wire_

    def decode_(self, averaged: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` <- the averaged wire tensor: ``from_wire`` into ``out``."""
        return self.from_wire(averaged, averaged.numel(), out=out)

    @property
    def bytes_per_element(self) -> int:
        """Wire bytes an element: the dtype's size."""
        return torch.empty(0, dtype=self.dtype).element_size()

    def wire_bytes(self, numel: int) -> int:
        """Bytes ``numel`` elements take in this format."""
        return numel * self.bytes_per_element


FLOAT32 = register_codec(WireFormat("float32", torch.float32), torch.float32)
BFLOAT16 = register_codec(WireFormat("bfloat16", torch.bfloat16), torch.bfloat16)
WIRE_FORMATS: Dict[str, WireFormat] = {f.name: f for f in (FLOAT32, BFLOAT16)}


def warmup_format(value: Union[str, torch.dtype, Codec]) -> Codec:
    """Any codec the warm-up's average can travel in, by name or dtype (``codec_for``), or a codec
    itself; ValueError naming the value and every accepted name otherwise."""
    try:
        return codec_for(value)
    except ValueError:
        raise ValueError(f"Invalid warmup_dtype: {value!r} (must be one of {', '.join(codec_names())})") from None


def wire_format(value: Union[str, torch.dtype, Codec]) -> Codec:
    """A codec without error feedback (``float32``/``torch.float32``, ``bfloat16``/``torch.bfloat16``):
    what an all-reduce that keeps no error buffers can send; ValueError naming the value otherwise."""
    try:
        codec = codec_for(value)
    except ValueError:
        codec = None
    if codec is None or codec.carries_error:
        names = ", ".join(name for name in codec_names() if not codec_for(name).carries_error)
        raise ValueError(f"Invalid warmup_dtype: {value!r} (must be a format without error buffers: one of {names}, "
                         f"or its torch dtype)")
    return codec
