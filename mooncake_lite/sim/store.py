"""A simulated node store: a DRAM tier and an optional SSD tier, each a :class:`BlockCache`
under the configured eviction policy. Blocks the DRAM tier evicts spill to SSD; a block is
gone from the node (and from the conductor's index) only when the SSD tier drops it too.
Hits are promoted back to DRAM when the prefill re-inserts its chain."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from mooncake_lite.scheduler.block_index import BlockIndex
from mooncake_lite.store.eviction import BlockCache


class NodeStore:
    def __init__(self, dram_blocks: int | None, ssd_blocks: int, policy: str) -> None:
        self.dram = BlockCache(dram_blocks, policy)
        self.ssd = BlockCache(ssd_blocks, policy) if ssd_blocks > 0 else None

    def __contains__(self, key: object) -> bool:
        return key in self.dram or (self.ssd is not None and key in self.ssd)

    def prefix(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """(leading blocks held in either tier, how many of those only on SSD); no touch."""
        n = self.dram.leading(keys)
        ssd = self.ssd
        if ssd is None or n == len(keys):
            return n, 0
        on_ssd = 0
        for key in keys[n:]:
            if key in self.dram:
                n += 1
            elif key in ssd:
                n += 1
                on_ssd += 1
            else:
                break
        return n, on_ssd

    def touch(self, keys: Sequence[Hashable]) -> None:
        """A read of these leading keys (a migration source serving them) counts as a use."""
        self.dram.match_prefix(keys)

    def insert(self, keys: Sequence[Hashable]) -> tuple[list[Hashable], list[Hashable]]:
        """Insert a chain into DRAM (touching what is there). Returns (keys now held that the
        index should learn, keys the node no longer holds at all)."""
        n, _, dropped = self._insert(keys)
        return list(keys[:n]), dropped

    def insert_new(self, keys: Sequence[Hashable]) -> tuple[list[Hashable], list[Hashable]]:
        """:meth:`insert`, returning instead of every key held only those new in DRAM (a
        superset of those new to the node): an index told every earlier insert's answer knows
        the rest already, so telling it these leaves it the same, for less work."""
        if self.ssd is None:      # _insert's first case, one call less per simulated prefill
            added = self.dram.add_chain(keys)
            return added.inserted, added.evicted
        _, inserted, dropped = self._insert(keys)
        return inserted, dropped

    def _insert(self, keys: Sequence[Hashable]) -> tuple[int, list[Hashable], list[Hashable]]:
        """(leading keys held after the insert, keys new in DRAM, keys gone from the node)."""
        added = self.dram.add_chain(keys)
        if self.ssd is None:
            # the chain's keys the insert handled are held, the one it stopped at is not
            return added.num_held, added.inserted, added.evicted
        dropped: list[Hashable] = []
        # One block at a time, as the real store spills: the spilled keys are not one chain
        # (protecting them from each other could leave one in neither tier, unreported).
        for key in added.evicted:
            dropped.extend(k for k in self.ssd.insert_chain((key,)) if k not in self.dram)
            if key not in self.ssd:
                dropped.append(key)
        n, _ = self.prefix(keys)
        return n, added.inserted, dropped

    def __len__(self) -> int:
        return len(self.dram) + (len(self.ssd) if self.ssd is not None else 0)


def store_chain(cache: NodeStore, index: BlockIndex, store_id: Hashable, keys: Sequence[Hashable]) -> None:
    """Insert a chain into a node's cache and tell the conductor's index what the node now
    holds and what it no longer holds at all (the stores' block events, simulated). The index is
    fed only by this function for this store, so it already knows the keys the node held before:
    only the new ones are told (``NodeStore.insert_new``)."""
    new, dropped = cache.insert_new(keys)
    if dropped:
        index.remove(store_id, dropped)
    index.add(store_id, new)      # even empty: the index gives a store its slot at its first event
