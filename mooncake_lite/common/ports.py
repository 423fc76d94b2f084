"""A port to hand to a process that will listen on it later (a TP group's rank 0, a conductor
restarted on its port, etcd's): chosen below the kernel's ephemeral range.

Binding port 0 and closing gives a port from the ephemeral range, the one every ``connect`` and
every ``bind(0)`` on the host draws from: between the close and the child's own bind, another
process can be given it (seen when two test workers shared a 2-vCPU box: a conductor restarted
on its port found it taken, "Address already in use"). Below that range only explicit binds
land, so the window is left to processes that pick a port the same way, at random.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10_000          # clear of the well-known and registered ports services are often set on
TRIES = 64


def ephemeral_start(path: Path = RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where unreadable)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on ``host`` now, below the ephemeral range where one is; else one from it."""
    rng = rng or random.Random()
    top = ephemeral_start()
    for _ in range(TRIES if top > LOWEST + 1 else 0):
        port = rng.randrange(LOWEST, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
