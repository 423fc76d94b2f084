"""The decode instance's data socket: KV frames from prefill instances into the engine.

Runs the transfer framing's server (cluster-token handshake included). Each frame is checked on
the event loop; a layer frame's KV is then written into the cache in the engine's executor and the
frame answered once it is written (END once every frame before it is), so an answer means the KV
is in the cache; a bad frame gets an error answer and the connection stays up (only framing
violations close it). A connection that closes before sending OP_KV_END
for a transfer fails that transfer (see :meth:`DecodeEngine.sender_lost`).

Memory is bounded by what a frame may legitimately carry: a header announcing more than one
layer of the largest request the KV cache could hold, or a meta over ``KV_META_BYTES``, closes
the connection before anything is allocated; a layer frame's meta is checked against the request
it names (:meth:`DecodeEngine.check_layer`: a reserved transfer, a layer, tokens inside its
prompt, a payload of exactly those tokens' bytes) before memory is allocated for its payload. A
frame that fails the check (an unknown or aborted transfer, for one) has its payload read into a
small scratch buffer and dropped, and gets an error answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mooncake_lite.common.hashing import KEY_BYTES
from mooncake_lite.common.tracing import META_KEY
from mooncake_lite.decode.engine import DecodeEngine, KVError
from mooncake_lite.decode.pending import ResumePoint
from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import FLAG_REPLY, Frame, Header, Limits
from mooncake_lite.transfer.kv_layout import LayoutError
from mooncake_lite.transfer.kv_stream import (OP_KV_ABORT, OP_KV_ALIVE, OP_KV_END, OP_KV_LAYER, frame_heads,
                                              tensor_from_payload, token_kv_bytes)
from mooncake_lite.transfer.server import reply_error, start_server

log = logging.getLogger(__name__)

KV_META_BYTES = 64 << 10   # KV frames' metas are a few dozen bytes
SCRATCH_BYTES = 1 << 20
# A refused frame's error rides in its meta under a key no JSON object can contain.
_REFUSED = object()


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


def _resume(meta: dict) -> ResumePoint:
    """An END frame's resume point (``decode/pending.ResumePoint``); KVError naming a bad field."""
    output, key, tail = meta.get("output", []), meta.get("key"), meta.get("tail")
    if not isinstance(output, list) or not all(map(_is_int, output)):
        raise KVError("bad_meta", f"output must be a list of token ids, got {output!r}")
    if tail is not None and (not isinstance(tail, list) or not all(map(_is_int, tail))):
        raise KVError("bad_meta", f"tail must be a list of token ids or null, got {tail!r}")
    try:
        chain = None if key is None else bytes.fromhex(key)
    except (TypeError, ValueError):
        chain = b""
    if chain is not None and len(chain) != KEY_BYTES:
        raise KVError("bad_meta", f"key must be a {KEY_BYTES}-byte hex block key or null, got {key!r}")
    return ResumePoint(tuple(output), chain, None if tail is None else tuple(tail))


def _traceparent(meta: dict[str, Any]) -> str | None:
    """The sender's span (tracing on at the prefill); anything but a short string is ignored."""
    tp = meta.get(META_KEY)
    return tp if isinstance(tp, str) and len(tp) < 128 else None


