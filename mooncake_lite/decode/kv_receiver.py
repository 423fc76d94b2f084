"""The decode instance's data socket: KV frames from prefill instances into the engine.

Runs the transfer framing's server (cluster-token handshake included). Each frame is checked and
applied on the event loop, then answered; a bad frame gets an error answer and the connection
stays up (only framing violations close it). A connection that closes before sending OP_KV_END
for a transfer fails that transfer (see :meth:`DecodeEngine.sender_lost`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mooncake_lite.decode.engine import DecodeEngine, KVError
from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import FLAG_REPLY, Frame, Limits
from mooncake_lite.transfer.kv_stream import OP_KV_ABORT, OP_KV_ALIVE, OP_KV_END, OP_KV_LAYER, tensor_from_payload
from mooncake_lite.transfer.server import reply_error, start_server

log = logging.getLogger(__name__)


def _int(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise KVError("bad_meta", f"frame meta {key!r} must be an integer, got {value!r}")
    return value


def _tid(meta: dict[str, Any]) -> str:
    tid = meta.get("tid")
    if not isinstance(tid, str) or not tid:
        raise KVError("bad_meta", "frame meta 'tid' must be a non-empty string")
    return tid


class KVReceiver(FrameHandler):
    def __init__(self, engine: DecodeEngine):
        self.engine = engine
        args = engine.runner.args
        self.kv_heads, self.head_dim, self.dtype = args.num_kv_heads, args.head_dim, engine.runner.dtype
        self.num_frames = 0

    def connection_made(self, conn: FrameConnection) -> None:
        conn.state["tids"] = set()

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        meta = frame.meta
        try:
            tid = _tid(meta)
            if frame.op == OP_KV_LAYER:
                n = _int(meta, "n")
                expected = 2 * n * self.kv_heads * self.head_dim * self.dtype.itemsize
                got = sum(v.nbytes for v in frame.payload)
                if n <= 0 or got != expected:
                    raise KVError("bad_payload", f"{got} payload bytes for {n} tokens (expected {expected})")
                kv = tensor_from_payload(frame.payload, n, self.kv_heads, self.head_dim, self.dtype)
                conn.state["tids"].add(tid)
                self.engine.kv_layer(id(conn), tid, _int(meta, "layer"), _int(meta, "start"), n, kv)
            elif frame.op == OP_KV_END:
                token = meta.get("first_token")
                if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
                    raise KVError("bad_meta", f"first_token must be an integer or null, got {token!r}")
                conn.state["tids"].discard(tid)
                self.engine.kv_end(id(conn), tid, token)
            elif frame.op == OP_KV_ALIVE:
                self.engine.kv_alive(tid)
            elif frame.op == OP_KV_ABORT:
                conn.state["tids"].discard(tid)
                self.engine.kv_abort(tid, str(meta.get("reason", "no reason given"))[:500])
            else:
                raise KVError("bad_op", f"unknown operation {frame.op} on the KV data socket")
        except KVError as exc:
            reply_error(conn, frame, exc.code, str(exc))
            return
        self.num_frames += 1
        conn.send(frame.op, frame.request_id, {"ok": True}, flags=FLAG_REPLY)

    def connection_lost(self, conn: FrameConnection, exc: Exception | None) -> None:
        tids = conn.state.get("tids") or set()
        if tids:
            self.engine.sender_lost(id(conn), set(tids))


async def start_kv_server(engine: DecodeEngine, host: str, port: int, token: str | None) -> asyncio.Server:
    return await start_server(KVReceiver(engine), host, port, token=token, limits=Limits(),
                              name="prefill")
