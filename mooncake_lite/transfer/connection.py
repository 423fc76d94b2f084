"""One framed connection: an ``asyncio.BufferedProtocol`` that receives payloads in place.

Receiving: header and meta are parsed out of a small staging buffer. Before the payload arrives
the handler's ``payload_sink`` may hand back the memory it should land in (slab slots, a
caller's tensor); large payloads are then read by the kernel straight into that memory (no
intermediate copy), small ones are copied out of the staging buffer (one ``recv`` then serves
many small frames). Protocol violations close only this connection, with one log line.

Sending: ``send`` writes header, meta and payload buffers with one ``writelines`` (uvloop keeps
references, no copy). ``when_flushed(cb)`` runs ``cb`` once everything written so far has been
handed to the kernel, which is when memory being sent may be reused (the store's leases).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lite.transfer.framing import (HEADER_BYTES, Buffer, Frame, FrameError, Header, Limits,
                                            decode_header, decode_meta, encode_frame)

log = logging.getLogger(__name__)

STAGING_BYTES = 256 << 10
DIRECT_MIN_BYTES = 64 << 10  # payload remainders at least this big are received in place
BULK_BYTES = 1 << 20  # after a frame this big, header and meta are read exactly (no read-ahead)


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


class FrameHandler:
    """Callbacks of a connection. Subclass and override what you need."""

    def connection_made(self, conn: FrameConnection) -> None:
        pass

    def payload_sink(self, conn: FrameConnection, header: Header, meta: dict[str, Any]) -> list[memoryview] | None:
        """Memory for the payload: byte views whose sizes add up to ``header.payload_len``, or
        None for a fresh bytearray. Raise FrameError to refuse the frame (closes the connection)."""
        return None

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        """A complete frame. Exceptions here are logged and close the connection."""

    def frame_aborted(self, conn: FrameConnection, header: Header, meta: dict[str, Any]) -> None:
        """The connection died after ``payload_sink`` but before the payload completed."""

    def connection_lost(self, conn: FrameConnection, exc: Exception | None) -> None:
        pass


class FrameConnection(asyncio.BufferedProtocol):
    def __init__(self, handler: FrameHandler, limits: Limits = Limits(), name: str = "peer",
                 is_server: bool = False) -> None:
        self.handler = handler
        # Only servers stop reading while their replies queue: if both ends did, two peers
        # writing big frames at each other could wait on each other forever.
        self.is_server = is_server
        self.limits = limits
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.state: dict[str, Any] = {}  # for the handler (e.g. "authenticated")
        self._staging = bytearray(STAGING_BYTES)
        self._sview = memoryview(self._staging)
        self._start = 0
        self._end = 0
        self._header: Header | None = None
        self._meta: dict[str, Any] | None = None
        self._meta_buf: bytearray | None = None  # only for metas too big for the staging buffer
        self._targets: list[memoryview] = []
        self._ti = 0
        self._toff = 0
        self._remaining = 0
        self._is_bulk = False  # the last frame was large: read header and meta exactly
        self._paused = False
        self._flush_callbacks: list[Callable[[], None]] = []
        self._drain_waiters: list[asyncio.Future] = []

    # ---- asyncio protocol callbacks -------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport
        # Pause as soon as anything stays buffered: "resumed" then means "all handed to the kernel".
        transport.set_write_buffer_limits(high=0, low=0)
        tune_socket(transport.get_extra_info("socket"))
        peer = transport.get_extra_info("peername")
        if peer and self.is_server:   # a client's name already says which server it dialled
            self.name = f"{self.name} {peer[0]}:{peer[1]}"
        self.handler.connection_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header is not None and self._meta is not None:
            got = self._header.payload_len - self._remaining
            log.warning("connection %s closed mid-frame (payload %d of %d bytes); frame dropped",
                        self.name, got, self._header.payload_len)
            self._safe(self.handler.frame_aborted, self, self._header, self._meta)
        self._header = self._meta = None
        self._paused = False
        self._run_flush_callbacks()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionError(f"connection {self.name} lost"))
        self._drain_waiters.clear()
        self._safe(self.handler.connection_lost, self, exc)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True
        if self.is_server and self.transport is not None:
            self.transport.pause_reading()  # back-pressure: no new requests while replies queue

    def resume_writing(self) -> None:
        self._paused = False
        if self.is_server and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        self._run_flush_callbacks()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._start == self._end and self._header is not None:
            if self._meta_buf is not None:
                return memoryview(self._meta_buf)[len(self._meta_buf) - self._remaining:]
            if self._meta is not None and self._remaining >= DIRECT_MIN_BYTES:
                return self._targets[self._ti][self._toff:]
        if self._start == self._end:
            self._start = self._end = 0
            if self._is_bulk:
                # Bulk traffic: read just the header, then just the meta, so the next payload is
                # not pulled into the staging buffer (and copied out again) ahead of its frame.
                if self._header is None:
                    return self._sview[:HEADER_BYTES]
                if self._meta is None and self._header.meta_len:
                    return self._sview[:self._header.meta_len]
        elif self._end == STAGING_BYTES:
            self._compact()
        return self._sview[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._start == self._end and self._header is not None and (
                    self._meta_buf is not None or (self._meta is not None and self._remaining >= DIRECT_MIN_BYTES)):
                self._advance_direct(nbytes)
            else:
                self._end += nbytes
            self._process()
        except FrameError as exc:
            self.abort(f"protocol error: {exc}")
        except Exception:
            log.exception("connection %s: handler failed; closing the connection", self.name)
            self.abort(None)

    # ---- parsing ------------------------------------------------------------------------------
    def _compact(self) -> None:
        n = self._end - self._start
        self._sview[:n] = self._sview[self._start:self._end]
        self._start, self._end = 0, n

    def _advance_direct(self, nbytes: int) -> None:
        self._remaining -= nbytes
        if self._meta_buf is not None:
            if self._remaining == 0:
                meta_buf, self._meta_buf = self._meta_buf, None
                self._begin_payload(decode_meta(meta_buf))
            return
        self._toff += nbytes
        self._skip_full_targets()
        if self._remaining == 0:
            self._deliver()

    def _skip_full_targets(self) -> None:
        while self._ti < len(self._targets) and self._toff >= self._targets[self._ti].nbytes:
            self._toff -= self._targets[self._ti].nbytes
            self._ti += 1

    def _process(self) -> None:
        while self.transport is not None and not self.transport.is_closing():
            avail = self._end - self._start
            if self._header is None:
                if avail < HEADER_BYTES:
                    return
                self._header = decode_header(self._sview[self._start:self._start + HEADER_BYTES], self.limits)
                self._start += HEADER_BYTES
                self._remaining = self._header.meta_len
                if self._header.meta_len > STAGING_BYTES // 2:
                    self._meta_buf = bytearray(self._header.meta_len)
                    take = min(avail - HEADER_BYTES, self._remaining)
                    self._meta_buf[:take] = self._sview[self._start:self._start + take]
                    self._start += take
                    self._remaining -= take
                    if self._remaining:
                        return
                    meta_buf, self._meta_buf = self._meta_buf, None
                    self._begin_payload(decode_meta(meta_buf))
                continue
            if self._meta is None:
                need = self._header.meta_len
                if avail < need:
                    if self._start + need > STAGING_BYTES:
                        self._compact()
                    return
                meta = decode_meta(self._sview[self._start:self._start + need])
                self._start += need
                self._begin_payload(meta)
                continue
            take = min(avail, self._remaining)
            if take:
                self._copy_into_targets(self._sview[self._start:self._start + take])
                self._start += take
                self._remaining -= take
            if self._remaining:
                return
            self._deliver()

    def _begin_payload(self, meta: dict[str, Any]) -> None:
        header = self._header
        assert header is not None
        self._remaining = header.payload_len
        targets = self.handler.payload_sink(self, header, meta) if header.payload_len else []
        self._meta = meta  # from here on, a dying connection reports frame_aborted
        if targets is None:
            targets = [memoryview(bytearray(header.payload_len))]
        elif sum(t.nbytes for t in targets) != header.payload_len:
            raise FrameError(f"payload sink gave {sum(t.nbytes for t in targets)} bytes for a "
                             f"{header.payload_len}-byte payload")
        self._targets = [t for t in targets if t.nbytes]
        self._ti = self._toff = 0
        if header.payload_len == 0:
            self._deliver()

    def _copy_into_targets(self, data: memoryview) -> None:
        pos = 0
        n = data.nbytes
        while pos < n:
            target = self._targets[self._ti]
            take = min(n - pos, target.nbytes - self._toff)
            target[self._toff:self._toff + take] = data[pos:pos + take]
            pos += take
            self._toff += take
            self._skip_full_targets()

    def _deliver(self) -> None:
        frame = Frame(self._header, self._meta, self._targets)  # type: ignore[arg-type]
        self._is_bulk = frame.header.payload_len >= BULK_BYTES
        self._header = self._meta = None
        self._targets = []
        self.handler.frame_received(self, frame)

    @property
    def is_idle(self) -> bool:
        """No frame half-received (safe to close without losing a request)."""
        return self._header is None and self._start == self._end

    # ---- sending and closing ----------------------------------------------------------------
    def send(self, op: int, request_id: int, meta: dict[str, Any] | None = None,
             payload: Sequence[Buffer] = (), flags: int = 0) -> None:
        """Queue one frame. Payload buffers must stay unchanged until ``when_flushed`` fires."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError(f"connection {self.name} is closed")
        self.transport.writelines(encode_frame(op, request_id, meta, payload, flags))

    def when_flushed(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once all data sent so far left user space (or the connection died)."""
        if self.transport is None or self.transport.get_write_buffer_size() == 0:
            callback()
        else:
            self._flush_callbacks.append(callback)

    async def drain(self) -> None:
        """Wait until the write buffer is empty (flow control for senders)."""
        if self.transport is not None and self.transport.is_closing():
            raise ConnectionError(f"connection {self.name} is closed")
        if self._paused:
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def abort(self, reason: str | None) -> None:
        """Close this connection now (no drain); others are unaffected."""
        if reason:
            log.warning("closing connection %s: %s", self.name, reason)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _run_flush_callbacks(self) -> None:
        callbacks, self._flush_callbacks = self._flush_callbacks, []
        for cb in callbacks:
            self._safe(cb)

    @staticmethod
    def _safe(fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("callback %r failed", fn)
