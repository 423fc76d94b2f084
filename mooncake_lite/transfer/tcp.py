"""TCP options for the data connections: bulk request/reply traffic, often over loopback."""

from __future__ import annotations

import socket

# Congestion control for data connections, first one the kernel lets us pick. BBR (this machine's
# default) paces every burst; on request/reply traffic over loopback or a datacenter link that
# pacing, restarted after each idle gap, roughly halved 1 MiB round trips (blocking sockets:
# 1.4-1.8 GB/s with bbr vs 2.8-3.0 with reno) and put multi-ms stalls in the tail.
CONGESTION_CONTROLS = (b"cubic", b"reno")


def tune_socket(sock: socket.socket | None) -> None:
    """Per-connection TCP options for bulk request/reply traffic (best effort, never fails)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # uvloop sets it too; be explicit
    except OSError:
        pass
    for name in CONGESTION_CONTROLS:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name)
            break
        except (OSError, AttributeError):
            continue
