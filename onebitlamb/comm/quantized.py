"""The warm-up's quantised average: a two-phase all-reduce of codes with error feedback, the shape
of the 1-bit ``collectives.compressed_allreduce``, for any codec that carries an error
(``compression.codec.Codec``: the blockwise int8/int4/int2 codes of ``compression.blockwise`` and any
codec registered since). The maths below is the blockwise codec's (codes ``q``, a step ``s`` per
block); another codec puts its own ``to_wire_`` and ``from_wire`` in their place.

For ``n`` ranks each holding ``values_i`` of ``d`` elements, ``D = padded_size(d, n)`` (the 1-bit
all-reduce's padding: a multiple of ``8n``) cut into ``n`` chunks of ``c = D/n``, each a segment of
blocks of its own::

    worker  y_i = values_i + e_w (zero-padded to D)    codes q_i, steps s_i of each chunk; e_w = y_i - q_i s_i
    (all-to-all: chunk j of every rank's codes and steps goes to rank j)
    server  z_j = e_s + sum_i q_i (s_i / n)            (chunk j; float32, in rank order)
            codes q'_j, steps s'_j of z_j;              e_s = z_j - q'_j s'_j
    (all-gather of every server's codes' and steps')
    result  chunk j = q'_j s'_j, decoded by every rank from the same bytes: bit-identical everywhere

The worker error has ``d`` elements (its padding would always be 0), the server error ``c``
(``quantized_error_sizes``). Flat process groups only: this module knows nothing of node groups.

``segments`` (the sizes of the tensors laid one after another in ``values``, as an optimizer's flat
layout holds its parameters) makes every tensor start a block of its own: a block's step is its
absolute maximum over ``qmax``, so a tensor whose values are a thousand times smaller than its
neighbour's would otherwise share that neighbour's step and be sent as noise around zero (the
error feedback keeps its mean, not its square, which Adam's variance reads). The values are laid
out with each segment padded to a whole number of blocks and the whole to ``n`` chunks of whole
blocks (``aligned_positions``); the padding is zero, its codes 0 and its errors stay 0, and the
two phases run on that layout unchanged.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from onebitlamb.comm import collectives as flat
from onebitlamb.comm.stats import GLOBAL_STATS, CommStats, all_gather_bytes, all_to_all_bytes
from onebitlamb.compression.blockwise import INT8, SUPPORTED_BITS, blockwise_codec
from onebitlamb.compression.codec import Codec, codec_for, codec_names

CodecLike = Union[str, int, Codec]


def _codec(value: CodecLike) -> Codec:
    """A codec, its registered name, or (the blockwise codecs) its bits; ValueError naming the value
    and what is accepted otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value in SUPPORTED_BITS:
        return blockwise_codec(value)
    try:
        return codec_for(value)
    except ValueError:
        names = ", ".join(n for n in codec_names() if codec_for(n).carries_error)
        bits = ", ".join(str(b) for b in sorted(SUPPORTED_BITS, reverse=True))
        raise ValueError(f"Invalid blockwise codec: {value!r} (the quantised average takes a codec with error feedback "
                         f"or its name: {names}; or a blockwise codec's bits: {bits})") from None


def _checked_segments(segments: Optional[Sequence[int]], numel: int) -> Optional[Tuple[int, ...]]:
    if segments is None:
        return None
    segments = tuple(int(s) for s in segments)
    if any(s < 0 for s in segments) or sum(segments) != numel:
        raise ValueError(f"segments must be sizes >= 0 that sum to the {numel} values, got {list(segments)[:8]}"
                         f"{'...' if len(segments) > 8 else ''} (sum {sum(segments)})")
    return segments


