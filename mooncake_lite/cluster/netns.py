"""Nodes on one box: Linux network namespaces joined by shaped veth links to one bridge.

    with Nodes.create(3, Link.parse("1gbit,0.5ms")) as nodes:
        nodes[0].address                              # 10.213.X.1, node1's own address
        nodes.start(nodes[0], "conductor", argv)      # a RoleProcess running inside node1
        nodes.cut(nodes[2]); nodes.restore(nodes[2])  # its link down, then up again

Layout. A hub namespace holds the bridge; each node namespace has ``lo`` and ``eth0`` (its
address on a private /24, no default route), joined to the bridge by a veth pair whose two ends
are each shaped on egress, so rate and delay hold in both directions of every node's link. The
host (the namespace that created them: tests, clients, ``curl``) sits on the bridge too, at
``.254``, unshaped. Nothing routes out: no NAT, no gateway, so traffic stays on the /24.

Teardown is always attempted: ``close()`` (context manager exit, ``atexit``, and SIGTERM, turned
into ``SystemExit`` while a cluster lives) stops the processes it started, kills anything still
inside its namespaces and deletes them, which removes every veth with them. Every name carries
``mcl-<owner pid>-<n>``, so namespaces a crashed run left behind (owner pid gone) are found and
removed by the next ``Nodes.create`` or by ``mooncake netns down``. Needs root (CAP_NET_ADMIN);
:func:`unavailable_reason` says why it cannot run here, for callers that want to skip instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mooncake_lite.common.launch import RoleProcess
from mooncake_lite.common.units import parse_duration

log = logging.getLogger(__name__)

PREFIX = "mcl-"                          # every namespace this module creates starts with it
_NAME = re.compile(r"^mcl-(\d+)-(\d+)-(\w+)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_SUBNET_BASE = "10.213"                  # 10.213.X.0/24, X picked free per cluster
HOST_OCTET = 254
_serial = itertools.count()              # several clusters in one process get distinct names


class NetnsError(RuntimeError):
    """Namespaces or links could not be set up as asked."""


class NetnsUnavailable(NetnsError):
    """This machine or user cannot create namespaces (not root, no ``ip``/``tc``, no netns)."""


@dataclass(frozen=True)
class Link:
    """The shape of every node's link, each direction: rate in bit/s (None: unlimited), delay."""

    rate_bps: int | None = None
    delay_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Link:
        """``"1gbit,0.5ms"``, ``"100mbit"``, ``"2ms"`` or ``""`` (unshaped), in any order."""
        rate, delay = None, 0.0
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = _RATE.match(part)
            if m:
                rate = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
                continue
            try:
                delay = parse_duration(part)
            except ValueError:
                raise ValueError(f"not a rate or a delay: {part!r} (examples: 1gbit, 100mbit, 0.5ms)") from None
        if (rate is not None and rate <= 0) or delay < 0:
            raise ValueError(f"link {text!r}: rate must be positive and delay not negative")
        return cls(rate, delay)

    def qdisc(self) -> list[str] | None:
        """The ``tc qdisc add ... root`` arguments that shape one direction (None: leave it)."""
        if self.delay_s > 0:     # netem does both; it is the only qdisc that delays
            rate = ["rate", f"{self.rate_bps}bit"] if self.rate_bps else []
            return ["netem", "delay", f"{round(self.delay_s * 1e6)}us", *rate, "limit", "100000"]
        if self.rate_bps:
            # A burst of ~1 ms at line rate, but at least a whole 64 KiB GSO packet from the veth
            # as the qdisc counts it (every segment's headers included, ~68 KB): tbf cuts a packet
            # longer than its burst into MTU-sized ones, and the receiver then wakes per few
            # packets (measured at 200 Mbit: 2.8 KB a read with a 64 KiB burst, 62 KB with 128 KiB).
            # A queue of 100 ms so a TCP window at this rate is never tail-dropped.
            burst = max(self.rate_bps // 8 // 1000, 2 * 65536)
            return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(burst), "latency", "100ms"]
        return None

    def __str__(self) -> str:
        parts = [_format_rate(self.rate_bps)] if self.rate_bps else []
        parts += [f"{self.delay_s * 1e3:g}ms"] if self.delay_s else []
        return ",".join(parts) or "unshaped"


def _format_rate(bps: int) -> str:
    unit = next((u for u in ("tbit", "gbit", "mbit", "kbit") if bps % _RATE_UNITS[u] == 0), "bit")
    return f"{bps // _RATE_UNITS[unit]}{unit}"


