"""Frames in, block-store operations out: the store's data-plane handler.

Puts are received straight into reserved slab slots (``payload_sink``) and committed only when
the whole frame has arrived, so a half-written block is never visible. Gets are sent from the
slab in place under a lease that ends when the bytes are in the kernel, or when it expires (the
connection is then aborted, so the memory is never read after it can be reused).
Most operations finish synchronously on the event loop; SSD promotions, deletes and
replication run as tasks.

No frame makes the store allocate memory for its payload: a put lands in its reserved slots, a
refused frame's payload is read into one scratch buffer and dropped. A payload larger than its op
can carry (a put: ``slot_bytes`` per key; anything else: nothing) is refused that way only up to
``DISCARD_BYTES``; beyond it the connection is closed at once instead of reading gigabytes.

A put with ``first_layer`` is one layer slice of its blocks (a CPP stage's): it lands in a slot
the assembler (``store/assembly.py``) holds apart, and the block becomes visible once whole.

Same-node clients move block bytes through shared memory instead (``store/shm.py``): gets with
``shm`` are answered with slab offsets under a read lease, puts with ``staged`` offsets carry no
payload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from mooncake_lite.store.assembly import SliceTicket
from mooncake_lite.store.blocks import BadRequest, Block, BlockStore, Lease, PutTicket, StoreFull
from mooncake_lite.store.protocol import (MetaError, Op, check_layout, head_spans, heads_from_read, int_from_meta,
                                          keys_from_meta, parse_peer, sizes_from_meta)
from mooncake_lite.store.shm import ShmService
from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import FLAG_REPLY, Frame, FrameError, Header
from mooncake_lite.transfer.kv_layout import HeadRange
from mooncake_lite.transfer.server import reply_error

log = logging.getLogger(__name__)

SCRATCH_BYTES = 1 << 20
# Metas carry up to a batch of keys (32 hex characters each); MATCH and REPLICATE send a whole
# prompt's keys at once: 1 MiB holds 32k keys (a 512k-token prompt of 16-token blocks).
META_BYTES = 1 << 20
# A refused payload up to this size is read and dropped, keeping the connection (a client's
# default batch); a bigger one over what its op can carry closes the connection.
DISCARD_BYTES = 64 << 20
MAX_PIN_NAME = 128   # a context hold's owner id
# Per-frame context (put ticket or error) rides in the frame's meta dict under a key no JSON
# object can contain, so a client cannot forge it.
_ERROR, _TICKET = object(), object()


class StoreHandler(FrameHandler):
    def __init__(self, store: BlockStore, *, lease_ttl: float, replicator: Callable[..., Coroutine] | None = None,
                 clock: Callable[[], float] = time.monotonic, shm_staging: int = 0) -> None:
        self.store = store
        self.shm = ShmService(store, staging_bytes=shm_staging, lease_ttl=lease_ttl, clock=clock)
        self.lease_ttl = lease_ttl
        self.replicator = replicator
        self.clock = clock
        self.connections: set[FrameConnection] = set()
        self.tasks: set[asyncio.Task] = set()
        self._next_lease_id = 0
        self._scratch = memoryview(bytearray(max(SCRATCH_BYTES, store.slab.slot_bytes)))

    # ---- connection bookkeeping ----------------------------------------------------------------
    def connection_made(self, conn: FrameConnection) -> None:
        self.connections.add(conn)

    def connection_lost(self, conn: FrameConnection, exc: Exception | None) -> None:
        self.connections.discard(conn)
        for lease in conn.state.pop("leases", {}).values():  # a client's match leases die with it
            self.store.unpin(lease)
        self.shm.connection_lost(conn)

    # ---- receiving puts in place ---------------------------------------------------------------
    def payload_sink(self, conn: FrameConnection, header: Header, meta: dict[str, Any]):
        self._end_reads(conn, meta)   # before this put reserves: the slots they pin may be needed
        if header.op != Op.PUT or "staged" in meta:
            self._check_refusable(header, 0, f"op {header.op} takes no payload")
            meta[_ERROR] = ("bad_request", f"op {header.op} takes no payload")
            return self._discard(header.payload_len)
        legit = 0   # what this put can carry: a slot per key (0 while its keys are unreadable)
        try:
            keys = keys_from_meta(meta)
            slot = self.store.slab.slot_bytes
            legit = slot * len(keys)
            self._check_refusable(header, legit, f"a put of {len(keys)} key(s) can carry at most "
                                                 f"{legit} bytes ({slot}-byte slots)")
            sizes = sizes_from_meta(meta, len(keys))
            if sum(sizes) != header.payload_len:
                raise MetaError(f"sizes add up to {sum(sizes)} but the payload has {header.payload_len} bytes")
            num_layers = int_from_meta(meta, "num_layers", 1, minimum=1)
            first_pos = int_from_meta(meta, "first_pos", 0)
            check_layout(meta)
            if "first_layer" in meta:   # a layer or head slice: held apart until its block is whole
                ticket = self.store.assembly.reserve_put(meta, keys, sizes, num_layers, first_pos, self.clock())
                meta[_TICKET] = ticket
                return self.store.assembly.views(ticket, self._scratch)
            ticket = self.store.reserve(keys, sizes, num_layers, first_pos)
        except (MetaError, BadRequest) as exc:
            self._check_refusable(header, legit, str(exc))
            meta[_ERROR] = ("bad_request", str(exc))
            return self._discard(header.payload_len)
        except StoreFull as exc:
            meta[_ERROR] = ("full", str(exc))
            return self._discard(header.payload_len)
        meta[_TICKET] = ticket
        return self.store.ticket_views(ticket, self._scratch)

    @staticmethod
    def _check_refusable(header: Header, legit: int, why: str) -> None:
        """Close the connection (FrameError) for a payload far over what its op can carry."""
        if header.payload_len > max(legit, DISCARD_BYTES):
            raise FrameError(f"payload of {header.payload_len} bytes refused: {why}")

    def _discard(self, nbytes: int) -> list[memoryview]:
        """Views that add up to ``nbytes``, all over one scratch buffer (bytes read and dropped)."""
        size = self._scratch.nbytes
        return [self._scratch] * (nbytes // size) + ([self._scratch[:nbytes % size]] if nbytes % size else [])

    def frame_aborted(self, conn: FrameConnection, header: Header, meta: dict[str, Any]) -> None:
        ticket: PutTicket | SliceTicket | None = meta.get(_TICKET)
        if isinstance(ticket, SliceTicket):
            self.store.assembly.cancel(ticket)
        elif ticket is not None:
            self.store.cancel(ticket)

    # ---- dispatch ----------------------------------------------------------------------------
    def _end_reads(self, conn: FrameConnection, meta: dict[str, Any]) -> None:
        """Same-node clients hand back their finished read leases with their next request
        (``reads_done``): end them before the request itself is handled."""
        if "reads_done" in meta:
            self.shm.end_reads(conn, meta.pop("reads_done"))

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        meta = frame.meta
        self._end_reads(conn, meta)
        if _ERROR in meta:
            reply_error(conn, frame, *meta[_ERROR])
            return
        op = frame.header.op
        try:
            if op == Op.GET or op == Op.GET_LAYERS:   # first: the latency-bound op
                self._get(conn, frame)
            elif op == Op.PUT and "staged" in meta:
                self.shm.staged_put(conn, frame)   # answers it
            elif op == Op.PUT:
                self._put(conn, frame)
            elif op == Op.MATCH:
                self._match(conn, frame)
            elif op == Op.RELEASE:
                lease = conn.state.get("leases", {}).pop(int_from_meta(meta, "lease_id"), None)
                if lease is not None:
                    self.store.unpin(lease)
                self._reply(conn, frame, {"released": lease is not None})
            elif op == Op.EXISTS:
                self._reply(conn, frame, {"exists": self.store.exists(keys_from_meta(meta))})
            elif op == Op.DELETE:
                self._spawn(conn, frame, self._delete(conn, frame, keys_from_meta(meta)))
            elif op in (Op.SHM_ATTACH, Op.SHM_READY, Op.READ_DONE, Op.FAST_ATTACH):
                self.shm.handle(conn, frame)
            elif op in (Op.PIN, Op.UNPIN):
                self._reply(conn, frame, self._pin(op, meta))
            elif op == Op.REPLICATE:
                peer = parse_peer(meta.get("peer"))
                first_pos = int_from_meta(meta, "first_pos", 0)
                self._spawn(conn, frame, self._replicate(conn, frame, keys_from_meta(meta), peer, first_pos,
                                                         _deadline(meta)))
            else:
                reply_error(conn, frame, "unknown_op", f"unknown op {op}")
        except (MetaError, BadRequest) as exc:
            reply_error(conn, frame, "bad_request", str(exc))
        except StoreFull as exc:
            reply_error(conn, frame, "full", str(exc))

    def _put(self, conn: FrameConnection, frame: Frame) -> None:
        """A framed put whose payload has landed where ``payload_sink`` reserved: commit it."""
        ticket: PutTicket | SliceTicket | None = frame.meta.get(_TICKET)
        if ticket is None and keys_from_meta(frame.meta):
            raise MetaError("a put of blocks needs a payload")
        if isinstance(ticket, SliceTicket):
            self.store.stats.bytes_in += sum(ticket.sizes)
            num_new = self.store.assembly.commit(ticket)
        else:
            num_new = 0 if ticket is None else self.store.commit(ticket)
        self._reply(conn, frame, {"num_new": num_new})

    def _match(self, conn: FrameConnection, frame: Frame) -> None:
        """How long a prefix of the keys the store holds; with ``lease_s``, pinned that long too."""
        lease_s = frame.meta.get("lease_s")
        if lease_s is None:
            self._reply(conn, frame, {"num_matched": self.store.match(keys_from_meta(frame.meta))})
            return
        if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or not lease_s > 0:
            raise MetaError(f"'lease_s' must be a positive number, got {lease_s!r}")
        self._spawn(conn, frame, self._match_and_pin(conn, frame, keys_from_meta(frame.meta),
                                                     min(float(lease_s), self.lease_ttl)))

    def _reply(self, conn: FrameConnection, frame: Frame, meta: dict[str, Any]) -> None:
        conn.send(frame.op, frame.request_id, meta, flags=FLAG_REPLY)

    def _spawn(self, conn: FrameConnection, frame: Frame, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(self._guard(conn, frame, coro))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guard(self, conn: FrameConnection, frame: Frame, coro: Coroutine) -> None:
        try:
            await coro
        except (MetaError, BadRequest) as exc:
            self._safe_error(conn, frame, "bad_request", str(exc))
        except Exception as exc:
            log.exception("store op %d failed", frame.op)
            self._safe_error(conn, frame, "internal", f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _safe_error(conn: FrameConnection, frame: Frame, code: str, message: str) -> None:
        try:
            reply_error(conn, frame, code, message)
        except ConnectionError:
            pass

    # ---- gets --------------------------------------------------------------------------------
    def _get(self, conn: FrameConnection, frame: Frame) -> None:
        keys = keys_from_meta(frame.meta)
        layers, read = None, None   # read: a TP rank's heads of each layer, parsed once here
        if frame.op == Op.GET_LAYERS:
            layers = (int_from_meta(frame.meta, "first_layer", 0), int_from_meta(frame.meta, "num_layers", 1, minimum=1))
            read = heads_from_read(frame.meta)
            if read is not None and frame.meta.get("shm") is True:
                raise MetaError("a head range read goes on the socket: a same-node client cuts its heads itself")
        found, on_ssd = self.store.lookup_dram(keys)
        if on_ssd:
            # Pin the DRAM hits now: the task starts later, and puts in between may evict.
            lease = self.store.pin([b for b in found if b is not None], self.clock() + self.lease_ttl)
            self._spawn(conn, frame, self._get_with_promotion(conn, frame, keys, found, on_ssd, layers, read, lease))
        else:
            self._send_blocks(conn, frame, found, layers, read)

    async def _get_with_promotion(self, conn, frame, keys, found, on_ssd, layers, read, lease: Lease) -> None:
        # Each block is pinned as it is promoted, so later promotions (which may evict) cannot
        # take it away before it is sent.
        expires_at = lease.expires_at
        leases = [lease]
        try:
            for i in on_ssd:
                found[i] = item = await self.store.promote(keys[i])
                if isinstance(item, Block):
                    leases.append(self.store.pin([item], expires_at))
        finally:
            for lease in leases:
                self.store.unpin(lease)
        if not conn.closed.done():
            self._send_blocks(conn, frame, found, layers, read)

    def _send_blocks(self, conn: FrameConnection, frame: Frame, found: list, layers: tuple[int, int] | None,
                     read: tuple[int, HeadRange] | None) -> None:
        if frame.meta.get("shm") is True and self.shm.is_enabled:
            self.shm.reply_spans(conn, frame, found, layers)
            return
        views: list[memoryview] = []
        run: list[tuple[int, int]] = []  # slab spans of consecutive found blocks, merged when adjacent
        sizes, block_layers, pinned = [], [], []
        for item in found:
            if item is None:
                sizes.append(None)
                block_layers.append(None)
            elif isinstance(item, Block):
                spans = [self.store.span(item, *layers) if layers else self.store.span(item)] if read is None else \
                    [(self.store.slab.offset_of(item.slot, offset), n)
                     for offset, n in head_spans(item.size, item.num_layers, *layers, read)]
                run += spans
                pinned.append(item)
                sizes.append(sum(n for _, n in spans))
                block_layers.append(item.num_layers)
            else:  # SSD bytes that could not be promoted (DRAM full of leased blocks)
                if layers:
                    raise BadRequest("layer reads of blocks that could not be promoted are not supported")
                views += self.store.slab.views(run)
                run = []
                views.append(memoryview(item))
                sizes.append(len(item))
                block_layers.append(None)
        views += self.store.slab.views(run)
        lease = self.store.pin(pinned, self.clock() + self.lease_ttl,
                               on_expire=lambda: conn.abort("lease expired while sending (client not reading)"))
        try:
            conn.send(frame.op, frame.request_id, {"sizes": sizes, "num_layers": block_layers}, views, flags=FLAG_REPLY)
        except ConnectionError:
            self.store.unpin(lease)
            return
        self.store.stats.bytes_out += sum(s for s in sizes if s)
        conn.when_flushed(lambda: self.store.unpin(lease))

    async def _match_and_pin(self, conn: FrameConnection, frame: Frame, keys: list[bytes], lease_s: float) -> None:
        """Longest held prefix, promoted into DRAM and pinned under one lease owned by ``conn``."""
        num = self.store.match(keys)
        found, on_ssd = self.store.lookup_dram(keys[:num])
        leases: dict[int, Lease] = conn.state.setdefault("leases", {})
        self._next_lease_id += 1
        lease_id = self._next_lease_id
        lease = leases[lease_id] = self.store.pin(
            [b for b in found if b is not None], self.clock() + lease_s,
            on_expire=lambda: leases.pop(lease_id, None))
        for i in on_ssd:
            item = await self.store.promote(keys[i])
            if not isinstance(item, Block) or not lease.is_active:
                num = i  # the prefix we can vouch for ends here
                break
            self.store.extend(lease, [item])
            found[i] = item
        reply: dict[str, Any] = {"num_matched": num, "lease_id": lease_id}
        if frame.meta.get("shm") is True and self.shm.is_enabled and lease.is_active:
            # Offsets only for blocks this lease pins: the client may read them until it ends.
            reply["spans"] = self.shm.match_spans(found[:num])
        self._reply(conn, frame, reply)

    def _pin(self, op: Op, meta: dict[str, Any]) -> dict[str, Any]:
        owner = meta.get("pin")
        if not isinstance(owner, str) or not 0 < len(owner) <= MAX_PIN_NAME:
            raise MetaError(f"'pin' must be a string of 1 to {MAX_PIN_NAME} characters")
        if op == Op.UNPIN:
            return {"released": self.store.unhold(owner)}
        expires_at = meta.get("expires_at")
        if not isinstance(expires_at, (int, float)) or isinstance(expires_at, bool):
            raise MetaError(f"'expires_at' must be a number (unix seconds), got {expires_at!r}")
        return {"num_held": self.store.hold(owner, keys_from_meta(meta), float(expires_at))}

    # ---- slow ops ----------------------------------------------------------------------------
    async def _delete(self, conn: FrameConnection, frame: Frame, keys: list[bytes]) -> None:
        num = await self.store.delete(keys)
        self._reply(conn, frame, {"num_deleted": num})

    async def _replicate(self, conn: FrameConnection, frame: Frame, keys: list[bytes], peer: tuple[str, int],
                         first_pos: int, deadline: float | None) -> None:
        if self.replicator is None:
            self._safe_error(conn, frame, "bad_request", "replication is not configured on this store")
            return
        try:
            # The caller's deadline bounds the pull (the peer client's own one may be longer):
            # a cut peer is answered with an error naming it before the caller gives up.
            async with asyncio.timeout(deadline):
                result = await self.replicator(keys, peer, first_pos)
        except StoreFull as exc:
            self._safe_error(conn, frame, "full", str(exc))
            return
        except TimeoutError as exc:   # the peer client's NoAnswer names the op; ours, the whole pull
            why = str(exc) or f"store {peer[0]}:{peer[1]} replicate: no answer in {deadline or 0:g} s"
            self._safe_error(conn, frame, "peer_error", why)
            return
        except (OSError, ConnectionError, RuntimeError) as exc:
            self._safe_error(conn, frame, "peer_error", f"{peer[0]}:{peer[1]}: {exc}")
            return
        self._reply(conn, frame, result)

    # ---- upkeep ------------------------------------------------------------------------------
    async def run_lease_sweeper(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            num = self.store.expire_leases(self.clock())
            if num:
                log.warning("%d lease(s) expired; their connections were closed", num)
            for owner in self.store.expire_holds(time.time()):   # wall clock: holds outlive restarts
                log.info("context hold %s expired", owner)
            num = self.store.assembly.expire(self.clock())
            if num:
                log.warning("%d block(s) put in layer slices expired unfinished (a layer range never came)", num)


def _deadline(meta: dict[str, Any]) -> float | None:
    """A replicate's ``timeout_s`` (the caller's deadline for the pull); None if absent."""
    value = meta.get("timeout_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise MetaError(f"timeout_s must be a positive number of seconds, got {value!r}")
    return float(value)