@functools.lru_cache(maxsize=64)
def _aligned(segments: Tuple[int, ...], block: int) -> Tuple[torch.Tensor, int]:
    starts, position = [], 0
    for size in segments:
        starts.append(position)
        position += -(-size // block) * block
    index = torch.cat([torch.arange(s, s + size, dtype=torch.int64) for s, size in zip(starts, segments)]) \
        if segments else torch.zeros(0, dtype=torch.int64)
    return index, position


def aligned_positions(segments: Sequence[int], world_size: int, block: int) -> Tuple[torch.Tensor, int]:
    """Where each of the ``sum(segments)`` values sits when every segment starts a block of ``block``
    elements, and the length of that layout: the segments padded to whole blocks, the whole padded
    to ``n`` chunks of whole blocks (a multiple of ``n * block``, so no block straddles a chunk)."""
    index, length = _aligned(tuple(int(s) for s in segments), block)
    return index, -(-length // (world_size * block)) * (world_size * block)


def quantized_error_sizes(numel: int, world_size: int, segments: Optional[Sequence[int]] = None,
                          codec: CodecLike = INT8) -> Tuple[int, int]:
    """``(worker, server)``: the elements of the two error buffers ``quantized_average_`` keeps for a
    tensor of ``numel`` elements over ``world_size`` ranks: ``(numel, padded_size(numel, n) / n)``, on
    one rank too (where nothing is sent and they are never touched); with ``segments``, the server's
    chunk of the aligned layout (``aligned_positions``, whose block is the codec's)."""
    D = flat.padded_size(numel, world_size)  # checks both arguments
    segments = _checked_segments(segments, numel)
    if segments is not None:
        _, D = aligned_positions(segments, world_size, _codec(codec).block)
    return numel, D // world_size


def quantized_wire_bytes(numel: int, world_size: int, codec: CodecLike = INT8,
                         segments: Optional[Sequence[int]] = None) -> int:
    """Bytes a rank sends in one ``quantized_average_`` of ``numel`` elements over ``world_size`` ranks,
    as ``CommStats`` counts them: ``2 (n-1)`` messages of ``codec.wire_bytes(c)``, ``c = D/n`` (0 on one
    rank or for an empty tensor); with ``segments``, ``c`` the aligned layout's chunk."""
    codec = _codec(codec)
    _, c = quantized_error_sizes(numel, world_size, segments, codec)
    if world_size == 1 or numel == 0:
        return 0
    return 2 * (world_size - 1) * codec.wire_bytes(c)


def _check(values: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, n: int) -> None:
    for name, t in (("values", values), ("worker_error", worker_error), ("server_error", server_error)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (the quantised average works on float32 buffers), got {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
        if t.device != values.device:
            raise ValueError(f"values, worker_error and server_error must be on one device, got {values.device} "
                             f"and {t.device} ({name})")
    worker, server = quantized_error_sizes(values.numel(), n)
    if worker_error.numel() != worker or server_error.numel() != server:
        raise ValueError(f"with {n} ranks and {values.numel()} values, worker_error must have {worker} elements and "
                         f"server_error {server} (quantized_error_sizes({values.numel()}, {n})); got "
                         f"{worker_error.numel()} and {server_error.numel()}")


def _bad_rows(decoded: torch.Tensor):
    """The rows holding a non-finite value: a codec sends every row of a failed encoding so."""
    return torch.nonzero(~torch.isfinite(decoded).all(dim=1)).flatten().tolist()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quantized_average_(values: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                       group: Optional[dist.ProcessGroup] = None, stats: Optional[CommStats] = None,
                       codec: CodecLike = INT8,
                       segments: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The error-compensated quantised average of ``values`` over the group, in place.

    Args:
        values: 1-D float32, any size ``d``; overwritten with the average, bit-identical on every rank.
        worker_error: this rank's worker error, ``d`` elements (``quantized_error_sizes``); updated.
        server_error: this rank's server error, ``padded_size(d, n) / n`` elements; updated.
        group: the process group (default: the world).
        stats: where the bytes sent are recorded (default: ``onebitlamb.comm.GLOBAL_STATS``), as
            ``"all_to_all"`` and ``"all_gather"``, as the 1-bit all-reduce records them.
        codec: a codec with error feedback (``compression.codec.Codec``), its registered name
            (``"int8"``, ``"int4"``, ``"int2"``, ...) or, for the blockwise ones, its bits.
        segments: the sizes of the tensors ``values`` holds one after another; each then starts a
            block of its own (the module's docstring), and ``server_error`` is the aligned
            layout's chunk (``quantized_error_sizes(d, n, segments, codec)``). None: one segment.

    Two collectives, as ``compressed_allreduce``: an ``all_to_all_single`` giving rank ``j`` chunk
    ``j`` of every rank's codes (each message the codec's ``to_wire_`` of its chunk: for the blockwise
    codecs its float32 steps followed by its packed codes), then an all-gather of every server's
    message. The server sums the decoded chunks in float32, in rank order, each decoded divided by
    ``n`` as the codec divides (``from_wire``: ``q * (step / n)``). Bytes a rank sends:
    ``quantized_wire_bytes``.

    Raises ``FloatingPointError`` on every rank alike when any rank's ``values + worker_error`` holds
    a NaN or an infinity (or overflows float32), or a server's sum overflows float32, leaving
    ``values`` and every rank's errors as they were (the optimizer agrees on finite gradients before
    an exchange; this is the backstop, as in the 1-bit all-reduce). With one rank, no initialised
    process group, or ``d = 0``: nothing is sent and ``values`` is returned unchanged.
    """
    codec = _codec(codec)
    if not codec.carries_error:
        raise ValueError(f"quantized_average_ averages codes with error feedback; {codec.name!r} carries no error: "
                         f"its average is one all-reduce (comm.average_)")
    n = flat.world_size_of(group)
    segments = _checked_segments(segments, values.numel())
    if segments is None:
        _check(values, worker_error, server_error, n)
    elif n > 1 and values.numel() > 0:
        return _aligned_average_(values, worker_error, server_error, group, stats, codec, segments, n)
    d = values.numel()
    if n == 1 or d == 0:
        return values
    stats = stats or GLOBAL_STATS
    D = flat.padded_size(d, n)
    c = D // n

    # Worker: y = values + e_w over the padded buffer; each chunk a segment of its own.
    y = torch.zeros(D, dtype=torch.float32, device=values.device)
    torch.add(values, worker_error, out=y[:d])
    send = codec.to_wire_(y.view(n, c))  # y now holds the new worker error, if it could be encoded
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    stats.record("all_to_all", all_to_all_bytes(_nbytes(send), n))
    received = codec.from_wire(recv, c, divisor=n)  # every rank's chunk, each divided by n
    bad = _bad_rows(received)
    if bad:
        raise FloatingPointError(f"quantized_average_: the values (plus worker error) of rank(s) {bad} hold NaN "
                                 f"or infinite values, or overflowed float32")

    # Server: z = e_s + the average of this chunk of every rank's decoded values; encode again.
    z = server_error.clone()
    for i in range(n):
        z.add_(received[i])
    mine = codec.to_wire_(z.view(1, c))[0]  # z now holds the new server error, if it could be encoded
    result = torch.empty(n, mine.numel(), dtype=mine.dtype, device=values.device)
    flat._all_gather_single(result.view(-1), mine, group=group)
    stats.record("all_gather", all_gather_bytes(_nbytes(mine), n))
    averaged = codec.from_wire(result, c)
    bad = _bad_rows(averaged)
    if bad:
        raise FloatingPointError(f"quantized_average_: the server sum of chunk(s) {bad} overflowed float32")

    # Every check passed on every rank: commit the errors and the result.
    worker_error.copy_(y[:d])
    server_error.copy_(z)
    values.copy_(averaged.reshape(-1)[:d])
    return values


def _aligned_average_(values: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                      group: Optional[dist.ProcessGroup], stats: Optional[CommStats], codec: Codec,
                      segments: Tuple[int, ...], n: int) -> torch.Tensor:
    """``quantized_average_`` with every segment starting a block: the two phases on the aligned
    layout, the values and the worker error moved there and back (the padding holds zeros)."""
    index, length = aligned_positions(segments, n, codec.block)
    index = index.to(values.device)
    worker, server = quantized_error_sizes(values.numel(), n, segments, codec)
    if worker_error.numel() != worker or server_error.numel() != server:
        raise ValueError(f"with {n} ranks and segments of {values.numel()} values, worker_error must have {worker} "
                         f"elements and server_error {server} (quantized_error_sizes(d, n, segments, codec)); got "
                         f"{worker_error.numel()} and {server_error.numel()}")
    laid = torch.zeros(length, dtype=torch.float32, device=values.device)
    laid_error = torch.zeros(length, dtype=torch.float32, device=values.device)
    laid[index] = values
    laid_error[index] = worker_error
    quantized_average_(laid, laid_error, server_error, group, stats, codec)  # raises before changing anything
    worker_error.copy_(laid_error[index])
    values.copy_(laid[index])
    return values
