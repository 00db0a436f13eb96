"""What every codec is, and how one is chosen by name: the ``Codec`` protocol and the registry.

A codec says how float32 values travel: which tensor goes on the wire for them (``to_wire_``),
what the receiver gets back (``from_wire``), and what that costs (``wire_bytes``). The library's
collectives ask it nothing else, so they never need to know which codec they move:

- a codec **without error feedback** (``carries_error`` False: the float32 and bfloat16 wire
  formats, ``compression.wire``) sends a float tensor that the network sums: the warm-up averages
  it with one all-reduce (``comm.average_``), and DDP's hook can send it;
- a codec **with error feedback** (``carries_error`` True: the blockwise int8/int4/int2 codes,
  ``compression.blockwise``) sends codes that do not add up on the wire: each receiver decodes
  and sums them (``comm.quantized_average_``, the two-phase average), and what the code leaves out
  of a call is kept in a float32 error buffer, one element for each element encoded, and added to
  the next call's input. The sizes of those buffers follow from the layout the average encodes
  (``comm.quantized_error_sizes``), which lays every tensor out from the start of one of the
  codec's ``block``s.

The 1-bit code of the compression stage (``compression.onebit.ONEBIT``: the signs of a row and one
scale) is a codec with error feedback too; ``comm.compressed_allreduce`` runs its own fused kernels
on the same message layout, and the cost model asks it for its bytes.

A codec is chosen by name (what ``warmup_dtype``, a command line or a saved state carries) through
the registry: ``register_codec`` makes a name (and aliases such as a dtype) resolve to a codec,
``codec_for`` resolves it. The library's codecs register themselves when ``onebitlamb.compression``
is imported. Adding one is a module that defines it and calls ``register_codec`` (docs/algorithm.md,
"Adding a codec").
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Protocol, Tuple, TypeVar, Union, runtime_checkable

import torch


@runtime_checkable
class Codec(Protocol):
    """How float32 values travel. Frozen values, compared by value: a codec is a setting, and it is
    pickled with an optimizer's exchange."""

    @property
    def name(self) -> str:
        """What names it: ``warmup_dtype``, ``--warmup-dtype``, a saved state's ``param_groups``."""

    @property
    def carries_error(self) -> bool:
        """Whether it keeps what its code leaves out (error feedback). True: its average is the
        two-phase one, with a float32 error buffer per phase; False: its wire tensor is summed by
        one all-reduce, so it must be a float tensor holding the values themselves."""

    @property
    def block(self) -> int:
        """Elements the codec encodes as a unit (that share a scale, or a byte): the two-phase
        average starts every tensor on a block of its own, so that no tensor is sent at its
        neighbour's scale, and cuts the chunks into whole blocks. 1 where each element travels on
        its own."""

    @property
    def bytes_per_element(self) -> float:
        """Wire bytes an element of a long segment, per-segment overheads left out: the rate at
        which the cost model prices a model (``wire_bytes(n) / n`` as ``n`` grows)."""

    def wire_bytes(self, numel: int) -> int:
        """Bytes one encoded segment of ``numel`` elements takes on the wire, exactly: what
        ``CommStats`` counts for it."""

    def to_wire_(self, y: torch.Tensor) -> torch.Tensor:
        """The tensor to send for ``y``: float32, ``(c,)`` or ``(rows, c)`` with each row a segment
        of its own, contiguous. Returns ``(rows, ...)``, each row ``wire_bytes(c)`` bytes (without
        error feedback it may be ``y`` itself, shaped as ``y``). With error feedback ``y`` is left
        holding what the code left out; and if any value of ``y`` cannot be encoded (NaN, an
        infinity, an overflow), every row is sent so that it decodes to non-finite values, so that
        every receiver sees the failure (``y`` is then unspecified: callers encode a copy)."""

    def from_wire(self, message: torch.Tensor, numel: int, *, divisor: int = 1,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The float32 values of ``message``'s rows, ``(rows, numel)``, each divided by ``divisor``
        as this codec divides (the scales where it has them, as the 1-bit server divides its
        scales: then no sum of ``n`` terms overflows where the values did not); written into
        ``out`` (any shape of that many elements, returned) when given."""


C = TypeVar("C", bound=Codec)

#: Every key (a codec's name, or an alias such as a dtype) -> its codec; names in registration order.
_BY_KEY: Dict[Hashable, Codec] = {}
_NAMES: Dict[str, Codec] = {}


def register_codec(codec: C, *aliases: Hashable) -> C:
    """Make ``codec`` resolve from its name (and from each alias, e.g. ``torch.bfloat16``) in
    ``codec_for``; returns it, so a module can write ``INT8 = register_codec(BlockwiseCodec(8))``.
    Registering an equal codec again is a no-op; a name or alias that already names another codec
    is a ValueError (a saved state names its codec: one name, one meaning)."""
    if not isinstance(codec, Codec):
        missing = [m for m in ("name", "carries_error", "block", "bytes_per_element", "wire_bytes", "to_wire_",
                               "from_wire") if not hasattr(codec, m)]
        raise TypeError(f"{codec!r} is not a Codec: it lacks {', '.join(missing)} (onebitlamb.compression.codec)")
    keys = (codec.name, *aliases)
    for key in keys:
        held = _BY_KEY.get(key)
        if held is not None and held != codec:
            raise ValueError(f"{key!r} already names the codec {held!r}; unregister it first or pick another name")
    for key in keys:
        _BY_KEY[key] = codec
    _NAMES[codec.name] = codec
    return codec


def unregister_codec(codec: Union[str, Codec]) -> None:
    """Forget a codec (by name or itself) and its aliases: for plug-ins and tests that come and go."""
    name = codec if isinstance(codec, str) else codec.name
    held = _NAMES.pop(name, None)
    for key in [k for k, c in _BY_KEY.items() if c is held]:
        del _BY_KEY[key]


def codec_names() -> Tuple[str, ...]:
    """The registered codecs' names, in registration order."""
    return tuple(_NAMES)


def codec_for(value: Union[str, torch.dtype, Codec, Any]) -> Codec:
    """The codec ``value`` names (a registered name or alias), or ``value`` itself when it is a
    codec (registered or not: a codec built for one run needs no name); ValueError naming the value
    and every registered name otherwise."""
    if isinstance(value, Codec):
        return value
    try:
        return _BY_KEY[value]
    except (KeyError, TypeError):  # TypeError: unhashable
        raise ValueError(f"Unknown codec: {value!r} (must be one of {', '.join(_NAMES)})") from None


def decoded_into(decoded: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``from_wire``'s last line for codecs that decode into a new tensor: ``decoded``, or ``out``
    filled with it."""
    return decoded if out is None else out.copy_(decoded.reshape_as(out))
