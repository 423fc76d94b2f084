"""Nodes on one box (cluster/netns.py): namespaces with their own addresses, shaped links, nothing
routed out, cut/restore, and teardown however the owner ends (exit, SIGTERM, kill -9 + cleanup)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from mooncake_lite.cluster import netns, netns_cli
from mooncake_lite.cluster.netns import Link, NetnsUnavailable, Nodes
from tests.netns.conftest import needs_netns

RATE = 20_000_000              # bit/s: slow enough that a 2.5 MB transfer is a clear second


@pytest.mark.parametrize("text, rate, delay", [
    ("1gbit,0.5ms", 10**9, 0.0005), ("0.5ms,1gbit", 10**9, 0.0005), ("100mbit", 10**8, 0.0),
    ("2ms", None, 0.002), ("", None, 0.0), ("1.5kbit", 1500, 0.0)])
def test_link_parses_rate_and_delay(text, rate, delay):
    link = Link.parse(text)
    assert (link.rate_bps, link.delay_s) == (rate, pytest.approx(delay))
    assert Link.parse(str(link)) == link if str(link) != "unshaped" else link == Link()


@pytest.mark.parametrize("text", ["1gbits", "fast", "-1ms", "0bit"])
def test_link_refuses_what_it_cannot_shape(text):
    with pytest.raises(ValueError):
        Link.parse(text)


def test_rate_only_is_a_token_bucket_and_a_delay_needs_netem():
    assert Link.parse("1gbit").qdisc()[:3] == ["tbf", "rate", "1000000000bit"]
    assert Link.parse("1gbit,0.5ms").qdisc()[:5] == ["netem", "delay", "500us", "rate", "1000000000bit"]
    assert Link().qdisc() is None


def test_refuses_clearly_without_root(monkeypatch, capsys):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="need root"):
        Nodes.create(2)
    assert netns_cli.main(["up", "--nodes", "2"]) == 2
    assert netns_cli.main(["down"]) == 2
    assert "root" in capsys.readouterr().err


@pytest.fixture(scope="module")
def nodes():
    with Nodes.create(2, Link(rate_bps=RATE)) as made:
        yield made


def _in(node, code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(node.argv([sys.executable, "-c", code, *args]), capture_output=True, text=True,
                          timeout=timeout)


_SINK = ("import socket, sys\ns = socket.create_server((sys.argv[1], 9000))\nprint('listening', flush=True)\n"
         "c, _ = s.accept()\nn = 0\nwhile (d := c.recv(1 << 20)):\n    n += len(d)\nprint(n)")


def _sink(node) -> subprocess.Popen:
    srv = subprocess.Popen(node.argv([sys.executable, "-c", _SINK, node.address]), stdout=subprocess.PIPE, text=True)
    assert srv.stdout.readline().strip() == "listening"
    return srv


@needs_netns
def test_each_node_has_its_address_and_no_route_out(nodes):
    for node in nodes:
        routes = subprocess.run(["ip", "-n", node.netns, "-4", "route"], capture_output=True, text=True).stdout
        assert routes.split()[0] == "10.213.%s.0/24" % node.address.split(".")[2], routes
        assert "default" not in routes and "via" not in routes
        addrs = subprocess.run(["ip", "-n", node.netns, "-4", "-o", "addr"], capture_output=True, text=True).stdout
        assert f"inet {node.address}/24" in addrs
    out = _in(nodes[0], "import socket\ntry:\n socket.create_connection(('192.0.2.1', 80), timeout=5)\n"
                        "except OSError as e: print(e.errno)")
    assert out.stdout.strip() == "101", out      # ENETUNREACH at once: no gateway, no NAT


@needs_netns
def test_link_rate_bounds_a_transfer_between_nodes(nodes):
    srv = _sink(nodes[1])
    size = RATE // 8      # one second's worth at the link rate
    start = time.monotonic()
    sent = _in(nodes[0], "import socket, sys\nc = socket.create_connection((sys.argv[1], 9000))\n"
                         f"c.sendall(bytes({size}))\nc.close()", nodes[1].address)
    assert sent.returncode == 0, sent.stderr
    assert int(srv.communicate(timeout=30)[0]) == size
    # A lower bound only: a busy machine makes the transfer slower, never faster than the link.
    assert time.monotonic() - start >= 0.8 * size * 8 / RATE


@needs_netns
def test_the_host_reaches_a_node_until_its_link_is_cut_and_again_after(nodes):
    srv = _sink(nodes[1])
    nodes.cut(nodes[1])
    try:
        with pytest.raises(OSError):
            socket.create_connection((nodes[1].address, 9000), timeout=1.0)
    finally:
        nodes.restore(nodes[1])
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection((nodes[1].address, 9000), timeout=1.0) as conn:
                conn.sendall(b"back")
            break
        except OSError:
            assert time.monotonic() < deadline, "the node did not come back after its link was restored"
            time.sleep(0.2)
    assert srv.communicate(timeout=30)[0].strip() == "4"


_OWNER = """
import signal, sys, time
from mooncake_lite.cluster.netns import Nodes
nodes = Nodes.create(1)
nodes.start(nodes[0], "sleeper", ["sleep", "300"], timeout=None)
time.sleep(0.5)
print(nodes[0].netns, nodes.hub, flush=True)
signal.pause()
"""


def _owner(sig: signal.Signals) -> list[str]:
    """A process that makes a node with a process inside, killed by ``sig``; its namespaces."""
    proc = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 2, "the owner process did not start its node"
        assert subprocess.run(["ip", "netns", "pids", names[0]], capture_output=True, text=True).stdout.split()
    finally:
        proc.send_signal(sig)
        proc.wait(30)
    return names


def _existing() -> set[str]:
    return {name for name, _, _ in netns.list_namespaces()}


@needs_netns
def test_sigterm_to_the_owner_removes_its_namespaces_and_processes(nodes):
    names = _owner(signal.SIGTERM)
    assert not set(names) & _existing()


@needs_netns
def test_namespaces_of_a_killed_owner_are_found_and_removed_and_live_ones_kept(nodes, capsys):
    names = _owner(signal.SIGKILL)
    assert set(names) <= _existing()               # nothing could run at kill -9
    inside = subprocess.run(["ip", "netns", "pids", names[0]], capture_output=True, text=True).stdout.split()
    assert inside
    assert netns_cli.main(["down"]) == 0
    assert set(names) <= set(capsys.readouterr().out.split())
    assert not set(names) & _existing()
    assert {n.netns for n in nodes} <= _existing()  # this process's nodes are alive: kept
    for pid in inside:      # gone, or a zombie waiting for init to reap it
        assert not _running(int(pid))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@needs_netns
def test_netns_up_prints_the_nodes_and_removes_them_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_lite", "netns", "up", "--nodes", "2", "--link", "1gbit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = [proc.stdout.readline() for _ in range(3)]
        names = [line.split()[-2] for line in banner[1:]]        # "  node1  10.213.X.1  ip netns exec NAME COMMAND"
        assert [line.split()[0] for line in banner[1:]] == ["node1", "node2"], banner
        assert set(names) <= _existing()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "nodes removed" in out and not set(names) & _existing()
