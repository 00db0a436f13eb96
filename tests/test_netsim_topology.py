"""Emulated hosts: set-up, shaping, tear-down (also after an exception), and the clear refusal
without root or iproute2. The namespace tests need root, ``ip`` and ``tc``; they skip otherwise."""
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.netsim import topology
from benchmarks.netsim.topology import Network, NetsimUnavailable, check_available
from netns import needs_netns


def netns(test):
    """Needs root, ip and tc: marked ``netns``, skipped with the reason where unavailable."""
    return needs_netns(pytest.mark.netns(test))


def _ours(net: Network):
    names = set(topology.list_namespaces())
    return [ns for ns in [net.switch_ns, *net.host_ns] if ns in names]


@netns
@pytest.mark.parametrize("rate", [20e6, None])
def test_setup_shapes_links_and_teardown_removes_everything(rate):
    links_before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    net = Network(3, rate)
    with net:
        assert _ours(net) == [net.switch_ns, *net.host_ns]
        for i, ns in enumerate(net.host_ns):
            addr = subprocess.run(["ip", "-n", ns, "-o", "addr", "show", "eth0"], capture_output=True,
                                  text=True).stdout
            assert f"{net.address(i)}/24" in addr
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"], capture_output=True,
                                   text=True).stdout
            assert ("tbf" in qdisc) == (rate is not None)
            port = subprocess.run(["tc", "-n", net.switch_ns, "qdisc", "show", "dev", f"p{i}"],
                                  capture_output=True, text=True).stdout
            assert ("tbf" in port) == (rate is not None), "both ends of every link are shaped"
        # hosts reach each other through the bridge (a TCP connection from host 2 to host 0)
        server = net.popen(0, [sys.executable, "-c",
                               "import socket; s=socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(1); "
                               "c,_=s.accept(); c.sendall(c.recv(5))"])
        client = subprocess.run(net.exec_argv(2, [sys.executable, "-c",
                                "import socket,time\nfor _ in range(50):\n try:\n  c=socket.create_connection(('%s',7000)); break\n"
                                " except OSError: time.sleep(0.1)\nc.sendall(b'hello'); print(c.recv(5).decode())"
                                % net.address(0)]), capture_output=True, text=True, timeout=30)
        assert client.stdout.strip() == "hello", client.stderr
        server.wait(timeout=10)
        assert net.counters(2).tx_bytes > 0
    assert _ours(net) == []
    # nothing was ever created in this namespace
    links_after = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert len(links_after.splitlines()) == len(links_before.splitlines())


@netns
def test_teardown_after_an_exception_kills_workers_and_removes_namespaces():
    net = Network(2, 10e6)
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            sleeper = net.popen(1, [sys.executable, "-c", "import time; time.sleep(600)"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None, "the process inside the namespace was stopped"
    assert _ours(net) == []
    net.close()  # idempotent


@netns
def test_failed_setup_leaves_nothing(monkeypatch):
    net = Network(2, 10e6)
    real = Network._shape

    def failing_shape(self, ns, dev):
        if dev == "p1":
            raise RuntimeError("tc refused")
        return real(self, ns, dev)

    monkeypatch.setattr(Network, "_shape", failing_shape)
    with pytest.raises(RuntimeError, match="tc refused"):
        with net:
            pass
    assert _ours(net) == []


@netns
def test_cleanup_stale_removes_only_dead_owners():
    # a pid that cannot be alive: beyond pid_max
    dead = f"{topology.PREFIX}99999999x0h0"
    subprocess.run(["ip", "netns", "add", dead], check=True)
    try:
        with Network(1, None) as live:
            removed = topology.cleanup_stale()
            assert dead in removed
            assert _ours(live) == [live.switch_ns, *live.host_ns], "a live run's namespaces stay"
    finally:
        subprocess.run(["ip", "netns", "del", dead], capture_output=True)
    assert dead not in topology.list_namespaces()


def test_refuses_clearly_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetsimUnavailable, match="needs root"):
        check_available()
    from benchmarks import network

    assert network.main(["--rates", "10Mbit/s"]) != 0
    assert "needs root" in capsys.readouterr().err


def test_refuses_clearly_without_iproute2(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else real_which(tool))
    with pytest.raises(NetsimUnavailable, match="tc not found"):
        check_available()
