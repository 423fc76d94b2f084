"""The block pool: DRAM slab + eviction policy + leases + optional SSD tier. No sockets here.

Life of a block:
  reserve (slots handed out, invisible) -> payload lands in the slots -> commit (visible, atomic)
  -> evicted from DRAM: written back to SSD (copy queued) or dropped -> promoted on an SSD hit.
A block pinned by a lease (it is being sent) is never evicted; deleting it hides it at once and
frees its slot when the last lease ends. A block held for a cached context (``hold``: a named
owner, a wall-clock expiry) is never evicted from either tier before its expiry; holds are
journaled beside the SSD files and restored at start. Events: ``on_stored(key)`` when a key enters the store,
``on_evicted(key)`` when it leaves both tiers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from mooncake_lite.store.assembly import Assembler
from mooncake_lite.store.eviction import EvictionPolicy, PinTable
from mooncake_lite.store.records import BadRequest, Block, Lease, PutTicket, StoreFull, StoreStats, discard_view
from mooncake_lite.store.slab import Slab
from mooncake_lite.store.ssd import SsdTier

__all__ = ["BadRequest", "Block", "BlockStore", "Lease", "PutTicket", "StoreFull", "StoreStats"]


class BlockStore:
    def __init__(self, slab: Slab, policy: EvictionPolicy, ssd: SsdTier | None = None, *,
                 on_stored: Callable[[bytes], None] | None = None,
                 on_evicted: Callable[[bytes], None] | None = None) -> None:
        self.slab = slab
        self.policy = policy
        self.ssd = ssd
        self.on_stored = on_stored or (lambda key: None)
        self.on_evicted = on_evicted or (lambda key: None)
        self.stats = StoreStats()
        self._dram: dict[bytes, Block] = {}
        self._leases: set[Lease] = set()
        self._num_pinned = 0  # live DRAM blocks with pins > 0 (cannot be evicted)
        # Context holds: a held DRAM block carries one pin for all its holders together.
        self.holds = PinTable()
        # Blocks put one layer range at a time (a CPP group's stages), invisible until whole.
        self.assembly = Assembler(self)
        if ssd is not None:
            ssd.on_dropped = self._ssd_dropped
            ssd.is_pinned = self.holds.is_pinned

    # ---- queries ------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._dram or (self.ssd is not None and key in self.ssd)

    def touch_dram(self, key: bytes) -> Block | None:
        """The key's DRAM block, touched and counted as a hit; None (counting nothing) when not
        in DRAM: the caller then asks the way that counts misses and reads the SSD tier."""
        block = self._dram.get(key)
        if block is not None:
            self.policy.touch(key)
            self.stats.hits_dram += 1
        return block

    def keys(self) -> set[bytes]:
        return set(self._dram) | (self.ssd.keys() if self.ssd is not None else set())

    @property
    def num_dram_blocks(self) -> int:
        return len(self._dram)

    @property
    def dram_used_bytes(self) -> int:
        return (self.slab.num_slots - self.slab.num_free) * self.slab.slot_bytes

    def match(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` held in any tier."""
        return sum(1 for _ in itertools.takewhile(self.__contains__, keys))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self for key in keys]

    # ---- puts ---------------------------------------------------------------------------------
    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int], num_layers: int, first_pos: int = 0) -> PutTicket:
        """Hand out slots for the blocks not stored yet (evicting if needed). StoreFull/BadRequest."""
        if len(keys) != len(sizes):
            raise BadRequest(f"{len(keys)} keys but {len(sizes)} sizes")
        if num_layers < 1:
            raise BadRequest(f"num_layers must be >= 1, got {num_layers}")
        for size in sizes:
            if not 0 < size <= self.slab.slot_bytes:
                raise BadRequest(f"block of {size} bytes does not fit a {self.slab.slot_bytes}-byte slot "
                                 "(start the store with a larger --slot-bytes)")
            if size % num_layers:
                raise BadRequest(f"block of {size} bytes is not divisible into {num_layers} layers")
        num_needed = sum(1 for key in set(keys) if key not in self._dram)
        if num_needed > self.slab.num_free + len(self._dram) - self._num_pinned:
            # Refuse before evicting anything: a put that fails must not change the cache.
            self.stats.full_errors += 1
            raise StoreFull(f"{num_needed} blocks need slots but only "
                            f"{self.slab.num_free + len(self._dram) - self._num_pinned} of "
                            f"{self.slab.num_slots} can be freed (the rest are leased or being written)")
        ticket = PutTicket(list(keys), list(sizes), num_layers, first_pos, [])
        seen: set[bytes] = set()
        for key in keys:
            if key in self._dram or key in seen:  # stored already, or twice in this put
                ticket.slots.append(None)
                continue
            seen.add(key)
            slot = self.alloc_slot()
            if slot is None:
                self.cancel(ticket)
                self.stats.full_errors += 1
                raise StoreFull(f"no free DRAM slot: all {self.slab.num_slots} slots are leased or being written")
            ticket.slots.append(slot)
        return ticket

    def ticket_views(self, ticket: PutTicket, scratch: memoryview) -> list[memoryview]:
        """Where each block's bytes should land (``scratch`` for blocks already stored)."""
        views: list[memoryview] = []
        run: list[tuple[int, int]] = []
        for slot, size in zip(ticket.slots, ticket.sizes):
            if slot is not None:
                run.append((self.slab.offset_of(slot), size))
                continue
            views += self.slab.views(run)
            run = []
            views.append(discard_view(scratch, size))
        return views + self.slab.views(run)

    def num_new(self, ticket: PutTicket) -> int:
        """What ``commit(ticket)`` will return if nothing changes the store in between."""
        return sum(1 for key, slot in zip(ticket.keys, ticket.slots)
                   if slot is not None and key not in self)

    def commit(self, ticket: PutTicket) -> int:
        """Make the received blocks visible; returns how many were new."""
        num_new = 0
        for i, (key, slot, size) in enumerate(zip(ticket.keys, ticket.slots, ticket.sizes)):
            self.stats.bytes_in += size
            if slot is None or key in self._dram:  # a concurrent put of the same key won
                if slot is not None:
                    self.slab.free(slot)
                if key in self._dram:
                    self.policy.touch(key)
                continue
            is_new = key not in self
            self._add_block(key, Block(slot, size, ticket.num_layers, ticket.first_pos + i))
            self.stats.blocks_put += 1
            if is_new:
                num_new += 1
                self.on_stored(key)
        ticket.slots = []
        return num_new

    def cancel(self, ticket: PutTicket) -> None:
        for slot in ticket.slots:
            if slot is not None:
                self.slab.free(slot)
        ticket.slots = []

    def alloc_slot(self) -> int | None:
        """A free slot, evicting if need be; None when every block is pinned (puts, and the
        assembler's partial blocks outside any put ticket, take their slots this way)."""
        slot = self.slab.alloc()
        while slot is None and self._evict_one():
            slot = self.slab.alloc()
        return slot

    def adopt(self, key: bytes, slot: int, size: int, num_layers: int, chain_pos: int) -> None:
        """Make a slot filled outside a put (a block assembled from slices) visible, as a commit does."""
        self._add_block(key, Block(slot, size, num_layers, chain_pos))
        self.stats.blocks_put += 1
        self.on_stored(key)

    def _evict_one(self) -> bool:
        key = self.policy.victim(self._is_pinned)
        if key is None:
            return False
        self.policy.remove(key)
        block = self._dram.pop(key)
        self.stats.evictions_dram += 1
        kept = self.ssd is not None and (key in self.ssd or self._write_back(key, block))
        self.slab.free(block.slot)
        if not kept:
            self.on_evicted(key)
        return True

    def _write_back(self, key: bytes, block: Block) -> bool:
        """Queue a copy of the block for the SSD tier (False: its queue is full)."""
        return self.ssd.enqueue(key, bytes(self.slab.view(block.slot, block.size)),  # type: ignore[union-attr]
                                block.num_layers, block.chain_pos)

    def _is_pinned(self, key: bytes) -> bool:
        return self._dram[key].pins > 0

    def _ssd_dropped(self, key: bytes) -> None:
        if key not in self._dram:
            self.on_evicted(key)

    # ---- gets ---------------------------------------------------------------------------------
    def lookup_dram(self, keys: Sequence[bytes]) -> tuple[list[Block | None], list[int]]:
        """DRAM blocks for ``keys`` (hits touched), and the indexes of misses that sit on the SSD
        (finish those with ``promote``). Misses in every tier are counted here."""
        found: list[Block | None] = []
        on_ssd: list[int] = []
        for i, key in enumerate(keys):
            block = self.touch_dram(key)
            if block is None:
                self.stats.misses_dram += 1
                if self.ssd is not None and key in self.ssd:
                    on_ssd.append(i)
                else:
                    self.stats.misses += 1
            found.append(block)
        return found, on_ssd

    async def promote(self, key: bytes) -> Block | memoryview | bytes | None:
        """Bring an SSD block into DRAM. Returns the block; its raw bytes when DRAM is full of
        leased blocks (served without promoting); None when it vanished or was corrupt."""
        item = await self.ssd.read(key) if self.ssd is not None else None
        if key in self._dram:  # promoted by a concurrent request meanwhile
            self.stats.hits_dram += 1
            self.policy.touch(key)
            return self._dram[key]
        if item is None:
            self.stats.misses += 1
            return None
        self.stats.hits_ssd += 1
        data, num_layers, chain_pos = item
        slot = self.alloc_slot()
        if slot is None:
            return data
        self.slab.view(slot, len(data))[:] = data
        block = Block(slot, len(data), num_layers, chain_pos)
        self._add_block(key, block)
        return block

    def _add_block(self, key: bytes, block: Block) -> None:
        self._dram[key] = block
        self.policy.insert(key, block.chain_pos)
        if self.holds.is_pinned(key):   # back in DRAM (promoted, or put again) while held
            self._pin_block(block)

    def span(self, block: Block, first_layer: int = 0, num_layers: int | None = None) -> tuple[int, int]:
        """``(slab offset, nbytes)`` of a block, or of its layers ``[first_layer, first_layer + num_layers)``."""
        count = block.num_layers - first_layer if num_layers is None else num_layers
        if first_layer < 0 or count < 1 or first_layer + count > block.num_layers:
            raise BadRequest(f"layers [{first_layer}, {first_layer + count}) outside a {block.num_layers}-layer block")
        layer_bytes = block.size // block.num_layers
        return self.slab.offset_of(block.slot, first_layer * layer_bytes), count * layer_bytes

    def view(self, block: Block, first_layer: int = 0, num_layers: int | None = None) -> memoryview:
        """The bytes of a block (or of a layer range), in place."""
        start, nbytes = self.span(block, first_layer, num_layers)
        return self.slab.views([(start, nbytes)])[0]

    # ---- leases -------------------------------------------------------------------------------
    def pin(self, blocks: Sequence[Block], expires_at: float, on_expire: Callable[[], None] | None = None) -> Lease:
        """Protect blocks from eviction until ``unpin`` or ``expires_at`` (then ``on_expire`` runs,
        which must stop whatever was reading the memory, e.g. abort the connection)."""
        lease = Lease([], expires_at, on_expire)
        self._leases.add(lease)
        self.extend(lease, blocks)
        return lease

    def extend(self, lease: Lease, blocks: Sequence[Block]) -> None:
        """Pin more blocks under an active lease."""
        for block in blocks:
            self._pin_block(block)
        lease.blocks.extend(blocks)

    def unpin(self, lease: Lease) -> None:
        if not lease.is_active:
            return
        lease.is_active = False
        self._leases.discard(lease)
        for block in lease.blocks:
            block.pins -= 1
            if block.pins == 0:
                if block.is_live:
                    self._num_pinned -= 1
                else:
                    self.slab.free(block.slot)

    def expire_leases(self, now: float) -> int:
        """End every lease past its expiry; returns how many."""
        expired = [lease for lease in self._leases if lease.expires_at <= now]
        for lease in expired:
            if lease.on_expire is not None:
                lease.on_expire()
            self.unpin(lease)
        self.stats.leases_expired += len(expired)
        return len(expired)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    # ---- deletes and shutdown ------------------------------------------------------------------
    async def delete(self, keys: Sequence[bytes]) -> int:
        num = 0
        is_held = False
        for key in keys:
            if held := self.holds.is_pinned(key):
                self.holds.forget_key(key)
                is_held = True
            block = self._dram.pop(key, None)
            if block is not None:
                self.policy.remove(key)
                if held:
                    self._unpin_block(block)
                if block.pins:
                    block.is_live = False
                    self._num_pinned -= 1
                else:
                    self.slab.free(block.slot)
            on_ssd = self.ssd is not None and await self.ssd.remove(key)
            if block is not None or on_ssd:
                num += 1
                self.on_evicted(key)
        if is_held:
            self._journal()
        return num

    # ---- context holds ------------------------------------------------------------------------
    def hold(self, owner: str, keys: Sequence[bytes], expires_at: float) -> int:
        """Keep the ``keys`` this store has (any tier) from eviction for ``owner`` until
        ``expires_at`` (wall clock), replacing what ``owner`` held; returns how many it has.
        Held DRAM-only blocks are queued for the SSD tier at once, so a crash keeps them too."""
        present = [key for key in keys if key in self]
        before = self.holds.get(owner)
        added, dropped = self.holds.pin(owner, present, expires_at)
        for key in added:
            if key in self._dram:
                self._pin_block(self._dram[key])
        self._release(dropped)
        for key in present:
            block = self._dram.get(key)
            if self.ssd is not None and block is not None and key not in self.ssd:
                self._write_back(key, block)
        if self.holds.get(owner) != before:   # a repeated PIN (waiting for a write-back) changes nothing
            self._journal()
        return len(present)

    def unhold(self, owner: str) -> bool:
        """End ``owner``'s hold; False when it held nothing."""
        if self.holds.get(owner) is None:
            return False
        self._release(self.holds.unpin(owner))
        self._journal()
        return True

    def expire_holds(self, now: float) -> list[str]:
        """End every hold past its expiry; returns their owners."""
        owners = self.holds.expired(now)
        for owner in owners:
            self.unhold(owner)
        return owners

    def restore_holds(self, entries: dict[str, tuple[list[bytes], float]], now: float) -> int:
        """Re-apply journaled holds (start-up, after the SSD scan); expired ones are dropped."""
        live = {owner: entry for owner, entry in entries.items() if entry[1] > now}
        for owner, (keys, expires_at) in live.items():
            self.hold(owner, keys, expires_at)
        self._journal()
        return len(live)

    def _release(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            block = self._dram.get(key)
            if block is not None:
                self._unpin_block(block)

    def _pin_block(self, block: Block) -> None:
        if block.pins == 0 and block.is_live:
            self._num_pinned += 1
        block.pins += 1

    def _unpin_block(self, block: Block) -> None:
        block.pins -= 1
        if block.pins == 0 and block.is_live:
            self._num_pinned -= 1

    def _journal(self) -> None:
        if self.ssd is not None:
            self.ssd.journal.save(self.holds.entries())

    async def persist(self) -> int:
        """Queue every DRAM-only block for the SSD and wait (graceful shutdown). Returns count."""
        if self.ssd is None:
            return 0
        num = 0
        for key, block in list(self._dram.items()):
            if key in self.ssd:
                continue
            data = bytes(self.slab.view(block.slot, block.size))
            while not self.ssd.enqueue(key, data, block.num_layers, block.chain_pos):
                if self.ssd.pending_bytes == 0:
                    break  # can never fit
                await self.ssd.flush()
            num += 1
        await self.ssd.flush()
        return num
