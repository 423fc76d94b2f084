"""Client side of a framed connection: pipelined requests matched to replies by request id.

    client = await FrameClient.connect("127.0.0.1", 8101, token=None)
    reply = await client.request(op, {"keys": [...]}, payload=[view1, view2],
                                 sink=lambda header, meta: [out_view])  # receive in place
    await client.close()

Many requests may be in flight on one connection (call ``request`` from several tasks); their
frames never interleave because every frame is written by one synchronous ``writelines``.

A peer whose node is cut off answers nothing and TCP may take minutes to say so: ``connect``
and every request with a deadline (``request(..., timeout=)``, or the client's
``request_timeout``) end instead with :class:`NoAnswer`, a ``TimeoutError`` naming the peer and
the op ("store 10.0.0.3:7002 get_layers: no answer in 10 s").
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


class NoAnswer(TimeoutError):
    """No answer from ``peer`` to ``op`` within ``seconds``. A ``TimeoutError`` (so also an
    ``OSError``): callers that fall back on a lost peer fall back on this too."""

    def __init__(self, peer: str, op: str, seconds: float) -> None:
        super().__init__(f"{peer} {op}: no answer in {seconds:g} s")
        self.peer = peer
        self.op = op
        self.seconds = seconds


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
        self.label = conn.name            # how errors name the peer, e.g. "store 10.0.0.3:7002"
        self.request_timeout: float | None = None   # the deadline of a request given none
        # Called as each request goes out; what it returns is added to the request's meta
        # (the same-node fast path hands the store its finished read leases this way).
        self.piggyback: Callable[[], dict[str, Any] | None] | None = None
        self.op_name: Callable[[int], str] = lambda op: f"op {op}"   # how NoAnswer names an op

    @classmethod
    async def connect(cls, host: str, port: int, *, token: str | None = None, name: str = "client",
                      limits: Limits = Limits(), timeout: float = 10.0, label: str | None = None) -> FrameClient:
        """Open a connection and complete the HELLO handshake (RemoteError if refused; NoAnswer
        naming ``label``, default "server host:port", when either takes over ``timeout`` s)."""
        handler = _ClientHandler()
        loop = asyncio.get_running_loop()
        label = label or f"server {host}:{port}"
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: FrameConnection(handler, limits, f"server {host}:{port}"), host, port),
                timeout)
        except TimeoutError:
            raise NoAnswer(label, "connect", timeout) from None
        client = cls(conn, handler)
        client.label = label
        try:
            reply = await client.request(OP_HELLO, {"token": token, "client": name}, timeout=timeout, what="hello")
            client.hello = dict(reply.meta)
        except BaseException:
            conn.abort(None)
            raise
        return client

    async def request(self, op: int, meta: dict[str, Any] | None = None, payload: Sequence[Buffer] = (),
                      sink: ReplySink | None = None, *, timeout: float | None = None,
                      what: str | None = None) -> Frame:
        """Send one frame and wait for its reply. ``sink(header, meta)`` may return the memory
        the reply payload should be received into (sizes must add up), or None. ``timeout``
        (default ``request_timeout``; None: none) bounds the wait for room to send too (a cut
        peer stops reading); past it, :class:`NoAnswer` naming the op as ``what`` (default its
        number) and the connection stays usable (a late reply is dropped)."""
        timeout = self.request_timeout if timeout is None else timeout
        if not timeout:
            return await self._request(op, meta, payload, sink)
        if not self.conn.must_drain:
            # Room to send: the deadline is a timer on the reply's future, not a timeout scope
            # (which costs a task-cancelling context on every small request: tens of µs here).
            return await self._request(op, meta, payload, sink, timeout, what)
        try:   # no task in between: the frame is sent before this first yields, as without a deadline
            async with asyncio.timeout(timeout):
                return await self._request(op, meta, payload, sink)
        except TimeoutError:
            raise NoAnswer(self.label, what or self.op_name(op), timeout) from None

    async def _request(self, op: int, meta: dict[str, Any] | None, payload: Sequence[Buffer],
                       sink: ReplySink | None, timeout: float | None = None, what: str | None = None) -> Frame:
        await self.conn.drain()
        if self.piggyback is not None:
            extra = self.piggyback()
            if extra:
                meta = {**meta, **extra} if meta else extra
        request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pending = self._handler.pending[request_id] = _Pending(future, sink)
        try:
            self.conn.send(op, request_id, meta, payload)
        except BaseException:
            self._handler.pending.pop(request_id, None)
            raise
        timer = None if timeout is None else loop.call_later(timeout, self._no_answer, pending, op, what, timeout)
        try:
            return await future
        except (asyncio.CancelledError, NoAnswer):
            pending.sink = None  # the caller's buffers are no longer ours to write into
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _no_answer(self, pending: _Pending, op: int, what: str | None, seconds: float) -> None:
        """A request's deadline passed: its caller gets NoAnswer; a late reply is dropped (its
        pending entry stays until then, so the reply is still read off the connection)."""
        pending.sink = None
        if not pending.future.done():
            pending.future.set_exception(NoAnswer(self.label, what or self.op_name(op), seconds))

    @property
    def is_closed(self) -> bool:
        return self.conn.closed.done() or self.conn.transport is None or self.conn.transport.is_closing()

    async def close(self, timeout: float = 2.0) -> None:
        """Close, letting queued frames go out for up to ``timeout`` s; then drop them: a cut
        peer reads nothing, and a close waiting on it would never end."""
        self.conn.close()
        try:
            await asyncio.wait_for(asyncio.shield(self.conn.closed), timeout)
        except TimeoutError:
            self.abort()
            await self.conn.closed

    def abort(self) -> None:
        """Drop the connection now (a peer that stopped answering): every request still
        waiting on it fails at once with ConnectionError. Also after ``close`` began (a graceful
        close still waiting to send its queued bytes)."""
        if self.conn.transport is not None:
            self.conn.transport.abort()
