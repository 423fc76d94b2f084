"""The store side of the same-node fast path: block bytes through shared memory, not the socket.

A store whose slab is shared (``Slab(shared=True)``) offers it in its HELLO reply. A client on
the same node that can open and verify it (``transfer/shm.py``) then:

* **gets** with ``shm: true``: the store pins the blocks under a *read lease* and answers with
  where they are (``spans``: slab offset, slot, slot generation) instead of sending them; the
  client copies them out of its read-only mapping, checks the generations, and ends the lease
  with its next request (``reads_done``, ended before that request is handled) or a one-way
  READ_DONE once its event loop comes round. The store hands out offsets only for blocks it has
  leased to that connection; the mapping itself cannot stop a client from reading other slots
  (see docs).
* **puts** through a per-connection *staging area* (SHM_ATTACH: a fresh memfd only this
  connection's client is given; SHM_READY: the store closes its descriptor so nobody else can
  open it): the client copies blocks into it and sends PUT with ``staged`` offsets and no
  payload; the store checks every offset and length against the area, reserves slots and copies
  the blocks in, then commits (atomic, like a socket put). A CPP stage's layer slices
  (``first_layer``) go the same way into the block being assembled (``store/assembly.py``).

Control frames stay on the connection's socket, so the cluster token gates all of it.
"""

from __future__ import annotations

import logging
from typing import Any

from mooncake_lite.store.blocks import BadRequest, Block, BlockStore, Lease, PutTicket, StoreFull
from mooncake_lite.store.fastget import VERSION, FastGets
from mooncake_lite.store.protocol import MetaError, Op, check_layout, int_from_meta, keys_from_meta, sizes_from_meta
from mooncake_lite.transfer.connection import FrameConnection
from mooncake_lite.transfer.framing import FLAG_REPLY, Frame
from mooncake_lite.transfer.shm import PAGE, Region, ShmError

log = logging.getLogger(__name__)
MAX_READ_LEASES = 1024   # per data connection (see ``ShmService._drop_oldest_read``)


