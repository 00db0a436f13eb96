"""Emulated hosts: Linux network namespaces on one switch, every link shaped by a token bucket.

Layout for ``n`` hosts (every name starts with this process's prefix, so parallel runs and other
users' namespaces never collide, and nothing is created in the caller's own namespace)::

    <prefix>h0  eth0 10.213.0.1/24 --veth-- p0 \\
    <prefix>h1  eth0 10.213.0.2/24 --veth-- p1  +-- br0 (bridge) in <prefix>sw
    ...                                        /

Both ends of every veth carry a ``tbf`` qdisc at the link rate: the host's ``eth0`` shapes what the
host sends, the switch port ``p<i>`` shapes what it receives. Traffic never leaves the namespaces
created here: the switch namespace has no address and no route, the hosts only know their /24.

The token bucket is sized to the rate, not fixed: ``burst = max(rate * burst_ms, rate / HZ, 2 *
frame)``. A bucket smaller than ``rate / HZ`` cannot reach the rate (the qdisc refills at most once
per timer tick); one much larger than a few milliseconds of traffic fills up while the workers
compute and then lets a whole 1-bit step (a few hundred KB) through at memory speed, which would
flatter the compressed runs. See docs/netsim.md.

Several ranks may share a host (``ranks_per_host``, an emulated node of several GPUs): the runner
starts that many workers in each host's namespace. Traffic between two of them goes to the
host's own address, which the kernel routes over the namespace's loopback, so it never passes
the shaped ``eth0`` nor its counters: only what crosses between hosts is shaped and counted.

``Network`` is a context manager: the namespaces (and with them the veths, the bridge and any
worker still running inside) are removed on exit, whether the body returned, raised or was
interrupted. ``cleanup_stale()`` removes what a killed run (``kill -9``) left behind.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

#: Namespace names are ``obn<pid>x<k>h<i>`` (hosts) and ``obn<pid>x<k>sw`` (the switch).
PREFIX = "obn"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x(\d+)(?:h\d+|sw)$")
_counter = itertools.count()

#: The kernel's timer frequency assumed when sizing the bucket (250 on most distribution kernels;
#: a higher value only lowers a floor that ``burst_ms`` usually exceeds anyway).
KERNEL_HZ = 250
ETH_FRAME = 1514  # MTU 1500 plus the 14-byte Ethernet header: what tbf charges per full packet
SUBNET = "10.213.0"


class NetsimUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, no ``ip``/``tc``, or the kernel refuses)."""


