"""Bytes this rank sends, per collective, computed from the tensors handed to each collective.

The figures are what the standard algorithms put on the wire per rank (ring all-reduce, ring
all-gather, pairwise all-to-all), excluding protocol headers, so they can be compared with the
formulas of docs/algorithm.md and with kernel interface counters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict


def allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Ring all-reduce: reduce-scatter then all-gather, each sends (n-1)/n of the buffer."""
    return 2 * (world_size - 1) * nbytes // world_size


def all_to_all_bytes(nbytes: int, world_size: int) -> int:
    """Every chunk but this rank's own leaves the rank."""
    return (world_size - 1) * nbytes // world_size


def all_gather_bytes(nbytes_per_rank: int, world_size: int) -> int:
    """Ring all-gather: this rank's piece travels to the n-1 others."""
    return (world_size - 1) * nbytes_per_rank


@dataclass
class CommStats:
    """Running totals of what this rank sent: ``bytes_sent`` over all collectives, ``calls`` (the
    rounds: each collective is a round trip on the network whatever its size, which a slow link's
    latency charges for), and per kind of collective ``bytes_by_op`` and ``rounds_by_op``."""

    bytes_sent: int = 0
    calls: int = 0
    bytes_by_op: Dict[str, int] = field(default_factory=dict)
    rounds_by_op: Dict[str, int] = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        """The collectives called so far (``calls``)."""
        return self.calls

    def record(self, op: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.calls += 1
        self.bytes_by_op[op] = self.bytes_by_op.get(op, 0) + nbytes
        self.rounds_by_op[op] = self.rounds_by_op.get(op, 0) + 1

    def reset(self) -> None:
        self.bytes_sent = 0
        self.calls = 0
        self.bytes_by_op.clear()
        self.rounds_by_op.clear()

    def state_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "calls": self.calls, "bytes_by_op": dict(self.bytes_by_op),
                "rounds_by_op": dict(self.rounds_by_op)}

    def load_state_dict(self, state: dict) -> None:
        self.bytes_sent = int(state["bytes_sent"])
        self.calls = int(state["calls"])
        self.bytes_by_op = dict(state["bytes_by_op"])
        self.rounds_by_op = dict(state.get("rounds_by_op", {}))  # saved before rounds were counted by op


#: What the library's collectives record when no ``stats`` object is passed to them.
GLOBAL_STATS = CommStats()
