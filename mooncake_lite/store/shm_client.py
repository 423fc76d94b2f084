"""The client side of the same-node fast path (the store side and the protocol: ``store/shm.py``).

``attach`` maps the slab a store offered in its HELLO reply (read-only; the store sealed it so
no process but the store can write it) and asks for a staging area for puts. Anything that
fails (another host or namespace, another user, an old store, a nonce that does not match)
leaves the client on TCP: ``attach`` returns None, or a path without staging.

Every copy out of the slab is checked afterwards against the generation of its slot, which the
store bumps whenever it frees a slot: a block the store reused while we copied (only possible
once its lease ran out) is detected and fetched again over the socket, never returned torn.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mooncake_lite.store.fastget import (COPYING, GET, PUT, PUT_BODY, REFUSED, REPLY, REQUEST, SECRET_BYTES,
                                          VERSION)
from mooncake_lite.store.protocol import Op
from mooncake_lite.store.slab import Populator
from mooncake_lite.transfer.client import FrameClient, NoAnswer, RemoteError
from mooncake_lite.transfer.framing import Frame
from mooncake_lite.transfer.shm import Mapping, ShmError, align, aligned_buffer, copy, open_offer

log = logging.getLogger(__name__)
Request = Callable[[Op, dict[str, Any]], Awaitable[Frame]]
ALIGN = 64   # staged blocks start on cache lines (copies between misaligned buffers are slow)
# How long a single-block request may block its event loop waiting for the store's answer before
# it waits the asynchronous way (the kernel rounds it up to a timer tick): 20x or more an answer's
# usual 45-140 µs here, so only a busy store makes a request wait so long.
SYNC_WAIT_S = 0.001
# A single-block request not answered in this long (a store that busy, or a channel that lost its
# way) gives the channel up: that request and all later ones go framed, which answer regardless.
GIVE_UP_S = 2.0


class SharedSlab:
    """The store's slab as mapped here: read-only bytes plus the slot generations."""

    def __init__(self, mapping: Mapping, gens_offset: int, num_slots: int) -> None:
        if not (0 < gens_offset and num_slots > 0 and gens_offset + 8 * num_slots <= mapping.size):
            raise ShmError("malformed slab offer")
        self.mapping = mapping
        self.num_slots = num_slots
        self.gens = mapping.view[gens_offset:gens_offset + 8 * num_slots].cast("Q")

    def copy(self, offset: int, size: int, target: memoryview) -> None:
        if not (0 <= offset and offset + size <= self.mapping.size):
            raise RemoteError("bad_reply", f"store named bytes [{offset}, +{size}) outside its slab")
        copy(target[:size], self.mapping.view[offset:offset + size])

    def is_current(self, slot: int, gen: int) -> bool:
        if not 0 <= slot < self.num_slots:
            raise RemoteError("bad_reply", f"store named slot {slot} of {self.num_slots}")
        return self.gens[slot] == gen

    def close(self) -> None:
        self.gens.release()
        self.mapping.close()