def check_available() -> None:
    """Raise ``NetsimUnavailable`` with the reason when this machine cannot run the emulation."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetsimUnavailable(f"{' and '.join(missing)} not found on PATH (install iproute2)")
    if os.geteuid() != 0:
        raise NetsimUnavailable("creating network namespaces needs root (run as root, or in a "
                                "container with CAP_NET_ADMIN and CAP_SYS_ADMIN)")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}")
    return proc


def list_namespaces() -> List[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def tbf_params(rate_bps: float, burst_ms: float = 4.0, hz: int = KERNEL_HZ) -> Dict[str, int]:
    """Token-bucket size and queue limit in bytes for a link of ``rate_bps`` bits per second.

    ``burst``: a few milliseconds' worth of bytes, never less than one timer tick's worth (below
    that the qdisc cannot reach its rate) nor two full frames. ``limit`` (bytes queued before tail
    drop): 100 ms of traffic, at least 256 KB, so that the switch port where two senders meet
    (all-to-all with more than two hosts) queues instead of dropping; a drop costs TCP a 200 ms
    retransmission timeout, which would dominate a step.
    """
    if rate_bps <= 0:
        raise ValueError(f"rate must be > 0 bit/s, got {rate_bps}")
    rate_Bps = rate_bps / 8.0
    burst = int(max(rate_Bps * burst_ms / 1000.0, rate_Bps / hz, 2 * ETH_FRAME))
    limit = int(max(rate_Bps * 0.1, 256 * 1024, 2 * burst))
    return {"burst": burst, "limit": limit}


@dataclass
class LinkCounters:
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: "LinkCounters") -> "LinkCounters":
        return LinkCounters(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                            self.tx_packets - other.tx_packets, self.rx_packets - other.rx_packets)


class Network:
    """``hosts`` emulated hosts on one bridge, links shaped to ``rate_bps`` (None: unshaped).

    Use as a context manager; ``host_ns[i]`` is host ``i``'s namespace, ``address(i)`` its IP, and
    ``popen(i, argv)`` starts a process inside it (stopped, with everything else, on exit).
    ``ranks_per_host`` workers share each host (ranks ``i L .. i L + L - 1`` on host ``i``, the
    layout ``onebitlamb.comm.node_groups`` expects); their traffic to each other stays on the
    host's loopback, unshaped and uncounted.
    """

    def __init__(self, hosts: int, rate_bps: Optional[float] = None, burst_ms: float = 4.0,
                 mtu: int = 1500, ranks_per_host: int = 1) -> None:
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        if hosts > 250:
            raise ValueError(f"at most 250 hosts fit the /24, got {hosts}")
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError(f"rate must be > 0 bit/s or None (unshaped), got {rate_bps}")
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.rate_bps = rate_bps
        self.burst_ms = burst_ms
        self.mtu = mtu
        tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch_ns = f"{tag}sw"
        self.host_ns = [f"{tag}h{i}" for i in range(hosts)]
        self.interface = "eth0"
        self._procs: List[subprocess.Popen] = []
        self._created: List[str] = []
        self.tbf = tbf_params(rate_bps, burst_ms) if rate_bps is not None else None

    # -- set-up and tear-down -------------------------------------------------------------------
    def __enter__(self) -> "Network":
        check_available()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        # IPv6 off: no router solicitations or MLD reports on the counters; lo up for local TCP.
        _run(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
             check=False)
        _run(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"],
             check=False)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape(self, ns: str, dev: str) -> None:
        if self.tbf is None:
            return
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
              "rate", f"{int(self.rate_bps)}bit", "burst", str(self.tbf["burst"]),
              "limit", str(self.tbf["limit"])])

    def _setup(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0",
              "forward_delay", "0"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.host_ns):
            self._add_ns(ns)
            port = f"p{i}"
            # created inside the switch namespace with its peer placed straight into the host's:
            # no interface ever exists in the caller's namespace
            _run(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", self.interface, "mtu", str(self.mtu), "netns", ns])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", self.interface])
            _run(["ip", "-n", ns, "link", "set", self.interface, "up"])
            self._shape(ns, self.interface)
            self._shape(sw, port)

    def close(self) -> None:
        """Stop every process started here or still inside the namespaces, then delete them.

        Idempotent, and never raises: it runs from ``finally`` blocks and signal handlers.
        """
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.terminate()
                except OSError:
                    pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5.0)
        self._procs.clear()
        for ns in reversed(self._created):
            _kill_namespace_pids(ns)
            _run(["ip", "netns", "del", ns], check=False)
        self._created.clear()

    # -- using the hosts ------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The number of workers (ranks) the runner starts: ``ranks_per_host`` on every host."""
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        """The host whose namespace rank ``rank`` runs in (consecutive ranks share a host)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        return rank // self.ranks_per_host

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def exec_argv(self, i: int, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.host_ns[i], *argv]

    def popen(self, i: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(self.exec_argv(i, argv), env=env, **kwargs)
        self._procs.append(proc)
        return proc

    def counters(self, i: int) -> LinkCounters:
        """Kernel counters of host ``i``'s interface (``ip -s link``, read in its namespace)."""
        out = _run(["ip", "-n", self.host_ns[i], "-j", "-s", "link", "show", self.interface]).stdout
        stats = json.loads(out)[0]["stats64"]
        return LinkCounters(stats["tx"]["bytes"], stats["rx"]["bytes"], stats["tx"]["packets"],
                            stats["rx"]["packets"])

    def qdisc_drops(self) -> int:
        """Packets dropped by the token-bucket queues on all links (should stay 0)."""
        total = 0
        pairs = [(ns, self.interface) for ns in self.host_ns]
        pairs += [(self.switch_ns, f"p{i}") for i in range(self.hosts)]
        for ns, dev in pairs:
            out = _run(["tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev", dev], check=False).stdout
            try:
                total += sum(int(q.get("drops", 0)) for q in json.loads(out or "[]"))
            except (ValueError, TypeError):
                pass
        return total


def _kill_namespace_pids(ns: str) -> None:
    """Kill the processes still inside ``ns`` (ours: the workers started there)."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError, PermissionError):
            pass


def cleanup_stale() -> List[str]:
    """Delete namespaces of this naming scheme whose creating process is gone; return their names.

    Namespaces of live processes (a run in progress, perhaps another user's) are left alone.
    """
    removed = []
    for ns in list_namespaces():
        m = _NAME_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        _kill_namespace_pids(ns)
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    return removed
