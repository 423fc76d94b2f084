"""The messages a store posts to the conductors (``store/event_fanout.py``): the blocks it stored
and evicted, its figures and its capacity; encoded and decoded by ``common/protocol.py``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoreCapacity:
    """How many blocks a store holds, by tier, and how it evicts: the simulator's store, exported
    by the conductor (``conductor/cluster/cost_export.py``). One block takes one DRAM slot."""
    dram_slots: int
    ssd_blocks: int            # the SSD tier's bytes over a slot's; 0: no SSD tier
    eviction: str

    def __post_init__(self) -> None:
        if self.dram_slots < 0 or self.ssd_blocks < 0 or not self.eviction:
            raise ValueError(f"store capacity must count blocks >= 0 and name a policy, got {self}")


@dataclass(frozen=True)
class BlockEvents:
    store: str
    stored: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    # True: the first message of a full sync — the conductor forgets what it knew of this store
    # and ``stored`` starts its whole inventory (more plain messages may follow with the rest).
    full: bool = False
    # The store's figures now (DRAM/SSD bytes used and held, hits per tier, misses), shown by
    # ``mooncake status``; every post carries them, keepalives included.
    usage: dict[str, float] = field(default_factory=dict)
    # Its capacity (every post carries it too); None: a store from before it was sent.
    capacity: StoreCapacity | None = None
