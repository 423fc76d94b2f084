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
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mooncake_lite.store.fastget import VERSION
from mooncake_lite.store.fastget_client import ALIGN, FastChannel, FastPath, open_fast, target_for
from mooncake_lite.store.protocol import Op
from mooncake_lite.store.shm_areas import SharedSlab, Staging, staging_window
from mooncake_lite.transfer.client import FrameClient, RemoteError
from mooncake_lite.transfer.framing import Frame
from mooncake_lite.transfer.shm import ShmError, align, aligned_buffer, open_offer

log = logging.getLogger(__name__)
Request = Callable[[Op, dict[str, Any]], Awaitable[Frame]]


class ShmPath(FastPath):
    """A same-node client's path to one store: its slab, its staging area, its single-block
    channel (``FastPath``: ``store/fastget_client.py``) and the leases it holds."""

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
        self._told_no_room = False   # logged once: a staged put went framed for want of room
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
                target = target_for(outs, i, size)
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
                target = target_for(outs, i, size)
            self.slab.copy(offset, size, target)
            result.append((target, num_layers))
        return result if all(self.slab.is_current(e[4], e[5]) for e in entries) else None   # type: ignore[index]

    # ---- puts --------------------------------------------------------------------------------
    def fits(self, sizes: Sequence[int]) -> bool:
        return self.staging is not None and sum(align(n, ALIGN) for n in sizes) <= self.staging.size

    async def put(self, meta: dict[str, Any], views: Sequence[memoryview], timeout: float | None) -> Frame:
        """One put batch through the staging area (``fits`` must be true); framed, with its
        bytes on the socket, when no room comes (see ``Staging.alloc``)."""
        staging = self.staging
        assert staging is not None
        need = sum(align(v.nbytes, ALIGN) for v in views)
        start = await staging.alloc(need, self._flush, self._may_free, timeout)
        if start is None:
            if not self._told_no_room:
                self._told_no_room = True
                log.info("%s: no room in the staging area that any put in flight would free "
                         "(a range stays taken): putting %d bytes over the socket",
                         self.frames.label, need)
            return await self.frames.request(Op.PUT, meta, views)
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

    def _may_free(self) -> bool:
        """Whether something of ours in flight could still free staging room: a staged put not
        answered, ranges the store may still be copying (a flush frees them), or a single-block
        request awaiting its reply (it frees its range when answered)."""
        fast = self.fast
        return bool(self._unanswered or self._copying or self._fast_copying
                    or (fast is not None and fast.busy and not fast.is_closed))

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
            self.staging.close()


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
            path.staging = Staging(staging, staging_window(frames.hello.get("slot_bytes")))
            await frames.request(Op.SHM_READY, {})
        except (ShmError, RemoteError) as exc:
            log.info("store %s: puts use TCP (%s)", frames.conn.name, exc)
            if path.staging is not None:
                path.staging.close()
            path.staging = None
    if offer.get("fast") == VERSION and offer.get("fast") is not True:   # this layout only (True == 1)
        path.fast = await open_fast(frames)
    return path