class ShmService:
    def __init__(self, store: BlockStore, *, staging_bytes: int, lease_ttl: float, clock) -> None:
        self.store = store
        self.staging_bytes = staging_bytes
        self.lease_ttl = lease_ttl
        self.clock = clock
        self._next_read_id = 0
        self.fast = FastGets(self)   # single gets on their own channel (started with the data plane)
        self._fast_started = False

    async def start(self) -> None:
        """Open the single-get channel (where the slab is shared); a failure leaves it off."""
        if not self.is_enabled:
            return
        try:
            await self.fast.start()
            self._fast_started = True
        except OSError as exc:
            log.info("no fast get channel: %s", exc)

    def close(self) -> None:
        self.fast.close()

    @property
    def is_enabled(self) -> bool:
        return self.store.slab.region is not None

    def offer(self) -> dict[str, Any] | None:
        """The HELLO reply's ``shm`` entry: how to map the slab and where its parts are."""
        slab = self.store.slab
        if slab.region is None:
            return None
        return slab.region.offer(gens_offset=PAGE, num_slots=slab.num_slots, slab_offset=slab.slab_offset,
                                 staging=self.staging_bytes, fast=VERSION if self._fast_started else False)

    # ---- control ops -------------------------------------------------------------------------
    def handle(self, conn: FrameConnection, frame: Frame) -> None:
        if frame.op == Op.READ_DONE:   # one-way: no reply, even to a malformed one
            self.end_reads(conn, frame.meta.get("reads"))
        elif frame.op == Op.SHM_ATTACH:
            conn.send(frame.op, frame.request_id, self._attach(conn), flags=FLAG_REPLY)
        elif frame.op == Op.FAST_ATTACH and frame.meta.get("retire") is True:
            # A client that gave its channel up: nothing more is read from that connection's
            # channels, and this answer goes after whatever was read was handled (one event
            # loop), so every staging range a request on them named is the client's again.
            self.fast.retire(conn)
            conn.send(frame.op, frame.request_id, {"retired": True}, flags=FLAG_REPLY)
        elif frame.op == Op.FAST_ATTACH:
            if not self._fast_started:
                raise MetaError("this store has no fast get channel")
            conn.send(frame.op, frame.request_id, self.fast.grant(conn), flags=FLAG_REPLY)
        elif frame.op == Op.SHM_READY:
            staging: Region | None = conn.state.get("staging")
            if staging is None:
                raise MetaError("no staging area to confirm")
            staging.close_fd()   # the client has mapped it: nobody else can open it now
            conn.send(frame.op, frame.request_id, {"ok": True}, flags=FLAG_REPLY)

    def end_reads(self, conn: FrameConnection, read_ids: Any) -> None:
        """End the read leases a client is done with (anything else in the list is ignored)."""
        reads = conn.state.get("reads", {})
        for read_id in read_ids if isinstance(read_ids, list) else ():
            lease = reads.pop(read_id, None) if isinstance(read_id, int) else None
            if lease is not None:
                self.store.unpin(lease)

    def _attach(self, conn: FrameConnection) -> dict[str, Any]:
        if not self.is_enabled or self.staging_bytes <= 0:
            raise MetaError("this store offers no staging area")
        if "staging" in conn.state:
            raise MetaError("this connection has a staging area already")
        try:
            # Not populated: a client that only gets never costs the store this memory.
            region = conn.state["staging"] = Region(self.staging_bytes, name="mooncake-staging", populate=False)
        except ShmError as exc:
            raise MetaError(f"cannot create a staging area: {exc}") from None
        return region.offer()

    def connection_lost(self, conn: FrameConnection) -> None:
        self.fast.connection_lost(conn)
        for lease in conn.state.pop("reads", {}).values():
            self.store.unpin(lease)
        staging = conn.state.pop("staging", None)
        if staging is not None:
            staging.close()

    # ---- gets --------------------------------------------------------------------------------
    def reply_spans(self, conn: FrameConnection, frame: Frame, found: list,
                    layers: tuple[int, int] | None) -> None:
        """Answer a get with where its blocks are; bytes only for SSD blocks DRAM could not take."""
        sizes, block_layers, spans, pinned, raw = [], [], [], [], []
        for item in found:
            size = layer_count = span = None
            if isinstance(item, Block):
                offset, size = self.store.span(item, *layers) if layers else self.store.span(item)
                layer_count, span = item.num_layers, self._span(item, offset)
                pinned.append(item)
            elif item is not None:   # SSD bytes DRAM could not take: sent on the socket
                if layers:
                    raise BadRequest("layer reads of blocks that could not be promoted are not supported")
                raw.append(memoryview(item))
                size = len(item)
            sizes.append(size)
            block_layers.append(layer_count)
            spans.append(span)
        meta = {"sizes": sizes, "num_layers": block_layers, "spans": spans,
                "read": self.read_lease(conn, pinned) if pinned else None}
        conn.send(frame.op, frame.request_id, meta, raw, flags=FLAG_REPLY)
        self.store.stats.bytes_out += sum(s for s in sizes if s)

    def _span(self, block: Block, slab_offset: int) -> list[int]:
        slab = self.store.slab
        return [slab.slab_offset + slab_offset, block.slot, slab.gens[block.slot]]

    def read_lease(self, conn: FrameConnection, blocks: list[Block]) -> int:
        # No on_expire: a lease that runs out lets the slot be reused, which bumps its
        # generation, so a client still copying sees that and refetches; nothing to abort.
        self._next_read_id += 1
        reads: dict[int, Lease] = conn.state.setdefault("reads", {})
        reads[self._next_read_id] = self.store.pin(blocks, self.clock() + self.lease_ttl)
        if len(reads) > MAX_READ_LEASES:
            self._drop_oldest_read(conn, reads)
        return self._next_read_id

    def _drop_oldest_read(self, conn: FrameConnection, reads: dict[int, Lease]) -> None:
        """A connection holds at most MAX_READ_LEASES read leases (its client hands each back
        with its next request, so a well-behaved one holds about as many as it has gets in
        flight): past that the oldest ends here. Safe for the client as an expiry is: a slot
        reused while it still copies bumps the generation, so it refetches, never reads torn
        bytes. Without this, a client that never hands leases back would grow this dict (and,
        until they expire, pin blocks) for as long as its connection lives."""
        oldest = next(iter(reads))
        self.store.unpin(reads.pop(oldest))
        self.store.stats.read_leases_dropped += 1
        if not conn.state.get("reads_dropped"):
            conn.state["reads_dropped"] = True
            log.warning("connection %s holds more than %d read leases (not handing them back): "
                        "ending its oldest ones", getattr(conn, "name", "?"), MAX_READ_LEASES)

    def match_spans(self, blocks: list[Block]) -> list[list[int]]:
        """Where the blocks a MATCH pinned are (the client may read them without asking again
        while its lease lasts): offset, size, num_layers, slot, generation."""
        slab = self.store.slab
        return [[slab.slab_offset + self.store.span(b)[0], b.size, b.num_layers, b.slot, slab.gens[b.slot]]
                for b in blocks]

    # ---- puts --------------------------------------------------------------------------------
    def staged_put(self, conn: FrameConnection, frame: Frame) -> None:
        """Copy a put's blocks from the connection's staging area into reserved slots, commit, and
        answer. Whole blocks are answered *first* (``copying: true``), then copied and committed
        in the same callback: nothing (no frame of any connection) runs in between, so nobody can
        tell, but the client goes on while the store copies. It must not reuse the staged range
        until a later answer on the connection (which the store sends after the copy) arrives."""
        staging: Region | None = conn.state.get("staging")
        if staging is None:
            raise MetaError("a staged put needs a staging area (SHM_ATTACH)")
        meta = frame.meta
        keys = keys_from_meta(meta)
        sizes = sizes_from_meta(meta, len(keys))
        offsets = meta.get("staged")
        if not isinstance(offsets, list) or len(offsets) != len(keys):
            raise MetaError(f"'staged' must be {len(keys)} offsets (one per key)")
        for offset, size in zip(offsets, sizes):
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 \
                    or offset + size > staging.size:
                raise MetaError(f"staged block [{offset!r}, +{size}) is outside the "
                                f"{staging.size}-byte staging area")
        num_layers, first_pos = int_from_meta(meta, "num_layers", 1, minimum=1), int_from_meta(meta, "first_pos", 0)
        check_layout(meta)
        if "first_layer" in meta:
            num_new = self._staged_slices(meta, keys, sizes, offsets, num_layers, first_pos, staging)
            conn.send(frame.op, frame.request_id, {"num_new": num_new}, flags=FLAG_REPLY)
            return
        ticket = self.store.reserve(keys, sizes, num_layers, first_pos)
        try:
            conn.send(frame.op, frame.request_id, {"num_new": self.store.num_new(ticket), "copying": True},
                      flags=FLAG_REPLY)
        except ConnectionError:
            self.store.cancel(ticket)
            return
        for slot, offset, size in zip(ticket.slots, offsets, sizes):
            if slot is not None:
                self.store.slab.view(slot, size)[:] = staging.view[offset:offset + size]
        self.store.commit(ticket)

    def fast_reserve(self, conn: FrameConnection, key: bytes, offset: int, size: int, num_layers: int,
                     first_pos: int) -> PutTicket | None:
        """A slot for one staged block from the single-block channel (``store/fastget.py``);
        None if not taken (no staging area, a range outside it, a size or layer count the store
        refuses, the store full): the client puts it the framed way, which answers why."""
        staging: Region | None = conn.state.get("staging")
        if staging is None or size <= 0 or num_layers < 1 or offset + size > staging.size:
            return None
        try:
            return self.store.reserve([key], [size], num_layers, first_pos)
        except (BadRequest, StoreFull):
            return None

    def fast_commit(self, conn: FrameConnection, ticket: PutTicket, offset: int) -> int:
        """Copy the reserved block in from the staging area and commit it: 1 if new, else 0."""
        slot, size = ticket.slots[0], ticket.sizes[0]
        if slot is not None:
            self.store.slab.view(slot, size)[:] = conn.state["staging"].view[offset:offset + size]
        return self.store.commit(ticket)

    def _staged_slices(self, meta: dict[str, Any], keys: list[bytes], sizes: list[int], offsets: list[int],
                       num_layers: int, first_pos: int, staging: Region) -> int:
        """A CPP stage's layer slices, staged: the same assembly as over the socket (each slice
        copied to its layers' place in the block's slot; a no-op slice is not copied at all)."""
        assembly = self.store.assembly
        ticket = assembly.reserve_put(meta, keys, sizes, num_layers, first_pos, self.clock())
        for partial, offset in zip(ticket.partials, offsets):
            if partial is None:
                continue
            for at, length in ticket.spans(partial.layer_bytes):   # one run, or one per layer (heads)
                self.store.slab.view(partial.slot, length, at)[:] = staging.view[offset:offset + length]
                offset += length
        self.store.stats.bytes_in += sum(sizes)
        return assembly.commit(ticket)
