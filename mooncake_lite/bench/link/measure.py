"""Benchmarks across a shaped link (issue #16 item 7): ``mooncake bench store --link RATE`` and
``mooncake bench pd --link RATE``, each between two nodes on this box (``cluster/netns.py``):
what both share, the measuring (link share, the qdisc's own byte counts), the workers' entry
point's parent side; the two benchmarks are ``store.py`` and ``pd.py``, the entry point run inside a
node ``worker.py``.

Both put the role under test on one node and its peer's code in a worker process (on uvloop, as
the roles run) on another, so every byte crosses the nodes' veth links shaped to RATE (a ``tbf``
on each end's egress), never the loopback. Several ``--link`` rates are measured in one run,
interleaved: between them the worker re-shapes the same links in place (``netns.reshape``), so
nothing restarts.

Link share used = payload bytes moved / (rate x time). Its ceiling is below 1: on a 1500-byte MTU
each Ethernet frame of 1514 bytes carries 1448 bytes of TCP payload (timestamps on), so at most
95.6%. ``wire_share`` is the same with the bytes the link's qdisc really sent (headers included,
read from ``tc -s``), which separates header overhead from idle link time.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager

import orjson

from mooncake_lite.cluster import netns
from mooncake_lite.cluster.netns import Link

WORKER = (sys.executable, "-m", "mooncake_lite.bench.link.worker")  # worker.py, run inside a node
PAYLOAD_PER_FRAME = 1448 / 1514    # TCP payload / Ethernet frame at MTU 1500 with timestamps
HIDDEN_GOAL, SHARE_GOAL = 0.8, 0.9
SINK_PORT = 9100


def parse_links(texts: Sequence[str]) -> list[Link]:
    """``--link`` values; each needs a rate (the share is relative to it)."""
    links = [Link.parse(t) for t in texts]
    for text, link in zip(texts, links):
        if link.rate_bps is None:
            raise ValueError(f"--link {text!r}: give a rate (e.g. 1gbit, 200mbit); the share is relative to it")
    return links


def refusal(texts: Sequence[str]) -> str | None:
    """Why a ``--link`` run cannot start here (bad rate, not root, no namespaces), or None."""
    try:
        parse_links(texts)
    except ValueError as exc:
        return str(exc)
    reason = netns.unavailable_reason()
    return f"--link runs between network namespaces: {reason}" if reason else None


def share(nbytes: float, rate_bps: int, seconds: float) -> float:
    return nbytes * 8 / (rate_bps * seconds)


def qdisc_bytes(devices: Sequence[Sequence[str]]) -> tuple[int, int]:
    """(bytes sent, packets dropped) by the root qdisc of the first of ``devices`` (the sender's
    end of the path: every hop after it carries the same packets), drops summed over all."""
    sent = drops = 0
    for i, (ns, dev) in enumerate(devices):
        out = netns.run_ip("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev).stdout
        root = next((q for q in orjson.loads(out or "[]") if q.get("root")), {})
        sent += root.get("bytes", 0) if i == 0 else 0
        drops += root.get("drops", 0)
    return sent, drops


class Wire:
    """The qdisc counters of one direction of the path, around one measured op."""

    def __init__(self, devices: Sequence[Sequence[str]]):
        self.devices = [tuple(d) for d in devices]
        self.start = qdisc_bytes(self.devices) if self.devices else (0, 0)

    def done(self, row: dict) -> dict:
        if self.devices:
            sent, drops = qdisc_bytes(self.devices)
            row.update(wire_bytes=sent - self.start[0], drops=drops - self.start[1])
        return row


# ---- the parent's side of the workers (worker.py runs inside a node, prints one JSON object) ----
def run_worker(node: netns.Node, kind: str, spec: dict, timeout: float) -> dict:
    """``kind`` (store-client / pd) inside ``node``; its JSON answer (its stderr relayed)."""
    proc = subprocess.run(node.argv([*WORKER, kind, orjson.dumps(spec).decode()]), capture_output=True,
                          text=True, timeout=timeout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker {kind} on {node.name} exited with code {proc.returncode}")
    return orjson.loads(proc.stdout.strip().splitlines()[-1])


def socket_stream(host: str, port: int, size: int, count: int, wire: list) -> dict:
    """``count`` messages of ``size`` bytes on one blocking socket, timed until the sink has
    counted them all (its answer comes after EOF)."""
    data = memoryview(bytearray(b"\x5a" * size))
    with socket.create_connection((host, port)) as conn:
        meter, t0 = Wire(wire), time.perf_counter()
        for _ in range(count):
            conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
        got = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
        seconds = time.perf_counter() - t0
    return meter.done({"bytes": got, "seconds": seconds})


@contextmanager
def sink_on(node: netns.Node):
    """A :func:`socket_sink` on ``node`` at ``SINK_PORT`` while the block runs."""
    sink = subprocess.Popen(node.argv([*WORKER, "sink", node.address, str(SINK_PORT)]), stdout=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the socket sink on {node.name} did not start")
        yield
    finally:
        sink.kill()
        sink.wait()


def refused(prog: str, texts: Sequence[str]) -> list[Link] | None:
    """The ``--link`` rates, or None once why they cannot be measured is said on stderr."""
    reason = refusal(texts)
    if reason:
        sys.stderr.write(f"{prog}: {reason}\n")
        return None
    return parse_links(texts)