@dataclass(frozen=True)
class Node:
    """One node: its namespace, its address on the cluster network, and its link's device."""

    name: str          # node1, node2, ...
    netns: str         # mcl-<pid>-<n>-node1
    address: str
    device: str = "eth0"

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside this node (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *command]


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """One ``ip``/``tc`` command line (first arg is the program); NetnsError with its stderr."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (for a clean skip or refusal), or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN): run as root, e.g. with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (package iproute2)"
    probe = f"{PREFIX}{os.getpid()}-{next(_serial)}-probe"
    made = run_ip("ip", "netns", "add", probe, check=False)
    run_ip("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    return None


def reshape(devices: Sequence[Sequence[str]], link: Link) -> None:
    """Give these (namespace, device) egresses ``link``'s shape in place (``tc qdisc replace``;
    unshaped: the root qdisc removed), so a benchmark can compare rates without restarting what
    runs on the nodes. Any process that may run ``tc`` may call it, e.g. a worker inside a node."""
    qdisc = link.qdisc()
    for netns, device in devices:
        if qdisc is None:
            run_ip("tc", "-n", netns, "qdisc", "del", "dev", device, "root", check=False)
        else:
            run_ip("tc", "-n", netns, "qdisc", "replace", "dev", device, "root", *qdisc)


def _owner_alive(pid: int) -> bool:
    """Whether the process that named a namespace still runs (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def list_namespaces() -> list[tuple[str, int, bool]]:
    """Every namespace this module names: (name, owner pid, owner alive)."""
    out = run_ip("ip", "netns", "list", check=False).stdout
    found = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m:
            found.append((name, int(m.group(1)), _owner_alive(int(m.group(1)))))
    return found


def remove_namespace(name: str) -> None:
    """Kill whatever runs inside ``name``, then delete it (its veths go with it)."""
    pids = run_ip("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    run_ip("ip", "netns", "del", name, check=False)


def remove_stale(*, everything: bool = False) -> list[str]:
    """Remove namespaces whose owner process is gone (``everything``: all of ours). Returns names."""
    stale = [name for name, _, alive in list_namespaces() if everything or not alive]
    for name in stale:
        remove_namespace(name)
    return stale


def _free_subnet() -> str:
    """A 10.213.X.0/24 no interface of the host uses yet."""
    used = run_ip("ip", "-o", "-4", "addr", "show", check=False).stdout
    for octet in range(1, 254):
        if f" {_SUBNET_BASE}.{octet}." not in used:
            return f"{_SUBNET_BASE}.{octet}.0/24"
    raise NetnsError(f"every {_SUBNET_BASE}.X.0/24 is in use on this host")


class _SigtermExits:
    """While a cluster lives, SIGTERM raises SystemExit in the main thread, so ``with`` blocks
    and ``atexit`` tear down; the previous handler is put back when the last cluster closes."""

    def __init__(self):
        self._count, self._previous = 0, None
        self._lock = threading.Lock()

    def acquire(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        with self._lock:
            if self._count == 0 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._previous = signal.signal(signal.SIGTERM, _raise_exit)
            self._count += 1

    def release(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        with self._lock:
            self._count = max(0, self._count - 1)
            if self._count == 0 and self._previous is not None:
                signal.signal(signal.SIGTERM, self._previous)
                self._previous = None


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


_SIGTERM = _SigtermExits()   # process-wide by nature: there is one SIGTERM handler per process


class Nodes:
    """A running set of nodes; use :meth:`create` as a context manager."""

    def __init__(self, nodes: list[Node], hub: str, host_device: str, host_address: str, link: Link):
        self.nodes, self.hub, self.link = nodes, hub, link
        self.host_device, self.host_address = host_device, host_address
        self._procs: list[RoleProcess] = []
        self._closed = False

    @classmethod
    def create(cls, num_nodes: int, link: Link = Link(), *, subnet: str | None = None) -> Nodes:
        """Make ``num_nodes`` nodes shaped by ``link``; NetnsUnavailable/NetnsError saying why not."""
        if not 1 <= num_nodes < HOST_OCTET:
            raise ValueError(f"nodes must be 1..{HOST_OCTET - 1}, got {num_nodes}")
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        for name in remove_stale():
            log.warning("removed namespace %s left behind by a run that ended without cleaning up", name)
        net = ipaddress.ip_network(subnet or _free_subnet())
        if net.num_addresses < 256:
            raise ValueError(f"subnet {net} is smaller than a /24")
        pid, serial = os.getpid(), next(_serial)
        tag = f"{PREFIX}{pid}-{serial}"
        address = [str(net.network_address + i) for i in range(256)]
        members = [Node(f"node{i}", f"{tag}-node{i}", address[i]) for i in range(1, num_nodes + 1)]
        # the host's end lives in the host's own namespace: unique there, and within IFNAMSIZ
        nodes = cls(members, f"{tag}-hub", f"mc{pid:x}x{serial:x}", address[HOST_OCTET], link)
        atexit.register(nodes.close)
        _SIGTERM.acquire()
        try:
            nodes._build(net.prefixlen)
        except BaseException:
            nodes.close()
            raise
        return nodes

    def _build(self, prefixlen: int) -> None:
        hub = ["ip", "-n", self.hub]
        run_ip("ip", "netns", "add", self.hub)
        run_ip(*hub, "link", "set", "lo", "up")
        run_ip(*hub, "link", "add", "br0", "type", "bridge")
        run_ip(*hub, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes, 1):
            run_ip("ip", "netns", "add", node.netns)
            run_ip("ip", "-n", node.netns, "link", "set", "lo", "up")
            run_ip(*hub, "link", "add", f"n{i}", "type", "veth", "peer", "name", node.device, "netns", node.netns)
            run_ip(*hub, "link", "set", f"n{i}", "master", "br0", "up")
            run_ip("ip", "-n", node.netns, "addr", "add", f"{node.address}/{prefixlen}", "dev", node.device)
            run_ip("ip", "-n", node.netns, "link", "set", node.device, "up")
            self._shape(self.hub, f"n{i}")
            self._shape(node.netns, node.device)
        run_ip("ip", "link", "add", self.host_device, "type", "veth", "peer", "name", "host", "netns", self.hub)
        run_ip(*hub, "link", "set", "host", "master", "br0", "up")
        run_ip("ip", "addr", "add", f"{self.host_address}/{prefixlen}", "dev", self.host_device)
        run_ip("ip", "link", "set", self.host_device, "up")

    def _shape(self, netns: str, device: str) -> None:
        qdisc = self.link.qdisc()
        if qdisc is None:
            return
        done = run_ip("tc", "-n", netns, "qdisc", "add", "dev", device, "root", *qdisc, check=False)
        if done.returncode == 0:
            return
        if qdisc[0] == "netem" and "unknown" in done.stderr.lower():
            raise NetnsError("a link delay needs the kernel's netem qdisc (sch_netem), which this kernel "
                             f"lacks; give the link a rate only (e.g. '1gbit'): {done.stderr.strip()}")
        raise NetnsError(f"tc qdisc add dev {device} root {' '.join(qdisc)}: {done.stderr.strip()}")

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self, node: Node, name: str, argv: Sequence[str], *, timeout: float = 120.0,
              **options) -> RoleProcess:
        """Run a role's ``argv`` inside ``node``, wait for its ready line; stopped by :meth:`close`.
        ``options`` go to :meth:`RoleProcess.launch` (``env``, ``cwd``, ``on_line``)."""
        proc = RoleProcess(name, node.argv(argv), **options)
        self._procs.append(proc)
        if timeout is not None:
            proc.wait_ready(timeout)
        return proc

    def shaped_devices(self) -> list[tuple[str, str]]:
        """Every (namespace, device) whose egress carries the link's shape: both veth ends of
        each node (for :func:`reshape`, and for reading their ``tc -s`` counters)."""
        return [(self.hub, f"n{i}") for i in range(1, len(self.nodes) + 1)] + \
            [(n.netns, n.device) for n in self.nodes]

    def cut(self, node: Node) -> None:
        """Take the node's link down from inside it: packets to and from it are lost, and open
        connections stall (no reset), as when a cable is pulled."""
        run_ip("ip", "-n", node.netns, "link", "set", node.device, "down")

    def restore(self, node: Node) -> None:
        """Bring the node's link back up; its address and route return with it."""
        run_ip("ip", "-n", node.netns, "link", "set", node.device, "up")

    def close(self, stop_timeout: float = 10.0) -> None:
        """Stop the processes started here (SIGTERM, then SIGKILL), kill anything else inside the
        namespaces, delete them. Safe to call twice, and from ``atexit``."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:          # all drain at once, then each gets the same bound
            proc.send(signal.SIGTERM)
        for proc in reversed(self._procs):
            with contextlib.suppress(Exception):
                proc.stop(stop_timeout)
        for name in [n.netns for n in self.nodes] + [self.hub]:
            remove_namespace(name)
        run_ip("ip", "link", "del", self.host_device, check=False)   # gone with the hub already
        atexit.unregister(self.close)
        _SIGTERM.release()
