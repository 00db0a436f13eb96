"""An alpha-beta model of one training step on ``n`` hosts joined by links of rate ``R``.

    step = compute + codec + sum over the step's collectives of (alpha + wire_bytes * beta)
    beta = overhead * 8 / R  +  1 / host_Bps

- ``compute``: the measured step with no communication (forward, backward, optimizer maths);
- ``codec``: the 1-bit path's local work (compress, unpack, error updates), 0 for LAMB;
- ``alpha``: the fixed cost of one collective (a tiny all-reduce, measured);
- ``wire_bytes``: what this rank sends per collective, from the library's own formulas
  (``onebitlamb.comm.stats``): LAMB issues one ring all-reduce of ``4d`` bytes; the 1-bit path
  two collectives: an all-to-all of ``D/8`` sign bytes plus one 4-byte scale per message, and an
  all-gather of ``D/(8n)`` sign bytes plus a scale; its warm-up averages in its ``warmup_dtype``
  (``warmup_collectives``: LAMB's all-reduce in float32, half its bytes in bfloat16; the quantised
  average int8/int4/int2 two collectives shaped as the 1-bit ones, plus a finite flag);
- ``overhead``: link-layer bytes per payload byte (Ethernet, IP and TCP headers; the token
  bucket charges whole frames): ``(MSS + 66) / MSS`` for an MTU of 1500;
- ``host_Bps``: the rate at which the hosts move bytes through their own network stack when the
  link is not the limit (measured on the unshaped network; infinite by default).

Every link is full duplex and each rank's bytes leave on its own link, so a collective's time is
one rank's bytes over one link: a ring all-reduce of ``B`` bytes takes ``2 (n-1)/n B / R``.

``onebitlamb estimate`` puts it to use: the speed-up over LAMB to expect for a model size, a
number of ranks and a link rate, from a step's compute time (``estimate``); the benchmarks on
emulated hosts set it beside every step they measure (docs/netsim.md).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from onebitlamb.comm.collectives import padded_size
from onebitlamb.comm.stats import all_gather_bytes, all_to_all_bytes, allreduce_bytes
from onebitlamb.compression.codec import Codec, codec_names
from onebitlamb.compression.onebit import ONEBIT
from onebitlamb.compression.wire import warmup_format

MTU = 1500
TCP_IP_ETH_HEADERS = 14 + 20 + 20 + 12  # Ethernet, IPv4, TCP, TCP timestamps
MSS = MTU - 20 - 20 - 12
#: Frame bytes per payload byte of a bulk TCP transfer.
WIRE_OVERHEAD = (MSS + TCP_IP_ETH_HEADERS) / MSS


#: The optimizers' ``warmup_dtype`` names the library registers (``compression.codec``); ``--warmup-dtype``
#: takes every name registered when its parser is built.
WARMUP_DTYPES = codec_names()


def lamb_collectives(d: int, n: int) -> List[int]:
    """Bytes this rank sends per collective in a LAMB (or float32 warm-up) step: one fp32 all-reduce."""
    return [allreduce_bytes(4 * d, n)] if n > 1 else []


def quantized_message_bytes(d: int, n: int, warmup_dtype: Union[str, Codec]) -> int:
    """One message of the quantised warm-up average (``comm.quantized_average_``): a segment of
    ``c = D/n`` elements (``D = padded_size(d, n)``) at the codec's long-segment rate,
    ``ceil(codec.bytes_per_element * c)`` (``bits/8 + 4/256`` bytes an element: the code and its
    share of a block's float32 step). Per-tensor block padding is left out: once blocks align to
    parameter boundaries each tensor may add one partial block (at most a step and 255 codes), under
    1% for models whose tensors are much larger than 256 elements. With ``c`` a multiple of the block
    this is exactly ``codec.wire_bytes(c)``, what ``comm.quantized_wire_bytes`` counts."""
    codec = warmup_format(warmup_dtype)
    if not codec.carries_error:
        raise ValueError(f"{codec.name!r} is a float format, not a quantised one: it carries no error, and one "
                         f"all-reduce averages it (warmup_collectives)")
    return math.ceil(codec.bytes_per_element * (padded_size(d, n) // n))


def warmup_collectives(d: int, n: int, warmup_dtype: Union[str, Codec] = "float32") -> List[int]:
    """Bytes this rank sends per collective in a warm-up step, by ``warmup_dtype``.

    The codec decides by what it says of itself (``compression.codec.Codec``). float32 / bfloat16 (no
    error feedback): one ring all-reduce of its ``wire_bytes(d)``, ``4d`` / ``2d`` bytes, ``2 (n-1)/n``
    of it leaving the rank. int8 / int4 / int2 (error feedback, as any codec registered with it): the
    quantised average, priced as the 1-bit stage's two collectives: an
    all-to-all and an all-gather, each sending ``n - 1`` messages of ``quantized_message_bytes``, so
    about ``2 (n-1)/n * bytes_per_element * d`` in all (1.016, 0.516, 0.266 bytes an element), and
    the 4-byte finite flag every rank agrees on first (``finite_flag_collectives``)."""
    fmt = warmup_format(warmup_dtype)
    if n == 1:
        return []
    if not fmt.carries_error:
        return [allreduce_bytes(fmt.wire_bytes(d), n)]
    m = quantized_message_bytes(d, n, fmt)
    return finite_flag_collectives(n) + [all_to_all_bytes(n * m, n), all_gather_bytes(m, n)]


def onebit_collectives(d: int, n: int) -> List[int]:
    """Bytes this rank sends per collective in a compression-stage step (``compressed_allreduce``)."""
    if n == 1:
        return []
    message = ONEBIT.wire_bytes(padded_size(d, n) // n)  # one chunk's sign bytes and its float32 scale
    return [all_to_all_bytes(n * message, n), all_gather_bytes(message, n)]


def finite_flag_collectives(n: int) -> List[int]:
    """The 1-bit optimizers' compression step also agrees that every rank's gradient is finite:
    one float32 all-reduce."""
    return [allreduce_bytes(4, n)] if n > 1 else []


@dataclass
class Link:
    """``rate_bps`` None: unshaped (only ``host_Bps`` limits)."""

    rate_bps: Optional[float]
    alpha_s: float
    overhead: float = WIRE_OVERHEAD
    host_Bps: float = math.inf

    def seconds_per_byte(self) -> float:
        beta = 0.0 if self.rate_bps is None else self.overhead * 8.0 / self.rate_bps
        return beta + (0.0 if math.isinf(self.host_Bps) else 1.0 / self.host_Bps)

    def collective_s(self, nbytes: int) -> float:
        return self.alpha_s + nbytes * self.seconds_per_byte()


def predict_step(compute_s: float, collectives: List[int], link: Link, codec_s: float = 0.0) -> float:
    """Predicted step time: compute, plus the codec, plus each collective's alpha + bytes * beta."""
    return compute_s + codec_s + sum(link.collective_s(b) for b in collectives)


def comm_fraction(step_s: float, compute_s: float) -> float:
    """Share of a step not spent computing (communication and waiting for it)."""
    return max(0.0, step_s - compute_s) / step_s if step_s > 0 else 0.0


def end_to_end_speedup(lamb_step_s: float, warmup_step_s: float, compression_step_s: float,
                       warmup_fraction: float) -> float:
    """LAMB's time over the 1-bit optimizer's time for the same number of steps (samples), when a
    fraction ``warmup_fraction`` of the steps runs uncompressed."""
    if not 0.0 <= warmup_fraction <= 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1], got {warmup_fraction}")
    onebit = warmup_fraction * warmup_step_s + (1.0 - warmup_fraction) * compression_step_s
    return lamb_step_s / onebit


