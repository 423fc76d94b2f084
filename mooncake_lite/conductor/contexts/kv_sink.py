"""Where a prefill-only job's KV stream goes: a data socket on the conductor that takes the
frames of the transfers it expects and drops their bytes.

A cached context is prefilled once to get its blocks written to the store; no decode instance
takes part. The prefill instance streams its KV the way it always does (``transfer/kv_stream.py``)
to the address it is given, so the conductor gives it this sink's: each expected transfer's layer
frames are read into one scratch buffer and answered ok, and the END frame carrying the first
token (the last stage's, in a CPP group where every stage streams its own layers) completes the
transfer. Frames of transfers nobody expects are refused like decode refuses them
(``unknown_transfer``), so a stray stream stops its prefill.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import FLAG_REPLY, Frame, Header, Limits
from mooncake_lite.transfer.kv_stream import OP_KV_ABORT, OP_KV_ALIVE, OP_KV_END, OP_KV_LAYER
from mooncake_lite.transfer.server import reply_error, server_address, start_server

log = logging.getLogger(__name__)

SCRATCH_BYTES = 1 << 20
SINK_LIMITS = Limits(max_meta_bytes=64 << 10, max_payload_bytes=1 << 30)


class KVSink(FrameHandler):
    """``expect(transfer_id)`` before dispatching; ``await`` the future it returns for the END
    frame (its meta), then ``forget`` the transfer either way."""

    def __init__(self) -> None:
        self._expected: dict[str, asyncio.Future] = {}
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self.address = ""
        self.num_bytes = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str, advertise_host: str | None, token: str | None) -> None:
        self._server = await start_server(self, host, 0, token=token, limits=SINK_LIMITS, name="kv-sink")
        self.address = server_address(self._server, advertise_host)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for fut in self._expected.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the conductor is shutting down"))

    def expect(self, transfer_id: str) -> asyncio.Future:
        fut = self._expected[transfer_id] = asyncio.get_running_loop().create_future()
        return fut

    def forget(self, transfer_id: str) -> None:
        self._expected.pop(transfer_id, None)

    def payload_sink(self, conn: FrameConnection, header: Header, meta: dict[str, Any]) -> list[memoryview]:
        """Every payload lands in the scratch buffer, over and over: the bytes are not kept."""
        size, nbytes = self._scratch.nbytes, header.payload_len
        return [self._scratch] * (nbytes // size) + ([self._scratch[:nbytes % size]] if nbytes % size else [])

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        tid = frame.meta.get("tid")
        fut = self._expected.get(tid) if isinstance(tid, str) else None
        if fut is None:
            reply_error(conn, frame, "unknown_transfer", f"no prefill-only transfer {tid!r} is expected here")
            return
        if frame.op == OP_KV_LAYER:
            self.num_bytes += frame.header.payload_len
        elif frame.op == OP_KV_END:
            if frame.meta.get("first_token") is not None and not fut.done():
                fut.set_result(frame.meta)
        elif frame.op == OP_KV_ABORT:
            if not fut.done():
                fut.set_exception(ConnectionError(f"prefill aborted the transfer: {frame.meta.get('reason')}"))
        elif frame.op != OP_KV_ALIVE:
            reply_error(conn, frame, "bad_op", f"operation {frame.op} is not part of a KV stream")
            return
        conn.send(frame.op, frame.request_id, {"ok": True}, flags=FLAG_REPLY)
