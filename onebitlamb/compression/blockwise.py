"""The error-feedback k-bit blockwise codec: what the warm-up's quantised average does to a buffer.

A segment of ``c`` elements is cut into blocks of ``block`` elements (the last one shorter when
``c`` is not a multiple). Each block travels as one float32 *step* and one ``bits``-bit code per
element::

    a     = max |y| over the block                       (0 for an all-zero block)
    step  = a / qmax, qmax = 2**(bits-1) - 1             (127, 7, 1 for 8, 4, 2 bits)
            moved one float32 down when qmax * step > a  (so that no code decodes above a)
    q     = clamp(round(y / step), -qmax, qmax)          (round half to even; q = 0 where step = 0)
    y^    = q * step                                     (what every receiver decodes)
    error = y - y^                                       (exact in float32, |error| <= step / 2)

``y`` is the input plus the error kept from the last call, so what one call rounds away is sent by
the next (docs/algorithm.md, "The warm-up's quantised average"). Codes travel as offset binary,
``q + 2**(bits-1)``, packed most significant first: one per byte at 8 bits, two at 4, four at 2
(the 2-bit code is ternary: -1, 0, +1; its fourth value is never sent).

Non-finite input: a block holding a NaN or an infinity gets a non-finite step (the maximum
propagates NaN); ``quantize_`` then leaves its input as it was and the caller decides (the
collective raises ``FloatingPointError`` on every rank, as the 1-bit one does). Huge input: ``a``
is exact, ``step <= a / qmax`` and every decoded value ``|y^| <= a``, so nothing overflows up to
float32's maximum; no reciprocal of the step is formed (a tiny step's would overflow). A step that
underflows to 0 (a block whose maximum is below ``qmax * 2**-149``) sends zeros and keeps the whole
block in the error.

On the wire (``to_wire_``, ``from_wire``: the ``compression.codec.Codec`` protocol) a segment is one
message: its float32 steps, then its packed codes, ``wire_bytes(c)`` bytes.

Pure torch, the same code on CPU and CUDA; float32 only. ``onebitlamb.comm.quantized`` moves the
messages; this module never communicates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, Tuple, Union

import torch

from onebitlamb.compression.codec import decoded_into, register_codec

#: Elements per block (per float32 step). The step costs 32/B bits an element: 0.125 at 256, 1.6%
#: of the 8-bit code, 3% of the 4-bit one; smaller blocks cut the error slowly (docs/algorithm.md
#: measures it: 1.3x less at 32 for 8x the overhead), larger ones save under 1% of the bytes.
BLOCK = 256
SUPPORTED_BITS = (2, 4, 8)


@dataclass(frozen=True)
class BlockwiseCodec:
    """``bits`` bits an element plus a float32 step per ``block`` elements, with error feedback.

    ``name`` (``"int8"``, ``"int4"``, ``"int2"``; a block other than ``BLOCK`` adds ``"-b<block>"``)
    is what a command line or a saved state would carry (``compression.wire.warmup_format``).
    A ``compression.codec.Codec`` with error feedback.
    """

    bits: int = 8
    block: int = BLOCK

    carries_error: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS} (a whole number of codes per byte), "
                             f"got {self.bits!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be an integer >= 1, got {self.block!r}")

    # ------------------------------------------------------------------ sizes
    @property
    def name(self) -> str:
        return f"int{self.bits}" if self.block == BLOCK else f"int{self.bits}-b{self.block}"

    @property
    def qmax(self) -> int:
        """The largest code magnitude: ``2**(bits-1) - 1``."""
        return (1 << (self.bits - 1)) - 1

    @property
    def bytes_per_element(self) -> float:
        """Wire bytes an element for long segments: ``bits/8 + 4/block`` (the code and its share of
        the block's float32 step)."""
        return self.bits / 8 + 4 / self.block

    def num_blocks(self, numel: int) -> int:
        """Blocks (float32 steps) in a segment of ``numel`` elements."""
        return -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        """Bytes of the packed codes of ``numel`` elements."""
        return -(-numel * self.bits // 8)

    def wire_bytes(self, numel: int) -> int:
        """Bytes one encoded segment of ``numel`` elements takes: its steps and its packed codes."""
        return 4 * self.num_blocks(numel) + self.code_bytes(numel)

    # ------------------------------------------------------------------ the codec
    def quantize_(self, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Encode ``y`` and leave in it what the code left out; returns ``(codes, steps)``.

        ``y``: float32, ``(c,)`` or ``(rows, c)`` with each row a segment of its own, contiguous.
        ``codes``: uint8 ``(rows, code_bytes(c))``; ``steps``: float32 ``(rows, num_blocks(c))``
        (a 1-D ``y`` gives ``rows = 1``). Afterwards ``y`` holds ``y - decode(codes, steps, c)``,
        exactly. If any step is not finite, ``y`` is left unchanged and the codes are zeros.
        """
        _check_float32(y, "y")
        rows, c = _rows(y)
        y2 = y.view(rows, c)
        blocks, padded = self._blocks(y2)
        absmax = blocks.abs().amax(dim=-1)                     # (rows, nb); NaN propagates
        steps = absmax / self.qmax
        steps = torch.where(steps * self.qmax > absmax, torch.nextafter(steps, torch.zeros_like(steps)), steps)
        divisor = torch.where(steps > 0, steps, torch.ones_like(steps)).unsqueeze(-1)
        # + 0.0 turns a -0.0 quotient into +0.0: the code 0 decodes as +0.0, and so must the error's
        q = torch.round(blocks / divisor).clamp_(-self.qmax, self.qmax).add_(0.0)
        if not bool(torch.isfinite(steps).all()):
            return torch.zeros(rows, self.code_bytes(c), dtype=torch.uint8, device=y.device), steps
        blocks.sub_(q * steps.unsqueeze(-1))                     # the error, exact (Sterbenz)
        if padded:
            y2.copy_(blocks.view(rows, -1)[:, :c])
        codes = self._pack(q.view(rows, -1)[:, :c])
        return codes, steps

    def encode(self, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(codes, steps)`` of ``y`` (left untouched); see ``quantize_``."""
        return self.quantize_(y.clone() if y.dim() == 1 else y.contiguous().clone())

    def decode(self, codes: torch.Tensor, steps: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 ``(rows, numel)`` that ``codes`` (uint8 ``(rows, code_bytes(numel))``, rows
        may be strided) and ``steps`` (float32 ``(rows, num_blocks(numel))``) encode:
        ``q * step`` an element, the same bits on every device."""
        codes2 = codes.reshape(-1, codes.shape[-1])
        rows = codes2.shape[0]
        nb = self.num_blocks(numel)
        if codes2.dtype != torch.uint8 or codes2.shape[1] != self.code_bytes(numel):
            raise ValueError(f"{numel} elements at {self.bits} bits need uint8 rows of {self.code_bytes(numel)} "
                             f"bytes, got {codes2.dtype} rows of {codes2.shape[1]}")
        steps2 = steps.reshape(rows, -1)
        if steps2.dtype != torch.float32 or steps2.shape[1] != nb:
            raise ValueError(f"{numel} elements in blocks of {self.block} need {nb} float32 steps a row, got "
                             f"{steps2.dtype} rows of {steps2.shape[1]}")
        q = self._unpack(codes2, numel)                          # (rows, numel) float32, exact integers
        if numel % self.block:
            full = torch.zeros(rows, nb * self.block, dtype=torch.float32, device=q.device)
            full[:, :numel] = q
            q = full
        out = q.reshape(rows, nb, self.block).mul_(steps2.unsqueeze(-1))
        return out.view(rows, -1)[:, :numel] if numel % self.block else out.view(rows, numel)

    def compress_(self, values: torch.Tensor, error: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Error feedback: encode ``values + error`` and keep in ``error`` what the code left out
        (``values + error == decode(...) + new error`` in float32). Both 1-D float32 of one size;
        ``values`` is not modified. If a step is not finite, ``error`` is left unchanged."""
        _check_float32(values, "values")
        _check_float32(error, "error")
        if values.dim() != 1 or error.shape != values.shape:
            raise ValueError(f"values and error must be 1-D of one size, got {tuple(values.shape)} and "
                             f"{tuple(error.shape)}")
        y = values + error
        codes, steps = self.quantize_(y)
        if bool(torch.isfinite(steps).all()):
            error.copy_(y)
        return codes, steps

    # ------------------------------------------------------------------ on the wire
    def to_wire_(self, y: torch.Tensor) -> torch.Tensor:
        """Each row of ``y`` (``quantize_``'s shapes) as one uint8 message, ``[steps | codes]``,
        ``wire_bytes(c)`` bytes; ``y`` left holding the error. A non-finite step anywhere makes
        every step NaN, so that every receiver of any row sees it (``y`` is then left unchanged)."""
        codes, steps = self.quantize_(y)
        if not bool(torch.isfinite(steps).all()):
            steps.fill_(float("nan"))
        return torch.cat([steps.contiguous().view(torch.uint8), codes], dim=1)

    def from_wire(self, message: torch.Tensor, numel: int, *, divisor: int = 1,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The ``(rows, numel)`` float32 values of ``to_wire_``'s messages; with ``divisor``, each
        ``q * (step / divisor)``; into ``out`` when given."""
        rows = message.reshape(-1, message.shape[-1])
        head = 4 * self.num_blocks(numel)
        steps = rows[:, :head].contiguous().view(torch.float32)  # a copy: aligned for float32
        if divisor != 1:
            steps = steps / divisor
        return decoded_into(self.decode(rows[:, head:], steps, numel), out)

    # ------------------------------------------------------------------ internals
    def _blocks(self, y2: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """``(rows, nb, block)`` over ``y2``: a view, or a zero-padded copy when ``c`` is not a
        multiple of ``block`` (the padding's codes are 0 and never sent)."""
        rows, c = y2.shape
        nb = self.num_blocks(c)
        if c % self.block == 0:
            return y2.view(rows, nb, self.block), False
        padded = torch.zeros(rows, nb * self.block, dtype=y2.dtype, device=y2.device)
        padded[:, :c] = y2
        return padded.view(rows, nb, self.block), True

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """Offset-binary codes (``q + 2**(bits-1)``) of ``(rows, c)`` integers held as floats,
        ``8/bits`` to a byte, most significant first."""
        rows, c = q.shape
        u = (q + (1 << (self.bits - 1))).to(torch.uint8)
        per = 8 // self.bits
        if per == 1:
            return u.contiguous()
        if c % per:
            u = torch.cat([u, torch.zeros(rows, per - c % per, dtype=torch.uint8, device=u.device)], dim=1)
        u = u.view(rows, -1, per)
        out = u[:, :, 0] << (8 - self.bits)
        for k in range(1, per):
            out |= u[:, :, k] << (8 - self.bits * (k + 1))
        return out

    def _unpack(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        """``(rows, numel)`` float32 integers ``q`` from packed offset-binary codes."""
        rows = codes.shape[0]
        per = 8 // self.bits
        if per == 1:
            u = codes
        else:
            mask = (1 << self.bits) - 1
            u = torch.stack([(codes >> (8 - self.bits * (k + 1))) & mask for k in range(per)], dim=-1)
            u = u.view(rows, -1)[:, :numel]
        return u.to(torch.float32, memory_format=torch.contiguous_format).sub_(1 << (self.bits - 1))


def _check_float32(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (the blockwise codec quantises float32 buffers), got {t.dtype}")


def _rows(y: torch.Tensor) -> Tuple[int, int]:
    if y.dim() not in (1, 2) or not y.is_contiguous():
        raise ValueError(f"y must be a contiguous 1-D or 2-D tensor, got shape {tuple(y.shape)}")
    return (1, y.shape[0]) if y.dim() == 1 else (y.shape[0], y.shape[1])


INT8 = register_codec(BlockwiseCodec(8))
INT4 = register_codec(BlockwiseCodec(4))
INT2 = register_codec(BlockwiseCodec(2))
CODECS: Dict[str, BlockwiseCodec] = {c.name: c for c in (INT8, INT4, INT2)}


def blockwise_codec(value: Union[str, int, BlockwiseCodec]) -> BlockwiseCodec:
    """The codec a name (``"int8"``, ``"int4"``, ``"int2"``), a number of bits (8, 4, 2) or a codec
    names; ValueError naming the value otherwise."""
    if isinstance(value, BlockwiseCodec):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        for c in CODECS.values():
            if c.bits == value:
                return c
    if isinstance(value, str) and value in CODECS:
        return CODECS[value]
    raise ValueError(f"Invalid blockwise codec: {value!r} (must be one of {', '.join(CODECS)}, or 8, 4 or 2 bits)")
