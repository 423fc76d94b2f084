"""Serving framed connections, with the HELLO handshake that checks the cluster token.

Every connection starts with one HELLO frame from the client (meta ``{"token": str|null,
"client": name}``). The server replies ``{"ok": true}`` or an error frame (``unauthorized``)
and closes. Before the handshake no payload is accepted at all and a meta of at most
``Limits.hello_meta_bytes``, so an unauthenticated peer cannot make the server allocate memory;
one that has not completed its HELLO within ``Limits.handshake_timeout`` is closed.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Mapping
from typing import Any

from mooncake_lite.common.config import ListenError
from mooncake_lite.transfer.budget import InflightBudget
from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import FLAG_ERROR, FLAG_REPLY, OP_HELLO, Frame, FrameError, Header, Limits

log = logging.getLogger(__name__)


def reply_error(conn: FrameConnection, frame: Frame, code: str, message: str) -> None:
    """Answer ``frame`` with an error frame ``{"error": code, "message": message}``."""
    conn.send(frame.op, frame.request_id, {"error": code, "message": message}, flags=FLAG_REPLY | FLAG_ERROR)


def token_matches(expected: str | None, given: Any) -> bool:
    if expected is None:
        return True
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


class AuthGate(FrameHandler):
    """Wraps the real handler; lets frames through only after a valid HELLO."""

    def __init__(self, inner: FrameHandler, token: str | None, hello: Mapping[str, Any] | None = None) -> None:
        self.inner = inner
        self.token = token
        self.hello = hello if hello is not None else {}   # what the HELLO reply tells a client

    def connection_made(self, conn: FrameConnection) -> None:
        conn.state["authenticated"] = False
        self.inner.connection_made(conn)

    def payload_sink(self, conn: FrameConnection, header: Header, meta: dict[str, Any]):
        if not conn.state["authenticated"]:
            raise FrameError("payload sent before the handshake")
        return self.inner.payload_sink(conn, header, meta)

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        if conn.state["authenticated"]:
            self.inner.frame_received(conn, frame)
            return
        if frame.op != OP_HELLO:
            reply_error(conn, frame, "handshake_required", "the first frame must be HELLO")
            conn.close()
            log.warning("refused connection %s: op %d before the handshake", conn.name, frame.op)
            return
        if not token_matches(self.token, frame.meta.get("token")):
            reply_error(conn, frame, "unauthorized", "wrong or missing cluster token")
            conn.close()
            log.warning("refused connection %s: wrong or missing cluster token", conn.name)
            return
        conn.state["authenticated"] = True
        conn.authenticate()
        conn.state["client"] = str(frame.meta.get("client", ""))[:64]
        conn.send(OP_HELLO, frame.request_id, {**self.hello, "ok": True}, flags=FLAG_REPLY)

    def frame_aborted(self, conn: FrameConnection, header: Header, meta: dict[str, Any]) -> None:
        self.inner.frame_aborted(conn, header, meta)

    def connection_lost(self, conn: FrameConnection, exc: Exception | None) -> None:
        self.inner.connection_lost(conn, exc)


async def start_server(handler: FrameHandler, host: str, port: int, *, token: str | None = None,
                       limits: Limits = Limits(), name: str = "client",
                       hello: Mapping[str, Any] | None = None) -> asyncio.Server:
    """Listen on host:port (0 = any free port); each connection gets a FrameConnection whose
    frames go to ``handler`` after the handshake. ``hello`` (read at each handshake, so the
    caller may fill it in once the port is known) goes back in the HELLO reply. All its
    connections share one in-flight budget of ``limits.max_inflight_bytes``."""
    gate = AuthGate(handler, token, hello)
    budget = InflightBudget(limits.max_inflight_bytes)
    loop = asyncio.get_running_loop()
    try:
        return await loop.create_server(
            lambda: FrameConnection(gate, limits, name, is_server=True, authenticated=False, budget=budget),
            host, port, reuse_address=True)
    except OSError as exc:
        raise ListenError.of(exc, host, port, "--data-port") from None


def server_address(server: asyncio.Server, advertise_host: str | None = None) -> str:
    """``host:port`` a peer dials: the bound port, on ``advertise_host`` if given."""
    host, port = server.sockets[0].getsockname()[:2]
    return f"{advertise_host or host}:{port}"