def volume_reduction(warmup_fraction: float, compression_ratio: float = 32.0, warmup_ratio: float = 1.0) -> float:
    """Whole-run bytes of LAMB over those of the 1-bit optimizer: ``1 / (w r_w + (1-w)/ratio)``,
    where ``r_w`` (``warmup_ratio``) is a warm-up step's bytes over a float32 (LAMB) step's: 1 for a
    float32 warm-up, 1/2 in bfloat16, about 0.254 / 0.129 / 0.066 for int8 / int4 / int2."""
    return 1.0 / (warmup_fraction * warmup_ratio + (1.0 - warmup_fraction) / compression_ratio)


# --- nodes of several ranks (the hierarchical all-reduce, ``onebitlamb.comm.hierarchy``) ---------
#
# ``N`` nodes of ``L`` ranks; each node has one network card on a link of rate ``R``, and its ranks
# reach each other through the node's own stack (loopback here) at ``host_Bps``. A collective now
# costs ``alpha + node_bytes * overhead * 8 / R + rank_bytes / host_Bps``: ``node_bytes`` are what
# the node's ranks together send across its card (they share it), ``rank_bytes`` what one rank
# moves through its own stack in all (to its node and beyond). With ``L = 1`` this is the model
# above. The byte counts are the library's (``onebitlamb.comm.stats``, docs/hierarchy.md).

