"""Client side of a framed connection: pipelined requests matched to replies by request id.

    client = await FrameClient.connect("127.0.0.1", 8101, token=None)
    reply = await client.request(op, {"keys": [...]}, payload=[view1, view2],
                                 sink=lambda header, meta: [out_view])  # receive in place
    await client.close()

Many requests may be in flight on one connection (call ``request`` from several tasks); their
frames never interleave because every frame is written by one synchronous ``writelines``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import OP_HELLO, Buffer, Frame, FrameError, Header, Limits

ReplySink = Callable[[Header, dict[str, Any]], list[memoryview] | None]


class RemoteError(RuntimeError):
    """The peer answered with an error frame. ``peer`` names the connection it came on (e.g.
    ``server 127.0.0.1:8200``), so a caller juggling several peers can say which refused."""

    def __init__(self, code: str, message: str, peer: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.peer = peer


class _Pending:
    __slots__ = ("future", "sink")

    def __init__(self, future: asyncio.Future, sink: ReplySink | None) -> None:
        self.future = future
        self.sink = sink


class _ClientHandler(FrameHandler):
    def __init__(self) -> None:
        self.pending: dict[int, _Pending] = {}

    def payload_sink(self, conn: FrameConnection, header: Header, meta: dict[str, Any]):
        pending = self.pending.get(header.request_id)
        if pending is None:
            raise FrameError(f"reply to unknown request id {header.request_id}")
        if pending.sink is None or header.is_error:
            return None
        return pending.sink(header, meta)

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        pending = self.pending.pop(frame.request_id, None)
        if pending is None:
            raise FrameError(f"reply to unknown request id {frame.request_id}")
        if pending.future.done():
            return  # the caller gave up (timeout/cancel)
        if frame.header.is_error:
            pending.future.set_exception(RemoteError(str(frame.meta.get("error", "error")),
                                                     str(frame.meta.get("message", "")), conn.name))
        else:
            pending.future.set_result(frame)

    def connection_lost(self, conn: FrameConnection, exc: Exception | None) -> None:
        for pending in self.pending.values():
            if not pending.future.done():
                pending.future.set_exception(ConnectionError(f"connection {conn.name} lost"))
        self.pending.clear()


def split_address(address: Any) -> tuple[str, int]:
    """``'host:port'`` → (host, port) for :meth:`FrameClient.connect`; a clear ValueError for
    anything else (no host, a port that is not 1–65535)."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be 'host:port', got {address!r}")
    return host, int(port)


class FrameClient:
    def __init__(self, conn: FrameConnection, handler: _ClientHandler) -> None:
        self.conn = conn
        self._handler = handler
        self._ids = itertools.count(1)
        self.hello: dict[str, Any] = {}   # the server's HELLO reply (e.g. a store's canonical id)

    @classmethod
    async def connect(cls, host: str, port: int, *, token: str | None = None, name: str = "client",
                      limits: Limits = Limits(), timeout: float = 10.0) -> FrameClient:
        """Open a connection and complete the HELLO handshake (RemoteError if refused)."""
        handler = _ClientHandler()
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: FrameConnection(handler, limits, f"server {host}:{port}"), host, port),
            timeout)
        client = cls(conn, handler)
        try:
            reply = await asyncio.wait_for(client.request(OP_HELLO, {"token": token, "client": name}), timeout)
            client.hello = dict(reply.meta)
        except BaseException:
            conn.abort(None)
            raise
        return client

    async def request(self, op: int, meta: dict[str, Any] | None = None, payload: Sequence[Buffer] = (),
                      sink: ReplySink | None = None) -> Frame:
        """Send one frame and wait for its reply. ``sink(header, meta)`` may return the memory
        the reply payload should be received into (sizes must add up), or None."""
        await self.conn.drain()
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._handler.pending[request_id] = _Pending(future, sink)
        try:
            self.conn.send(op, request_id, meta, payload)
        except BaseException:
            self._handler.pending.pop(request_id, None)
            raise
        try:
            return await future
        except asyncio.CancelledError:
            pending = self._handler.pending.get(request_id)
            if pending is not None:
                pending.sink = None  # the caller's buffers are no longer ours to write into
            raise

    @property
    def is_closed(self) -> bool:
        return self.conn.closed.done() or self.conn.transport is None or self.conn.transport.is_closing()

    async def close(self) -> None:
        self.conn.close()
        await self.conn.closed
