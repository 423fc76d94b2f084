"""Which stores the conductor still hears from.

Every store posts its block events to the conductor, and an idle one an empty keepalive
(``store/events.py``, at most 5 s apart), so a store silent for ``dead_after_s`` is gone
(killed, cut off, stopped). Its entries in the block index must then go, or requests keep being
routed to blocks nobody can serve. A dropped store that posts again is asked for a full sync
(the index no longer counts it as synced) and comes back with its real inventory.
Each post may carry the store's capacity (``StoreCapacity``), kept by store id for the cost export.

No IO and no clock: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from mooncake_lite.common.protocol import StoreCapacity


class StoreWatch:
    def __init__(self, dead_after_s: float) -> None:
        self.dead_after_s = dead_after_s
        self.last_heard: dict[str, float] = {}
        self.dropped: set[str] = set()    # silent ones not heard from since
        self.num_dropped = 0
        self.capacity: dict[str, StoreCapacity] = {}   # what each store last said it holds

    def heard(self, store_id: str, now: float, capacity: StoreCapacity | None = None) -> bool:
        """The store posted; True when it had been dropped as silent (it is back)."""
        self.last_heard[store_id] = now
        if capacity is not None:
            self.capacity[store_id] = capacity
        if store_id in self.dropped:
            self.dropped.discard(store_id)
            return True
        return False

    def silent(self, now: float) -> list[str]:
        """Stores not heard from for longer than ``dead_after_s``, now counted as dropped."""
        gone = [s for s, t in self.last_heard.items() if now - t > self.dead_after_s]
        for store_id in gone:
            del self.last_heard[store_id]
            self.capacity.pop(store_id, None)   # its next post says it again
            self.dropped.add(store_id)
        self.num_dropped += len(gone)
        return gone

    def num_live(self) -> int:
        return len(self.last_heard)

    def known(self, indexed: Iterable[Hashable]) -> list[str]:
        """The stores to show (``/health``, ``mooncake status``): those heard from, and those the
        block index holds blocks of. The index alone left out a live store until it held a block."""
        return sorted({*self.last_heard, *map(str, indexed)})