class KVReceiver(FrameHandler):
    def __init__(self, engine: DecodeEngine):
        self.engine = engine
        args = engine.runner.args
        self.kv_heads, self.head_dim, self.dtype = args.num_kv_heads, args.head_dim, engine.runner.dtype
        self.token_bytes = token_kv_bytes(1, self.kv_heads, self.head_dim, self.dtype)
        self.head_token_bytes = self.token_bytes // self.kv_heads   # one token of one KV head, K and V
        self.num_frames = 0
        self.refused_bytes = 0   # payload bytes of refused frames, read and dropped
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))

    def max_payload_bytes(self) -> int:
        """One layer of the largest prompt the KV cache could ever hold: no frame is larger."""
        runner = self.engine.runner
        return self.token_bytes * runner.allocator.num_blocks * runner.block_size

    def payload_sink(self, conn: FrameConnection, header: Header, meta: dict[str, Any]):
        try:
            if header.op != OP_KV_LAYER:
                raise KVError("bad_payload", f"operation {header.op} carries no payload")
            n = _int(meta, "n")
            heads = self._check_heads(meta)
            expected = max(n, 0) * len(heads) * self.head_token_bytes
            if n <= 0 or header.payload_len != expected:
                raise KVError("bad_payload", f"{header.payload_len} payload bytes for {n} tokens of "
                                             f"{len(heads)} KV heads (expected {expected})")
            self.engine.check_layer(_tid(meta), _int(meta, "layer"), _int(meta, "start"), n, heads)
        except KVError as exc:
            meta[_REFUSED] = exc
            self.refused_bytes += header.payload_len
            return self._discard(header.payload_len)
        return None   # checked: fresh memory of exactly this size (charged to the in-flight budget)

    def _check_heads(self, meta: dict[str, Any]) -> range:
        """The KV heads a frame carries (all of them, or one TP prefill rank's slice, written at
        its place: ``transfer/tp_heads.py``); KVError unless the frame is of a layout version
        this decode reads and its heads are of this model."""
        try:
            heads = frame_heads(meta, self.kv_heads)
        except LayoutError as exc:
            raise KVError("bad_layout", str(exc)) from None
        return range(heads.start, heads.stop)

    def _discard(self, nbytes: int) -> list[memoryview]:
        size = self._scratch.nbytes
        return [self._scratch] * (nbytes // size) + ([self._scratch[:nbytes % size]] if nbytes % size else [])

    def connection_made(self, conn: FrameConnection) -> None:
        conn.state["tids"] = set()

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        meta = frame.meta
        try:
            if _REFUSED in meta:
                raise meta[_REFUSED]
            tid = _tid(meta)
            if frame.op == OP_KV_LAYER:
                n, heads = _int(meta, "n"), self._check_heads(meta)
                expected = n * len(heads) * self.head_token_bytes
                got = sum(v.nbytes for v in frame.payload)
                if n <= 0 or got != expected:
                    raise KVError("bad_payload", f"{got} payload bytes for {n} tokens (expected {expected})")
                kv = tensor_from_payload(frame.payload, n, len(heads), self.head_dim, self.dtype)
                conn.state["tids"].add(tid)
                done = self.engine.kv_layer(id(conn), tid, _int(meta, "layer"), _int(meta, "start"), n, kv,
                                            _traceparent(meta), None if len(heads) == self.kv_heads else heads)
            elif frame.op == OP_KV_END:
                token = meta.get("first_token")   # a list of them for a request of n > 1 choices
                if token is not None and not _is_int(token) and not (
                        isinstance(token, list) and token and all(map(_is_int, token))):
                    raise KVError("bad_meta", f"first_token must be an integer, a list of them or null, got {token!r}")
                conn.state["tids"].discard(tid)
                done = self.engine.kv_end(id(conn), tid, token, None if token is None else _resume(meta))
            elif frame.op == OP_KV_ALIVE:
                done = None
                self.engine.kv_alive(tid)
            elif frame.op == OP_KV_ABORT:
                done = None
                conn.state["tids"].discard(tid)
                self.engine.kv_abort(tid, str(meta.get("reason", "no reason given"))[:500])
            else:
                raise KVError("bad_op", f"unknown operation {frame.op} on the KV data socket")
        except KVError as exc:
            reply_error(conn, frame, exc.code, str(exc))
            return
        if done is None:
            self._answer(conn, frame, None)
        else:
            done.add_done_callback(lambda f: self._answer(conn, frame, f))

    def _answer(self, conn: FrameConnection, frame: Frame, done: asyncio.Future | None) -> None:
        """Answer ``frame``: ok, or the error its write (or an earlier frame's) ended with."""
        error = None
        if done is not None:
            error = KVError("write_failed", "cancelled") if done.cancelled() else done.exception()
        try:
            if error is None:
                self.num_frames += 1
                conn.send(frame.op, frame.request_id, {"ok": True}, flags=FLAG_REPLY)
            else:
                reply_error(conn, frame, getattr(error, "code", "write_failed"), str(error))
        except ConnectionError:
            pass   # the prefill is gone; its unfinished transfers fail through connection_lost

    def connection_lost(self, conn: FrameConnection, exc: Exception | None) -> None:
        tids = conn.state.get("tids") or set()
        if tids:
            self.engine.sender_lost(id(conn), set(tids))


async def start_kv_server(engine: DecodeEngine, host: str, port: int, token: str | None, *,
                          handshake_timeout: float | None = 5.0, stall_timeout: float | None = 30.0,
                          idle_timeout: float | None = None, max_inflight_bytes: int = 1 << 30) -> asyncio.Server:
    receiver = KVReceiver(engine)
    # The budget must hold at least one legitimate frame, or the largest prompts could never arrive.
    limits = Limits(max_meta_bytes=KV_META_BYTES, max_payload_bytes=receiver.max_payload_bytes(),
                    handshake_timeout=handshake_timeout, stall_timeout=stall_timeout, idle_timeout=idle_timeout,
                    max_inflight_bytes=max(max_inflight_bytes, receiver.max_payload_bytes()))
    return await start_server(receiver, host, port, token=token, limits=limits, name="prefill")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
