"""The round-trip floor beside ``mooncake bench store``'s single gets: what two processes'
event loops on this machine cost per request/reply before any store work.

Per round: a bare uvloop echo (64 bytes each way, two processes, one ``asyncio.Protocol`` per
side, the reply awaited on a future its ``data_received`` sets) over a Unix socket and over
loopback TCP, and a store request that does no work (EXISTS of no key: the framing layer, the
store's dispatch and both loops, nothing else). p50 in µs. A single get that asks the store
costs at least the store request; the echo says what the loops and the kernel alone cost.

    python -m mooncake_lite.bench.store.floor SOCKET_PATH   # the echo peer (prints its TCP port)
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

MESSAGE = b"\x5a" * 64
COUNT = 1000


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)   # type: ignore[attr-defined]


class _Caller(asyncio.Protocol):
    def __init__(self) -> None:
        self.waiter: asyncio.Future | None = None
        self.got = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= len(MESSAGE) and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def _serve(path: str) -> None:
    loop = asyncio.get_running_loop()
    unix = await loop.create_unix_server(_Echo, path)
    tcp = await loop.create_server(_Echo, "127.0.0.1", 0)
    print(tcp.sockets[0].getsockname()[1], flush=True)
    async with unix, tcp:
        await asyncio.Event().wait()   # until the bench kills us


async def _echo_p50(connect, count: int) -> float:
    loop = asyncio.get_running_loop()
    transport, caller = await connect(_Caller)
    lat = []
    try:
        for _ in range(count):
            caller.got, caller.waiter = 0, loop.create_future()
            start = time.perf_counter()
            transport.write(MESSAGE)
            await caller.waiter
            lat.append(time.perf_counter() - start)
    finally:
        transport.close()
    return statistics.median(lat) * 1e6


async def _store_p50(address: str, count: int) -> float:
    from mooncake_lite.store.client import StoreClient
    from mooncake_lite.store.protocol import Op
    client = await StoreClient.connect(address, name="bench-floor")
    lat = []
    try:
        for _ in range(count):
            start = time.perf_counter()
            await client.frames.request(Op.EXISTS, {"keys": ""})
            lat.append(time.perf_counter() - start)
    finally:
        await client.close()
    return statistics.median(lat) * 1e6


def measure(store_address: str, count: int = COUNT) -> dict[str, float]:
    """p50 µs of the echo over a Unix socket and TCP, and of a no-work store request."""
    import uvloop
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "echo.sock")
        peer = subprocess.Popen([sys.executable, "-m", "mooncake_lite.bench.store.floor", path],
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(peer.stdout.readline())   # type: ignore[union-attr]

            async def run() -> dict[str, float]:
                loop = asyncio.get_running_loop()
                return {"unix_echo": await _echo_p50(lambda p: loop.create_unix_connection(p, path), count),
                        "tcp_echo": await _echo_p50(lambda p: loop.create_connection(p, "127.0.0.1", port), count),
                        "store_request": await _store_p50(store_address, count)}
            return uvloop.run(run())
        finally:
            peer.kill()
            peer.wait(10)


if __name__ == "__main__":
    import uvloop
    uvloop.run(_serve(sys.argv[1]))
