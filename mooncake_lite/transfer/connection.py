"""One framed connection: an ``asyncio.BufferedProtocol`` that receives payloads in place.

Receiving: header and meta are parsed out of a small staging buffer. Before the payload arrives
the handler's ``payload_sink`` may hand back the memory it should land in (slab slots, a
caller's tensor); large payloads are then read by the kernel straight into that memory (no
intermediate copy), small ones are copied out of the staging buffer (one ``recv`` then serves
many small frames). Protocol violations close only this connection, with one log line.

Sending: ``send`` writes header, meta and payload buffers with one ``writelines`` (uvloop keeps
references, no copy). ``when_flushed(cb)`` runs ``cb`` once everything written so far has been
handed to the kernel, which is when memory being sent may be reused (the store's leases).

Bounds (``Limits``): every length is checked when the header arrives, before anything is
allocated; a server connection starts with a small staging buffer and accepts only a small meta
and no payload until its HELLO is accepted (:meth:`FrameConnection.authenticate`); fresh receive
memory is charged to an :class:`InflightBudget` shared by the server's connections; and a server
connection is closed when its handshake, a half-received frame or (optionally) an idle spell
takes too long.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lite.transfer.budget import BudgetShare, InflightBudget, OverBudget
from mooncake_lite.transfer.framing import (HEADER_BYTES, Buffer, Frame, FrameError, Header, Limits,
                                            decode_header, decode_meta, encode_frame)
from mooncake_lite.transfer.landing import Landing
from mooncake_lite.transfer.tcp import tune_socket

log = logging.getLogger(__name__)

STAGING_BYTES = 256 << 10
HELLO_STAGING_BYTES = 8 << 10  # a server connection's staging buffer until its handshake passes
DIRECT_MIN_BYTES = 64 << 10  # payload remainders at least this big are received in place
BULK_BYTES = 1 << 20  # after a frame this big, header and meta are read exactly (no read-ahead)


# The landing of every payload-less frame (most requests and replies): no views, never filled.
_NOTHING_LANDS = Landing([])

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
                 is_server: bool = False, *, authenticated: bool = True,
                 budget: InflightBudget | None = None) -> None:
        self.handler = handler
        # Only servers stop reading while their replies queue: if both ends did, two peers
        # writing big frames at each other could wait on each other forever. Only servers time
        # their peers out.
        self.is_server = is_server
        self.limits = limits
        self.name = name
        # False until the handler accepts the peer's HELLO (``authenticate``): until then a
        # header may announce only a small meta and no payload.
        self.authenticated = authenticated
        self._share = BudgetShare(budget)  # what the frame being received holds of it
        self._loop = asyncio.get_running_loop()
        self._now = self._loop.time
        self.transport: asyncio.Transport | None = None
        self.closed = self._loop.create_future()
        self.state: dict[str, Any] = {}  # for the handler (e.g. "authenticated")
        self._cap = STAGING_BYTES if authenticated else HELLO_STAGING_BYTES
        self._staging = bytearray(self._cap)
        self._sview = memoryview(self._staging)
        self._timer: asyncio.TimerHandle | None = None
        self._accepted = self._last_recv = self._frame_start = 0.0
        self._start = 0
        self._end = 0
        self._header: Header | None = None
        self._meta: dict[str, Any] | None = None
        self._meta_buf: bytearray | None = None  # only for metas too big for the staging buffer
        self._landing: Landing | None = None  # where the payload being received goes
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
        self._accepted = self._last_recv = self._frame_start = self._loop.time()
        if self.is_server:
            self._check_deadlines()
        self.handler.connection_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header is not None and self._meta is not None:
            got = self._header.payload_len - self._remaining
            log.warning("connection %s closed mid-frame (payload %d of %d bytes); frame dropped",
                        self.name, got, self._header.payload_len)
            self._safe(self.handler.frame_aborted, self, self._header, self._meta)
        self._header = self._meta = None
        self._meta_buf = None
        self._landing = None
        self._share.release()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._writes_flow(ConnectionError(f"connection {self.name} lost"))
        self._safe(self.handler.connection_lost, self, exc)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True
        if self.is_server and self.transport is not None:
            self.transport.pause_reading()  # back-pressure: no new requests while replies queue

    def resume_writing(self) -> None:
        if self.is_server and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        self._writes_flow(None)

    def _writes_flow(self, lost: Exception | None) -> None:
        """Nothing of ours waits in user space any more (all sent, or the connection ``lost``):
        run the flush callbacks and wake every ``drain``."""
        self._paused = False
        self._run_flush_callbacks()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None) if lost is None else waiter.set_exception(lost)
        self._drain_waiters.clear()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._start == self._end and self._header is not None:
            if self._meta_buf is not None:
                return memoryview(self._meta_buf)[len(self._meta_buf) - self._remaining:]
            if self._meta is not None and self._remaining >= DIRECT_MIN_BYTES:
                return self._landing.rest_of_view()  # type: ignore[union-attr]
        if self._start == self._end:
            self._start = self._end = 0
            if self._is_bulk:
                # Bulk traffic: read just the header, then just the meta, so the next payload is
                # not pulled into the staging buffer (and copied out again) ahead of its frame.
                if self._header is None:
                    return self._sview[:HEADER_BYTES]
                if self._meta is None and self._header.meta_len:
                    return self._sview[:self._header.meta_len]
        elif self._end == self._cap:
            self._compact()
        return self._sview[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.is_server:  # only servers time their peers out
            self._last_recv = now = self._now()
            if self._header is None and self._start == self._end:
                self._frame_start = now  # the first bytes of a frame
        try:
            if self._start == self._end and self._header is not None and (
                    self._meta_buf is not None or (self._meta is not None and self._remaining >= DIRECT_MIN_BYTES)):
                self._advance_direct(nbytes)
            else:
                self._end += nbytes
            self._process()
        except OverBudget as exc:
            self.abort(f"over the in-flight budget: {exc}")
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
                self._end_big_meta()
            return
        self._landing.received(nbytes)  # type: ignore[union-attr]
        if self._remaining == 0:
            self._deliver()

    def _process(self) -> None:
        while self.transport is not None and not self.transport.is_closing():
            avail = self._end - self._start
            if self._header is None:
                if avail < HEADER_BYTES:
                    return
                self._header = decode_header(self._sview[self._start:self._start + HEADER_BYTES], self.limits,
                                             self.authenticated)
                self._start += HEADER_BYTES
                self._remaining = self._header.meta_len
                if self._header.meta_len > self._cap // 2:
                    self._share.charge(self._header.meta_len, "meta")
                    self._meta_buf = bytearray(self._header.meta_len)
                    take = min(avail - HEADER_BYTES, self._remaining)
                    self._meta_buf[:take] = self._sview[self._start:self._start + take]
                    self._start += take
                    self._remaining -= take
                    if self._remaining:
                        return
                    self._end_big_meta()
                continue
            if self._meta is None:
                need = self._header.meta_len
                if avail < need:
                    if self._start + need > self._cap:
                        self._compact()
                    return
                meta = decode_meta(self._sview[self._start:self._start + need])
                self._start += need
                self._begin_payload(meta)
                continue
            take = min(avail, self._remaining)
            if take:
                self._landing.fill(self._sview[self._start:self._start + take])  # type: ignore[union-attr]
                self._start += take
                self._remaining -= take
            if self._remaining:
                return
            self._deliver()

    def _end_big_meta(self) -> None:
        """A meta too big for the staging buffer has all arrived (in its own buffer)."""
        meta_buf, self._meta_buf = self._meta_buf, None
        self._share.release()
        self._begin_payload(decode_meta(meta_buf))  # type: ignore[arg-type]

    def _begin_payload(self, meta: dict[str, Any]) -> None:
        header = self._header
        assert header is not None
        self._remaining = header.payload_len
        if not header.payload_len:   # most requests and replies: nothing to place
            self._meta, self._landing = meta, _NOTHING_LANDS
            self._deliver()
            return
        targets = self.handler.payload_sink(self, header, meta)
        if targets is None:
            # Only now, with the length checked against the limits and by the handler, is
            # memory allocated for it (and charged to the budget until the frame is delivered).
            self._share.charge(header.payload_len, "payload")
            targets = [memoryview(bytearray(header.payload_len))]
        self._meta = meta  # from here on, a dying connection reports frame_aborted
        if sum(t.nbytes for t in targets) != header.payload_len:
            raise FrameError(f"payload sink gave {sum(t.nbytes for t in targets)} bytes for a "
                             f"{header.payload_len}-byte payload")
        self._landing = Landing(targets)

    def _deliver(self) -> None:
        frame = Frame(self._header, self._meta, self._landing.views)  # type: ignore[arg-type,union-attr]
        self._is_bulk = frame.header.payload_len >= BULK_BYTES
        self._header = self._meta = None
        self._landing = None
        self._frame_start = self._last_recv
        if self._share.held:
            self._share.release()
        self.handler.frame_received(self, frame)

    # ---- bounds: handshake, timeouts (the budget: ``BudgetShare``) ---------------------------
    def authenticate(self) -> None:
        """The peer's HELLO was accepted: full limits and a full-size staging buffer from now on."""
        if self.authenticated:
            return
        self.authenticated = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._cap < STAGING_BYTES:
            unread = self._sview[self._start:self._end]
            staging = bytearray(STAGING_BYTES)
            staging[:unread.nbytes] = unread
            self._staging, self._sview, self._cap = staging, memoryview(staging), STAGING_BYTES
            self._start, self._end = 0, unread.nbytes
        if self.is_server:
            self._check_deadlines()

    def _deadline(self) -> tuple[float, str] | None:
        """When this connection must be closed if nothing changes, and why (None: no deadline)."""
        limits = self.limits
        if not self.authenticated:
            if limits.handshake_timeout is not None:
                return self._accepted + limits.handshake_timeout, f"no handshake within {limits.handshake_timeout:g}s"
            return None
        if self._paused:
            return None  # our own replies are queued (back-pressure): not the peer's stall
        if self._header is not None or self._start != self._end:
            stall = limits.stall_timeout
            if stall is None:
                return None
            if self._header is None or self._meta is None:
                return self._frame_start + stall, f"stalled: a frame's header and meta took over {stall:g}s"
            total = self._header.payload_len
            return (self._last_recv + stall,
                    f"stalled mid-frame: no bytes for {stall:g}s (payload {total - self._remaining} of {total})")
        if limits.idle_timeout is not None and not self._flush_callbacks:
            return self._last_recv + limits.idle_timeout, f"idle for {limits.idle_timeout:g}s"
        return None

    def _check_deadlines(self) -> None:
        """Close the connection if its deadline passed, else check again when it is due (and at
        least every stall period, so a frame that starts later is watched too)."""
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        now = self._loop.time()
        due = self._deadline()
        if due is not None and now >= due[0]:
            self.abort(due[1])
            return
        at = due[0] if due is not None else None
        periods = [t for t in (self.limits.stall_timeout, self.limits.idle_timeout) if t is not None]
        if periods:
            at = now + min(periods) if at is None else min(at, now + min(periods))
        if at is not None:
            self._timer = self._loop.call_at(at, self._check_deadlines)

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

    @property
    def must_drain(self) -> bool:
        """``drain`` would wait (our writes are paused) or fail (closing)."""
        return self._paused or self.transport is None or self.transport.is_closing()

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