@dataclass(frozen=True)
class NodeCollective:
    """One collective of a step on nodes: bytes across one node's card, and bytes one rank sends in
    all; ``intra``: it runs inside the node only (its latency is the node's, not the network's)."""

    node_bytes: int
    rank_bytes: int
    intra: bool = False


def node_onebit_collectives(d: int, nodes: int, local: int, hierarchical: bool) -> List[NodeCollective]:
    """A compression-stage step's collectives (the 1-bit all-reduce and the 4-byte finite flag)
    on ``nodes`` x ``local`` ranks, over the flat world group or over ``node_groups(local)``.

    Flat: each rank sends ``n - 1`` messages of ``m = D/(8n) + 4`` bytes per collective. In the
    all-to-all they go straight to their ranks, ``L (N-1)`` of them to other nodes, so a node's card
    carries ``L^2 (N-1) m``. gloo's all-gather is a ring over the ranks in order: each rank passes
    all ``n - 1`` messages to its right neighbour, and one edge of the ring leaves each node, so the
    card carries ``(n-1) m`` (measured on the emulated nodes: 7 m per node on 2 x 2, not 8 m).
    Hierarchical: an fp32 reduce-scatter and all-gather inside the node (``(L-1)/L * 4D`` bytes a
    rank each, no byte across nodes), and the exchange across nodes of a chunk of ``D/L``, whose
    messages are again ``m`` bytes, ``N - 1`` per rank: ``L (N-1) m`` across the card in each of
    its two collectives. So ``L`` times fewer than the flat all-to-all, ``(n-1)/(L (N-1))`` times
    fewer than the ring all-gather: 1.75x in all on 2 nodes x 2.
    """
    n = nodes * local
    if n == 1:
        return []
    D = padded_size(d, n)
    m = ONEBIT.wire_bytes(D // n)
    if not hierarchical or local == 1:
        return _flat_two_phase(m, nodes, local)
    flag, flag_node = _finite_flag(nodes, local)
    node_stage = all_to_all_bytes(4 * D, local)  # (L-1)/L * 4D, the same for the all-gather
    out = [NodeCollective(0, node_stage, intra=True)]
    if nodes > 1:
        cross = local * (nodes - 1) * m
        out += [NodeCollective(cross, (nodes - 1) * m), NodeCollective(cross, (nodes - 1) * m)]
    return out + [NodeCollective(0, node_stage, intra=True), NodeCollective(flag_node, flag)]


def _finite_flag(nodes: int, local: int) -> Tuple[int, int]:
    """The 4-byte finite flag's all-reduce: (bytes a rank sends, bytes across a node's card)."""
    flag = allreduce_bytes(4, nodes * local)
    return flag, (flag * local if nodes > 1 else 0)  # a few bytes; every rank's ring edge may cross


def _flat_two_phase(m: int, nodes: int, local: int) -> List[NodeCollective]:
    """An all-to-all and a ring all-gather over the flat world of ``nodes`` x ``local`` ranks, each
    rank sending ``n - 1`` messages of ``m`` bytes in each, then the 4-byte finite flag
    (``node_onebit_collectives`` derives the node bytes)."""
    n = nodes * local
    flag, flag_node = _finite_flag(nodes, local)
    ring = (n - 1) * m if nodes > 1 else 0
    return [NodeCollective(local * local * (nodes - 1) * m, (n - 1) * m), NodeCollective(ring, (n - 1) * m),
            NodeCollective(flag_node, flag)]


def node_warmup_collectives(d: int, nodes: int, local: int, hierarchical: bool,
                            warmup_dtype: Union[str, Codec] = "float32") -> List[NodeCollective]:
    """A warm-up step's average on ``nodes`` x ``local`` ranks, in ``warmup_dtype``.

    float32 / bfloat16 (no error feedback; ``b = 4`` / ``2`` bytes an element: ``wire_bytes``). Flat:
    one ring all-reduce over the world, ``2 (n-1)/n * b d`` bytes a rank; in a ring over node-ordered
    ranks one edge leaves each node, so the node's card carries one rank's bytes. Hierarchical
    (``allreduce_mean_`` with a ``NodeGroups``): reduce-scatter inside the node, a ring all-reduce of
    the ``c = ceil(d/L)`` elements of each chunk among the ``N`` ranks of its local index (``L`` of
    them share the card: ``L * 2 (N-1)/N * b c``, about ``2 (N-1)/N * b d``), and the node's all-gather.

    int8 / int4 / int2 (error feedback: the quantised average, flat only: the optimizers refuse it over
    node groups, so ``hierarchical`` with ``local > 1`` raises ValueError): the 1-bit stage's all-to-all and ring
    all-gather with messages of ``quantized_message_bytes`` (``warmup_collectives``), node bytes as
    in ``node_onebit_collectives``, and the finite flag.
    """
    fmt = warmup_format(warmup_dtype)
    n = nodes * local
    if fmt.carries_error:
        if hierarchical and local > 1:
            raise ValueError(f"the quantised warm-up ({fmt.name}) runs over the world group only: the optimizers "
                             f"refuse it over node_groups")
        return _flat_two_phase(quantized_message_bytes(d, n, fmt), nodes, local) if n > 1 else []
    if n == 1:
        return []
    if not hierarchical or local == 1:
        total = allreduce_bytes(fmt.wire_bytes(d), n)
        return [NodeCollective(total if nodes > 1 else 0, total)]
    c = -(-d // local)
    node_stage = all_to_all_bytes(fmt.wire_bytes(c * local), local)
    out = [NodeCollective(0, node_stage, intra=True)]
    if nodes > 1:
        total = allreduce_bytes(fmt.wire_bytes(c), nodes)
        out.append(NodeCollective(local * total, total))
    return out + [NodeCollective(0, node_stage, intra=True)]


def predict_node_step(compute_s: float, collectives: List[NodeCollective], link: Link,
                      alpha_intra_s: Optional[float] = None, codec_s: float = 0.0) -> float:
    """``compute + codec + sum(alpha + node_bytes * overhead * 8 / rate + rank_bytes / host_Bps)``;
    a collective inside the node pays ``alpha_intra_s`` (default: the link's alpha) and no link
    time."""
    link_beta = 0.0 if link.rate_bps is None else link.overhead * 8.0 / link.rate_bps
    host_beta = 0.0 if math.isinf(link.host_Bps) else 1.0 / link.host_Bps
    total = compute_s + codec_s
    for c in collectives:
        alpha = link.alpha_s if not c.intra or alpha_intra_s is None else alpha_intra_s
        total += alpha + c.node_bytes * link_beta + c.rank_bytes * host_beta
    return total


# --- the ``onebitlamb estimate`` command --------------------------------------------------------

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
#: the unit of a rate, bits or bytes per second (its multiplier to bits), after an optional prefix k,
#: M, G or T (either case): a lower-case b or "bit" counts bits, an upper-case B bytes
_RATE_UNITS = {"bit/s": 1, "bit": 1, "bps": 1, "b/s": 1, "B/s": 8, "Bps": 8}
RATE_FORMS = ("bits per second: 10Mbit/s, 10Mbit, 10Mbps, 10Mb/s; bytes per second: 10MB/s, 10MBps; "
              "prefixes k, M, G, T; inf or unlimited: no limit")


def parse_rate(text: str) -> Optional[float]:
    """A link rate in bits per second, from ``10Mbit/s``, ``1Gbps``, ``200mbit`` (bits) or
    ``10MB/s``, ``500kB/s`` (bytes, 8 bits each); ``inf`` / ``unlimited`` -> None. ValueError for
    a number without its unit (``100``, ``10M``: bits or bytes?), an unknown unit or a rate <= 0."""
    t = text.strip()
    if t.lower() in ("inf", "unlimited"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(\S*)", t)
    if not m or m.group(3) not in _RATE_UNITS:
        why = ("no unit: bits or bytes per second?" if m and not m.group(3) else
               f"unknown unit {m.group(3)!r}" if m else "not a number with its unit")
        raise ValueError(f"cannot read a rate from {text!r} ({why}); give it as {RATE_FORMS}")
    rate = float(m.group(1)) * _PREFIXES[m.group(2).lower()] * _RATE_UNITS[m.group(3)]
    if rate <= 0:
        raise ValueError(f"a link rate must be > 0, got {text!r} (inf or unlimited: no limit)")
    return rate


def parse_rates(text: str) -> List[Optional[float]]:
    """Comma-separated rates (``10Mbit/s,1Gbit/s,inf``), each as ``parse_rate`` reads it."""
    return [parse_rate(r) for r in text.split(",") if r.strip()]


def rate_label(rate_bps: Optional[float]) -> str:
    if rate_bps is None:
        return "unshaped"
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:g} {prefix}bit/s"
    return f"{rate_bps:g} bit/s"


def estimate(params: int, ranks: int, rate_bps: Optional[float], compute_s: float, *, ranks_per_node: int = 1,
             node_groups: bool = False, warmup_fraction: float = 0.2, alpha_s: float = 2e-4,
             codec_s: float = 0.0, warmup_dtype: str = "float32") -> Dict[str, float]:
    """The model's step times for ``params`` parameters on ``ranks`` ranks, ``ranks_per_node`` of
    them sharing each node's link of ``rate_bps`` (None: no limit but alpha), when a step's forward,
    backward and optimizer maths take ``compute_s`` on one rank.

    LAMB averages the gradient with one fp32 ring all-reduce over the world; a 1-bit optimizer
    averages it in its warm-up in ``warmup_dtype`` (``node_warmup_collectives``: float32 as LAMB,
    bfloat16 half the bytes, int8/int4/int2 the quantised average, which the optimizers refuse over
    node groups: ValueError with ``node_groups``) and then exchanges its 1-bit momentum, over the
    world group or, with ``node_groups``, over ``onebitlamb.comm.node_groups(ranks_per_node)``.
    Returns the step times (``lamb_s``, ``warmup_s``, ``compression_s``), the bytes leaving one node
    per step (LAMB's, the warm-up's and the compression stage's), the speed-ups: the compression
    step's and the whole run's with a fraction ``warmup_fraction`` of its steps in the warm-up, and
    ``volume_reduction``: the whole run's bytes leaving a node, LAMB's over the 1-bit optimizer's
    (``volume_reduction(w, lamb/compression, warmup/lamb)``; NaN on one node, where none leave).
    ``alpha_s``: one collective's fixed cost (a tiny all-reduce); ``codec_s``: the 1-bit path's
    local work per compression step (default 0: not modelled; the quantised warm-up's local work is
    not modelled either).
    """
    if ranks < 2 or ranks_per_node < 1 or ranks % ranks_per_node:
        raise ValueError(f"ranks ({ranks}) must be >= 2 and a multiple of ranks_per_node ({ranks_per_node})")
    nodes, d = ranks // ranks_per_node, params
    link = Link(rate_bps, alpha_s)
    lamb = node_warmup_collectives(d, nodes, ranks_per_node, hierarchical=False)
    warmup = node_warmup_collectives(d, nodes, ranks_per_node, node_groups, warmup_dtype=warmup_dtype)
    compression = node_onebit_collectives(d, nodes, ranks_per_node, node_groups)
    lamb_s = predict_node_step(compute_s, lamb, link)
    warmup_s = predict_node_step(compute_s, warmup, link)
    compression_s = predict_node_step(compute_s, compression, link, codec_s=codec_s)
    lamb_b, warmup_b, compression_b = (sum(c.node_bytes for c in cs) for cs in (lamb, warmup, compression))
    speedup = end_to_end_speedup(lamb_s, warmup_s, compression_s, warmup_fraction)  # checks the fraction
    volume = (volume_reduction(warmup_fraction, lamb_b / compression_b, warmup_b / lamb_b)
              if lamb_b and compression_b else math.nan)
    return {"lamb_s": lamb_s, "warmup_s": warmup_s, "compression_s": compression_s,
            "lamb_node_bytes": lamb_b, "warmup_node_bytes": warmup_b, "compression_node_bytes": compression_b,
            "step_speedup": lamb_s / compression_s, "end_to_end_speedup": speedup, "volume_reduction": volume}


def _rates(text: str) -> List[Optional[float]]:
    try:
        return parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    """``110M``, ``1.5G``, ``350k``, ``124439808`` -> a number of parameters."""
    m = re.fullmatch(r"([0-9.e+]+)\s*([kmgt]?)", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read a parameter count from {text!r} (examples: 110M, 1.5G, 350000)")
    return int(round(float(m.group(1)) * _PREFIXES[m.group(2)]))


# AutoFreeze's floor for 1-bit LAMB (onebitlamb.optim.freeze; it freezes no earlier): this layer
# cannot import the optimizers, so tests/test_netsim_costmodel.py checks the two agree.
WARMUP_FRACTION = 0.3
# the main job's warm-up average over the world group (onebitlamb.train.config.DEFAULT_WARMUP_DTYPE,
# also checked by tests/test_netsim_costmodel.py)
DEFAULT_WARMUP_DTYPE = "int8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=_count, required=True, help="parameters of the model (110M, 1.5G, ...)")
    parser.add_argument("--ranks", type=int, required=True, help="ranks (GPUs or processes) in all")
    parser.add_argument("--rates", required=True, nargs="+", type=_rates,
                        help=f"link rates per node, space- or comma-separated, each with its unit ({RATE_FORMS})")
    parser.add_argument("--compute-ms", type=float, required=True,
                        help="one step's forward, backward and optimizer maths on one rank, without "
                             "communication (time a few steps with a world of one)")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="ranks sharing one node's link; above 1 the 1-bit optimizer over "
                             "node_groups(L) is estimated too (default %(default)s)")
    parser.add_argument("--warmup-fraction", type=float, default=WARMUP_FRACTION,
                        help="share of the steps in the uncompressed warm-up (default %(default)s: the "
                             "earliest that AutoFreeze freezes 1-bit LAMB)")
    parser.add_argument("--warmup-dtype", choices=codec_names(), default=None,
                        help="what the 1-bit warm-up's average sends, as the optimizers' warmup_dtype: a "
                             "float32 or bfloat16 all-reduce, or the int8/int4/int2 quantised average (an "
                             "all-to-all and an all-gather; world group only) (default: the main job's, int8 "
                             "over the world group and float32 over node_groups)")
    parser.add_argument("--alpha-ms", type=float, default=0.2,
                        help="fixed cost of one collective: time a one-element all-reduce (default %(default)s)")
    parser.add_argument("--codec-ms", type=float, default=0.0,
                        help="the 1-bit path's local work per step: compress, unpack, error updates "
                             "(default %(default)s: not modelled)")


def run(args: argparse.Namespace) -> int:
    L = args.ranks_per_node
    # the optimizers refuse a quantised warm-up over node groups: given one, that row is left out, and
    # said so; by default each exchange has the main job's (onebitlamb pretrain --warmup-dtype)
    given = args.warmup_dtype
    quantised = given is not None and warmup_format(given).carries_error
    exchanges = [("world group", False, given or DEFAULT_WARMUP_DTYPE)]
    if L > 1 and not quantised:
        exchanges.append((f"node_groups({L})", True, given or "float32"))
    try:
        if args.params < 1:
            raise ValueError(f"--params must be >= 1, got {args.params}")
        if min(args.compute_ms, args.alpha_ms, args.codec_ms) < 0:
            raise ValueError("--compute-ms, --alpha-ms and --codec-ms must be >= 0")
        rates = [rate for given in args.rates for rate in given]
        rows = [(rate, name, estimate(args.params, args.ranks, rate, args.compute_ms / 1e3, ranks_per_node=L,
                                      node_groups=hier, warmup_fraction=args.warmup_fraction,
                                      alpha_s=args.alpha_ms / 1e3, codec_s=args.codec_ms / 1e3,
                                      warmup_dtype=dtype))
                for rate in rates for name, hier, dtype in exchanges]
    except ValueError as e:
        print(f"onebitlamb estimate: {e}", file=sys.stderr)
        return 2
    print(f"{args.params:,} parameters on {args.ranks} ranks ({args.ranks // L} node(s) of {L}), "
          f"{args.compute_ms:g} ms compute per step, alpha {args.alpha_ms:g} ms, "
          f"{100 * args.warmup_fraction:g}% of the steps in the warm-up, warm-up average in "
          f"{' and '.join(f'{dtype} over the {name}' for name, _, dtype in exchanges)}:\n")
    print("| link | 1-bit exchange over | LAMB step ms | 1-bit warm-up step ms | 1-bit compression step ms "
          "| step speed-up | whole-run speed-up | MB/step leaving a node: LAMB / 1-bit warm-up / 1-bit compression "
          "| whole-run bytes: LAMB / 1-bit |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    if L > 1 and quantised:
        print(f"(no node_groups({L}) row: the optimizers average a quantised warm-up ({args.warmup_dtype}) over the "
              f"world group only)", file=sys.stderr)
    for rate, name, e in rows:
        volume = "n/a" if math.isnan(e["volume_reduction"]) else f"{e['volume_reduction']:.2f}x"
        print(f"| {rate_label(rate) if rate else 'no limit'} | {name} | {1e3 * e['lamb_s']:.1f} "
              f"| {1e3 * e['warmup_s']:.1f} | {1e3 * e['compression_s']:.1f} | {e['step_speedup']:.2f}x "
              f"| {e['end_to_end_speedup']:.2f}x "
              f"| {e['lamb_node_bytes'] / 1e6:.2f} / {e['warmup_node_bytes'] / 1e6:.2f} "
              f"/ {e['compression_node_bytes'] / 1e6:.3f} | {volume} |")
    print("\nAn alpha-beta model (onebitlamb.comm.costmodel): each collective costs alpha plus its bytes "
          "at the link rate with TCP/IP framing; links are full duplex, a node's ranks share its link. "
          "It ignores overlap with the backward and the links' contention beyond that.")
    return 0
