"""Ports handed to a process that listens later come from below the kernel's ephemeral range, so
a ``bind(0)`` or ``connect`` elsewhere on the host meanwhile cannot be given them."""

from __future__ import annotations

import random
import socket

from mooncake_lite.common import ports


def test_a_port_is_free_and_below_the_ephemeral_range():
    top = ports.ephemeral_start()
    for seed in range(5):
        port = ports.free_port(rng=random.Random(seed))
        assert ports.LOWEST <= port < top
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))      # still free: nothing held it


def test_a_taken_port_is_skipped(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    picks = iter([port, port, port + 1 if port + 1 < 65536 else port - 1])
    monkeypatch.setattr(ports, "ephemeral_start", lambda: 65536)
    monkeypatch.setattr(ports, "LOWEST", 1024)

    class Rng:
        def randrange(self, lo, hi):
            return next(picks)
    try:
        assert ports.free_port(rng=Rng()) not in (port,)
    finally:
        taken.close()


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ports.ephemeral_start(f) == 40000
    assert ports.ephemeral_start(tmp_path / "missing") == 32768
    f.write_text("garbage")
    assert ports.ephemeral_start(f) == 32768