class Staging:
    """This connection's staging area, handed out first-fit to the puts in flight."""

    def __init__(self, mapping: Mapping) -> None:
        self.mapping = mapping
        self.size = mapping.size
        # Its pages, faulted in by a background thread: a first write into a page costs a page
        # fault (0.2 GB/s here against 5-7 into resident pages), which the first puts would pay.
        # Small chunks: closing the connection waits for the one under way, on the event loop.
        self.populator = Populator(mapping.map, mapping.view, "staging area", sync_bytes=0, chunk=2 << 20)
        self._free: list[tuple[int, int]] = [(0, mapping.size)]   # (start, length), sorted
        self._waiters: list[asyncio.Future] = []

    async def alloc(self, nbytes: int, unblock: Callable[[], Awaitable[bool]] | None = None) -> int:
        """A range of ``nbytes``; waits for one to be freed (``unblock``: tried first, true when
        it freed something)."""
        while (start := self._take(nbytes)) is None:
            if unblock is not None and await unblock():
                continue
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        return start

    def _take(self, nbytes: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= nbytes:
                self._free[i:i + 1] = [(start + nbytes, length - nbytes)] if length > nbytes else []
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        self._free.append((start, nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged
        self.wake()

    def wake(self) -> None:
        """Let every ``alloc`` waiting try again (room was freed, or can now be flushed free)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class FastChannel:
    """The client end of the store's single-block channel (``store/fastget.py``), on a plain
    socket: a round trip is made from the caller's thread with blocking calls, not through the
    event loop. An event loop hop on each side is most of what a 64 KiB get costs (the copy is
    a few µs); waiting here for the store's answer saves the client's: no future, no timer, no
    wake-up of the loop (a 64 KiB get 82-85 -> 44-51 µs p50 here). The loop is blocked at most
    ``SYNC_WAIT_S`` (rounded up to a kernel tick) per request: an answer not in by then (a busy
    store) is awaited the asynchronous way, and while one is, other single gets and puts go
    framed. Replies carry their request's id: one that comes after its request gave up is
    skipped and handed to that request's ``on_late`` (a get's lease back, a put's range free)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ids = itertools.count()
        self.busy = False        # a request's answer is being awaited asynchronously
        self.is_closed = False
        self._reply = memoryview(bytearray(REPLY.size))
        self._got = 0            # bytes of the reply being read (kept across a timeout)
        self._late: dict[int, Callable[[tuple], None]] = {}   # request id -> what its late reply is for
        # Blocking, with the wait bounded by the kernel (SO_RCVTIMEO): one recv per answer, where
        # Python's own socket timeout costs a failed recv and a poll first.
        sock.setblocking(True)
        wait = struct.pack("ll", 0, int(SYNC_WAIT_S * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wait)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, wait)   # a request that cannot go: lost

    @property
    def usable(self) -> bool:
        return not (self.busy or self.is_closed)

    async def ask(self, op: int, key: bytes, done: int, timeout: float | None, peer: str, body: bytes = b"",
                  on_late: Callable[[tuple], None] | None = None) -> tuple[int, int, int, int, int, int] | None:
        """The reply's (read lease, offset, size, num_layers, slot, generation); None when the
        channel is gone (or given up: no answer in ``GIVE_UP_S``, when ``timeout`` is longer).
        Raises ``NoAnswer`` after a shorter ``timeout``; the channel stays, and ``on_late`` gets
        that reply's fields when it comes (as it does if the caller is cancelled)."""
        request_id = next(self.ids) % 0xFFFFFFFF + 1   # u32 on the wire, never 0 (a hand-back)
        try:
            self.sock.send(REQUEST.pack(op, request_id, done, key) + body)
            while True:
                reply = self._read_now()
                if reply is None:
                    give_up = timeout is None or timeout > GIVE_UP_S
                    try:
                        reply = await self._read_later(GIVE_UP_S if give_up else timeout, peer)
                    except (NoAnswer, asyncio.CancelledError) as exc:
                        if give_up and isinstance(exc, NoAnswer):
                            log.warning("%s: no answer on the single-block channel in %.0f s: "
                                        "using framed requests from now on", peer, GIVE_UP_S)
                            self.close()
                            return None
                        if on_late is not None:
                            self._late[request_id] = on_late
                        raise
                if reply[0] == request_id:
                    return reply[1:]
                late = self._late.pop(reply[0], None)
                if late is not None:
                    late(reply[1:])
        except NoAnswer:
            raise
        except (OSError, ValueError):   # the socket died or was closed under us
            self.close()
            return None

    def _read_now(self) -> tuple | None:
        """A whole reply within ``SYNC_WAIT_S``, else None (the part read is kept)."""
        while self._got < REPLY.size:
            try:
                n = self.sock.recv_into(self._reply[self._got:])
            except BlockingIOError:   # SO_RCVTIMEO ran out
                return None
            if not n:
                raise ConnectionError("fast get channel closed")
            self._got += n
        self._got = 0
        return REPLY.unpack(self._reply)

    async def _read_later(self, timeout: float | None, peer: str) -> tuple:
        loop = asyncio.get_running_loop()
        self.busy = True
        self.sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                while self._got < REPLY.size:
                    n = await loop.sock_recv_into(self.sock, self._reply[self._got:])
                    if not n:
                        raise ConnectionError("fast get channel closed")
                    self._got += n
        except TimeoutError:
            raise NoAnswer(peer, "fast request", timeout or 0.0) from None
        finally:
            self.busy = False
            if not self.is_closed:
                self.sock.setblocking(True)
        self._got = 0
        return REPLY.unpack(self._reply)

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.sock.close()


class ShmPath:
    def __init__(self, frames: FrameClient, slab: SharedSlab, staging: Staging | None = None) -> None:
        self.frames = frames
        self.slab = slab
        self.staging = staging
        self.fast: FastChannel | None = None   # single gets, when the store offers the channel
        # key -> (lease id, offset, size, num_layers, slot, generation) of blocks a MATCH pinned,
        # newest lease last: several leases may cover one key (requests sharing a prefix), and
        # the key stays readable here until the last of them is forgotten.
        self._pinned: dict[bytes, list[tuple[int, int, int, int, int, int]]] = {}
        # lease id -> (when it ends at the latest (loop time), the keys it covers)
        self._leases: dict[int, tuple[float, list[bytes]]] = {}
        # Staged ranges of puts answered but maybe still being copied out by the store, and the
        # staged puts not answered yet (see ``put``).
        self._copying: list[tuple[int, int]] = []
        self._unanswered = 0
        # Ranges of single-block puts the store answered before copying (``COPYING``): free once
        # a later reply on the single-block channel (or a framed answer asked after it) arrives.
        self._fast_copying: list[tuple[int, int]] = []
        # Read leases we are done with, not yet told to the store: they ride on our next
        # request ("reads_done"), or go alone (READ_DONE) once the loop comes round with none.
        self._reads_done: list[int] = []
        self._done_soon: asyncio.Handle | None = None
        frames.piggyback = self._take_reads_done
        self.is_closed = False
        # Unmap as soon as the connection is gone: a mapping keeps a dead store's whole slab
        # allocated, and the owner of a lost client may never call close().
        frames.conn.closed.add_done_callback(lambda _: self.close())

    # ---- gets --------------------------------------------------------------------------------
    async def read(self, request: Request, op: Op, meta: dict[str, Any], outs: Sequence[memoryview | None] | None
                   ) -> tuple[list[tuple[memoryview, int] | None], list[int]]:
        """One get batch through the slab: the blocks, and the indexes of those that went stale
        while copied (the caller fetches those over the socket)."""
        frame = await request(op, {**meta, "shm": True})
        if self.is_closed:
            raise ConnectionError(f"connection {self.frames.conn.name} lost")
        sizes, counts, spans = frame.meta["sizes"], frame.meta["num_layers"], frame.meta.get("spans")
        if not isinstance(spans, list) or len(spans) != len(sizes):
            raise RemoteError("bad_reply", "a shared-memory get reply without spans")
        raw, raw_offset = (frame.payload[0] if frame.payload else None), 0
        result: list[tuple[memoryview, int] | None] = []
        checks = []
        try:
            for i, (size, span) in enumerate(zip(sizes, spans)):
                if not size:
                    result.append(None)
                    continue
                target = _target(outs, i, size)
                if span is None:   # bytes the store could not keep in DRAM came on the socket
                    target[:] = raw[raw_offset:raw_offset + size]
                    raw_offset += size
                else:
                    offset, slot, gen = span
                    self.slab.copy(offset, size, target)
                    checks.append((i, slot, gen))
                result.append((target, counts[i]))
            return result, [i for i, slot, gen in checks if not self.slab.is_current(slot, gen)]
        finally:
            self._finished(frame.meta.get("read"))

    def _finished(self, read_id: Any) -> None:
        """End the read lease without a frame of its own on the get's path: the store learns it
        with our next request (before handling that request, so a put right after a get finds
        the slot unpinned, as over TCP) or, if none goes out first, from a one-way READ_DONE
        sent as soon as the event loop comes round. Either way a get leaves nothing pinned
        behind it, and back-to-back gets cost one frame each way."""
        if not isinstance(read_id, int):
            return
        self._reads_done.append(read_id)
        if self._done_soon is None:
            self._done_soon = asyncio.get_running_loop().call_soon(self._send_reads_done)

    async def fast_get(self, key: bytes, out: memoryview | None, timeout: float | None
                       ) -> tuple[memoryview, int] | None:
        """One block through the single-get channel; None: ask the framed way (not in the
        store's DRAM, the channel is gone or busy, or the slot changed while we copied)."""
        fast = self.fast
        if fast is None or not fast.usable or self.is_closed:
            return None
        reply = await self._ask_fast(fast, GET, key, timeout, self._late_get)
        if reply is None:
            return None
        read_id, offset, size, num_layers, slot, gen = reply
        if not size:
            return None
        target = _target(None if out is None else [out], 0, size)
        try:
            self.slab.copy(offset, size, target)
            current = self.slab.is_current(slot, gen)
        finally:
            self._finished(read_id)
        return (target, num_layers) if current else None

    async def _ask_fast(self, fast: FastChannel, op: int, key: bytes, timeout: float | None,
                        on_late: Callable[[tuple], None], body: bytes = b"") -> tuple | None:
        # A lease we are done with rides on this request (the rest go as they would anyway).
        done = self._reads_done.pop() if self._reads_done else 0
        # The channel's replies come in the order the store wrote them, so this request's reply
        # comes after the copies of every put answered ``COPYING`` before it.
        owed, self._fast_copying = self._fast_copying, []
        try:
            reply = await fast.ask(op, key, done, timeout, self.frames.label, body, on_late)
        except BaseException:
            self._owed_back(owed)
            raise
        if reply is None:
            self._owed_back(owed)   # the framed ``_flush`` frees them
            if done:
                self._finished(done)   # maybe not delivered: READ_DONE says it again (harmless)
            return None
        for start, need in owed:
            self.staging.free(start, need)   # type: ignore[union-attr]
        return reply

    def _owed_back(self, owed: list[tuple[int, int]]) -> None:
        if owed:
            self._fast_copying[:0] = owed
            self.staging.wake()   # type: ignore[union-attr]   # flushable again (see ``_answered``)

    async def fast_put(self, key: bytes, block: memoryview, num_layers: int, first_pos: int,
                       timeout: float | None) -> int | None:
        """One block through the staging area and the single-block channel: 1 if new, 0 if
        not; None: put it the framed way (no room in the staging area right now, the channel
        busy or gone, or the store did not take it, and the framed put says why). A big block
        is answered before the store copies it out (``COPYING``), so its range stays taken
        until the next reply on the channel; the next put is copied in meanwhile."""
        fast, staging = self.fast, self.staging
        if fast is None or staging is None or not fast.usable or self.is_closed:
            return None
        need = align(block.nbytes, ALIGN)
        start = staging._take(need)
        if start is None and self._fast_copying:   # room the store is done with: one reply frees it
            got = await self._ask_fast(fast, GET, bytes(16), timeout, self._late_get)
            if got is not None and got[0]:
                self._finished(got[0])
            start = staging._take(need) if fast.usable else None
        if start is None:
            return None
        copy(staging.mapping.view[start:start + block.nbytes], block)
        body = PUT_BODY.pack(start, block.nbytes, num_layers, first_pos)
        # A request that timed out or was cancelled is still read by the store: its range is
        # free only once its late answer (and, if that says COPYING, the one after) is in.
        reply = await self._ask_fast(fast, PUT, key, timeout, lambda late: self._put_answered(late, start, need), body)
        if reply is None:
            return None   # the channel is gone, maybe after the store read the request: the range stays taken
        self._put_answered(reply, start, need)
        return None if reply[1] == REFUSED else reply[2]

    def _put_answered(self, reply: tuple, start: int, need: int) -> None:
        if reply[1] == COPYING:
            self._fast_copying.append((start, need))
            self.staging.wake()   # type: ignore[union-attr]   # flushable now (see ``_answered``)
        else:
            self.staging.free(start, need)   # type: ignore[union-attr]

    def _late_get(self, reply: tuple) -> None:
        if reply[0]:
            self._finished(reply[0])

    def _take_reads_done(self) -> dict[str, Any] | None:
        if not self._reads_done:
            return None
        done, self._reads_done = self._reads_done, []
        return {"reads_done": done}

    def _send_reads_done(self) -> None:
        self._done_soon = None
        done = self._take_reads_done()
        if done is None or self.is_closed:
            return
        try:
            self.frames.conn.send(Op.READ_DONE, 0, {"reads": done["reads_done"]})
        except ConnectionError:
            pass   # the leases end with the connection anyway

    def remember(self, lease_id: int, keys: Sequence[bytes], spans: Any, lease_s: float) -> None:
        """Blocks a MATCH pinned for us, readable without asking the store until released (or
        until the lease has surely ended: then they are forgotten, so unreleased leases cost no
        memory here)."""
        now = asyncio.get_running_loop().time()
        for ended in [i for i, (end, _) in self._leases.items() if end < now]:
            self.forget(ended)
        if not isinstance(spans, list):
            return
        covered = []
        for key, span in zip(keys, spans):
            if isinstance(span, list) and len(span) == 5 and all(type(x) is int for x in span):
                self._pinned.setdefault(key, []).append((lease_id, *span))
                covered.append(key)
        self._leases[lease_id] = (now + lease_s, covered)

    def forget(self, lease_id: int) -> None:
        _, keys = self._leases.pop(lease_id, (0.0, []))
        for key in keys:
            kept = [e for e in self._pinned.get(key, ()) if e[0] != lease_id]
            if kept:
                self._pinned[key] = kept
            else:
                self._pinned.pop(key, None)

    @property
    def num_leases(self) -> int:
        """Match leases whose blocks are readable here without asking (not yet forgotten)."""
        return len(self._leases)

    def covers(self, keys: Sequence[bytes]) -> bool:
        """Every key is under a match lease we hold (``read_pinned`` may serve them)."""
        return bool(keys) and not self.is_closed and all(key in self._pinned for key in keys)

    def read_pinned(self, keys: Sequence[bytes], outs: Sequence[memoryview | None] | None,
                    layers: tuple[int, int] | None) -> list[tuple[memoryview, int]] | None:
        """The blocks (or layer ranges) straight from the slab when our leases cover every key
        and nothing went stale; else None (ask the store)."""
        entries = [self._pinned[key][-1] if key in self._pinned else None for key in keys]
        if not keys or None in entries or self.is_closed:
            return None
        spans = []
        for _, offset, size, num_layers, slot, gen in entries:   # type: ignore[misc]
            if layers is not None:
                first, count = layers
                if first < 0 or count < 1 or first + count > num_layers:
                    return None   # the store gives the error
                offset, size = offset + first * (size // num_layers), count * (size // num_layers)
            spans.append((offset, size, num_layers))
        # Without ``out`` buffers, one fresh allocation cut into 64-byte aligned pieces: a layer
        # load of many blocks is many small copies, and an allocation each cost as much as the copy.
        arena = aligned_buffer(sum(align(size, ALIGN) for _, size, _ in spans)) if outs is None else None
        result, pos = [], 0
        for i, (offset, size, num_layers) in enumerate(spans):
            if arena is not None:
                target, pos = arena[pos:pos + size], pos + align(size, ALIGN)
            else:
                target = _target(outs, i, size)
            self.slab.copy(offset, size, target)
            result.append((target, num_layers))
        return result if all(self.slab.is_current(e[4], e[5]) for e in entries) else None   # type: ignore[index]

    # ---- puts --------------------------------------------------------------------------------
    def fits(self, sizes: Sequence[int]) -> bool:
        return self.staging is not None and sum(align(n, ALIGN) for n in sizes) <= self.staging.size

    async def put(self, meta: dict[str, Any], views: Sequence[memoryview], timeout: float | None) -> Frame:
        """One put batch through the staging area (``fits`` must be true)."""
        staging = self.staging
        assert staging is not None
        need = sum(align(v.nbytes, ALIGN) for v in views)
        start = await staging.alloc(need, self._flush)
        if self.is_closed:
            staging.free(start, need)
            raise ConnectionError(f"connection {self.frames.conn.name} lost")
        offsets, pos = [], start
        for view in views:
            staging.mapping.view[pos:pos + view.nbytes] = view
            offsets.append(pos)
            pos += align(view.nbytes, ALIGN)
        reply = asyncio.ensure_future(self.frames.request(Op.PUT, {**meta, "staged": offsets}))
        self._unanswered += 1
        # A caller that times out must not let the next put overwrite bytes not yet copied:
        # the range is let go only by the answer (and what follows it), whoever waits for it.
        reply.add_done_callback(lambda f: self._answered(f, start, need))
        return await (asyncio.wait_for(asyncio.shield(reply), timeout) if timeout else asyncio.shield(reply))

    def _answered(self, reply: asyncio.Future, start: int, need: int) -> None:
        """The store answers a staged put of whole blocks before copying them out (``copying``),
        so its range stays taken; the store handles a connection's frames in order, so any later
        answer means the copies before it are over: those ranges are free now."""
        self._unanswered -= 1
        staging = self.staging
        if staging is None:
            return
        self._release_copying()
        if not reply.cancelled() and reply.exception() is None and reply.result().meta.get("copying") is True:
            self._copying.append((start, need))
            # A put waiting for room may have found this one in flight (nothing to flush then):
            # now the range can be flushed free, so it must look again, or it waits for ever.
            staging.wake()
        else:
            staging.free(start, need)

    def _release_copying(self) -> None:
        copied, self._copying = self._copying, []
        for start, need in copied:
            self.staging.free(start, need)   # type: ignore[union-attr]

    async def _flush(self) -> bool:
        """No room, and no staged put in flight whose answer would free some: ask the store
        anything (an empty EXISTS) — its answer comes after the copies it owed us (those of
        single-block puts answered COPYING too: their answers came before we asked)."""
        owed = [] if self._unanswered else list(self._copying)
        fast_owed = list(self._fast_copying)
        if not (owed or fast_owed) or self.is_closed:
            return False
        await self.frames.request(Op.EXISTS, {"keys": []})
        for pending, entries in ((self._copying, owed), (self._fast_copying, fast_owed)):
            for entry in entries:
                if entry in pending:
                    pending.remove(entry)
                    self.staging.free(*entry)   # type: ignore[union-attr]
        return True

    def close(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        if self.fast is not None:
            self.fast.close()
        self.slab.close()
        if self.staging is not None:
            self.staging.populator.stop()
            self.staging.mapping.close()


def _target(outs: Sequence[memoryview | None] | None, i: int, size: int) -> memoryview:
    out = outs[i] if outs is not None else None
    return out[:size] if out is not None and out.nbytes >= size else aligned_buffer(size)


async def attach(frames: FrameClient) -> ShmPath | None:
    """The fast path to the store behind ``frames`` if it offered one we can use, else None."""
    offer = frames.hello.get("shm")
    if not isinstance(offer, dict):
        return None
    try:
        mapping = open_offer(offer)
    except ShmError as exc:
        log.info("store %s: using TCP, its shared memory is not usable here (%s)", frames.conn.name, exc)
        return None
    try:
        path = ShmPath(frames, SharedSlab(mapping, int(offer.get("gens_offset", 0)), int(offer.get("num_slots", 0))))
    except (ShmError, TypeError, ValueError) as exc:
        mapping.close()
        log.info("store %s: using TCP (%s)", frames.conn.name, exc)
        return None
    if offer.get("staging"):
        try:
            reply = await frames.request(Op.SHM_ATTACH, {})
            staging = open_offer(reply.meta, writable=True)
            path.staging = Staging(staging)
            await frames.request(Op.SHM_READY, {})
        except (ShmError, RemoteError) as exc:
            log.info("store %s: puts use TCP (%s)", frames.conn.name, exc)
            if path.staging is not None:
                path.staging.populator.stop()
                path.staging.mapping.close()
            path.staging = None
    if offer.get("fast") == VERSION and offer.get("fast") is not True:   # this layout only (True == 1)
        path.fast = await _open_fast(frames)
    return path


async def _open_fast(frames: FrameClient) -> FastChannel | None:
    """The store's single-get channel: its name and our secret come on the authenticated
    connection; the secret is the first thing we send on the channel."""
    try:
        reply = await frames.request(Op.FAST_ATTACH, {})
        name, secret = str(reply.meta["socket"]), bytes.fromhex(reply.meta["secret"])
        if len(secret) != SECRET_BYTES:
            raise ValueError("a secret of the wrong size")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, "\0" + name)
            sock.setblocking(True)
            sock.sendall(secret)   # a few bytes into an empty socket buffer: never blocks
        except BaseException:
            sock.close()
            raise
    except (RemoteError, OSError, KeyError, TypeError, ValueError) as exc:
        log.info("store %s: single gets go framed (%s)", frames.conn.name, exc)
        return None
    return FastChannel(sock)
