"""The entry point of ``bench store --link`` and ``bench pd --link``'s workers, run inside a node:
``python -m mooncake_lite.bench.link.worker sink HOST PORT | store-client JSON | pd JSON``.

It imports the two benchmarks' worker coroutines; they import only ``measure.py``, never this
module (the parent starts it by name, ``measure.WORKER``), so no import runs in a circle.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence

import orjson

from mooncake_lite.bench.link.pd import pd_worker
from mooncake_lite.bench.link.store import store_client

WORKERS = {"store-client": store_client, "pd": pd_worker}


def socket_sink(host: str, port: int) -> int:
    """Accept connections forever; read each to EOF, answer the byte count (8 bytes LE)."""
    buf = memoryview(bytearray(1 << 20))
    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                n = 0
                while got := conn.recv_into(buf):
                    n += got
                conn.sendall(n.to_bytes(8, "little"))


def main(argv: Sequence[str]) -> int:
    """Worker entry points, run inside a node: ``sink HOST PORT``, ``store-client JSON``, ``pd JSON``."""
    kind, *rest = argv
    if kind == "sink":
        return socket_sink(rest[0], int(rest[1]))
    spec = orjson.loads(rest[0])
    import uvloop    # the roles' event loop (common/service.py): per-frame costs as the prefill has them
    out = uvloop.run(WORKERS[kind](spec))
    sys.stdout.write(orjson.dumps(out).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
