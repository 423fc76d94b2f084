"""Eviction policies and a capacity-bounded block cache: pure logic, no IO, no clock.

The store's DRAM index and the trace simulator (paper Table 1) drive the same classes. Keys are
any hashable (16-byte chained hashes in the store, trace hash ids in the simulator).

Policies:
  * ``lru``          least recently used first.
  * ``lfu``          least frequently used first; ties broken by least recently used.
  * ``length-aware`` the block sitting latest in its request chain (largest ``chain_pos``) first,
                     ties broken by least recently used. Blocks late in a chain are only useful
                     when the whole prefix before them is cached too, so they go first (paper §4).

``insert`` of a key already present counts as a hit (a ``touch``); the key keeps its original
chain position, because with chained hashes a key's position is fixed by its prefix.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import NamedTuple, Protocol

Key = Hashable
PinCheck = Callable[[Key], bool]

POLICY_NAMES = ("lru", "lfu", "length-aware")


class EvictionPolicy(Protocol):
    """Bookkeeping of which key to evict next. Never evicts on its own; the owner asks. (Not
    ``runtime_checkable``: nothing checks it at run time, and mypyc refuses the decorator.)"""

    def insert(self, key: Key, chain_pos: int) -> None: ...
    def touch(self, key: Key) -> None: ...
    def remove(self, key: Key) -> None: ...
    def victim(self, is_pinned: PinCheck | None = None) -> Key | None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...


class LRUPolicy:
    """O(1) insert/touch/remove/victim via one ordered dict (front = least recent)."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, chain_pos: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, is_pinned: PinCheck | None = None) -> Key | None:
        for key in self._order:
            if is_pinned is None or not is_pinned(key):
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class _BucketedPolicy:
    """Keys grouped into buckets by an integer rank; each bucket is LRU-ordered.

    The victim comes from the bucket with the smallest ``_heap_value(rank)``. A lazy heap of
    bucket ranks finds it in O(log buckets); stale heap entries are skipped and compacted.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        self._rank: dict[Key, int] = {}
        self._heap: list[int] = []

    def _heap_value(self, rank: int) -> int:
        raise NotImplementedError

    def _put(self, key: Key, rank: int) -> None:
        bucket = self._buckets.get(rank)
        if bucket is None:
            bucket = self._buckets[rank] = OrderedDict()
            heapq.heappush(self._heap, self._heap_value(rank))
            if len(self._heap) > 2 * len(self._buckets) + 16:
                self._heap = [self._heap_value(r) for r in self._buckets]
                heapq.heapify(self._heap)
        bucket[key] = None
        self._rank[key] = rank

    def _take(self, key: Key) -> int:
        rank = self._rank.pop(key)
        bucket = self._buckets[rank]
        del bucket[key]
        if not bucket:
            del self._buckets[rank]
        return rank

    def remove(self, key: Key) -> None:
        if key in self._rank:
            self._take(key)

    def _ranks_in_order(self) -> Iterator[int]:
        """Bucket ranks, best victim first. Cheap for the first one (the common case)."""
        while self._heap and self._heap_value(self._heap[0]) not in self._buckets:
            heapq.heappop(self._heap)
        if not self._heap:
            return
        first = self._heap_value(self._heap[0])
        yield first
        rest = sorted((r for r in self._buckets if r != first), key=self._heap_value)
        yield from rest

    def victim(self, is_pinned: PinCheck | None = None) -> Key | None:
        for rank in self._ranks_in_order():
            for key in self._buckets[rank]:
                if is_pinned is None or not is_pinned(key):
                    return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._rank

    def __len__(self) -> int:
        return len(self._rank)


class LFUPolicy(_BucketedPolicy):
    """Frequency buckets (rank = hit count, starting at 1); LRU within a frequency."""

    def _heap_value(self, rank: int) -> int:
        return rank  # min-heap: lowest frequency first (the map is its own inverse)

    def insert(self, key: Key, chain_pos: int) -> None:
        if key in self._rank:
            self.touch(key)
        else:
            self._put(key, 1)

    def touch(self, key: Key) -> None:
        self._put(key, self._take(key) + 1)


class LengthAwarePolicy(_BucketedPolicy):
    """Chain-position buckets (rank = chain_pos); largest position evicted first, LRU within."""

    def _heap_value(self, rank: int) -> int:
        return -rank  # max-heap via negation (the map is its own inverse)

    def insert(self, key: Key, chain_pos: int) -> None:
        if chain_pos < 0:
            raise ValueError(f"chain_pos must be >= 0, got {chain_pos}")
        if key in self._rank:
            self.touch(key)
        else:
            self._put(key, chain_pos)

    def touch(self, key: Key) -> None:
        rank = self._rank[key]
        self._buckets[rank].move_to_end(key)


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name: ``lru``, ``lfu`` or ``length-aware``."""
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name in ("length-aware", "length_aware"):
        return LengthAwarePolicy()
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


class ChainAdded(NamedTuple):
    """What :meth:`BlockCache.add_chain` did: the keys it evicted, how many leading keys of the
    chain are now cached, and which of those it inserted (were not cached before)."""

    evicted: list[Key]
    num_held: int
    inserted: list[Key]


class BlockCache:
    """A set of at most ``capacity_blocks`` keys (None = unbounded) under an eviction policy.

    ``match_prefix`` answers "how many leading blocks of this chain are cached" and counts them
    as hits; ``insert_chain`` adds a request's chain. While a chain is being inserted its own
    blocks are protected, so a long chain never evicts its own prefix to make room for its tail.
    """

    def __init__(self, capacity_blocks: int | None, policy: str | EvictionPolicy = "lru") -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy

    def match_prefix(self, keys: Sequence[Key]) -> int:
        """Length of the longest cached prefix of ``keys``; touches each hit."""
        policy = self.policy
        # LRU's touch is its ordered dict's move_to_end: bound once, not looked up per key through
        # the policy (compiled, that lookup was ~1.5k instructions a simulated request); touched as
        # counted, in one pass
        return self.leading(keys, policy._order.move_to_end if type(policy) is LRUPolicy else policy.touch)

    def insert_chain(self, keys: Sequence[Key], is_pinned: PinCheck | None = None) -> list[Key]:
        """Insert ``keys`` (chain_pos = index), touching ones already cached; returns evicted keys.

        Stops early, leaving the rest uncached, when nothing can be evicted (capacity smaller
        than the chain, or everything else pinned): a block without its prefix is useless.
        """
        return self.add_chain(keys, is_pinned).evicted

    def add_chain(self, keys: Sequence[Key], is_pinned: PinCheck | None = None) -> ChainAdded:
        """:meth:`insert_chain`, also saying how far it got and which keys are new: the leading
        ``num_held`` keys are now cached (all of them unless it stopped early), ``inserted`` of
        them were not before. A simulator reports exactly these to its index without walking the
        chain again."""
        policy = self.policy
        if is_pinned is None and type(policy) is LRUPolicy:
            capacity = self.capacity_blocks
            if capacity is None or capacity > len(keys):     # (one call less per simulated prefill)
                return self._add_short_chain_lru(policy._order, keys)
            return self._add_chain_lru(policy._order, keys)
        evicted: list[Key] = []
        inserted: list[Key] = []
        chain: set[Key] = set()

        def protected(key: Key) -> bool:
            return key in chain or (is_pinned is not None and is_pinned(key))

        pos = 0
        for pos, key in enumerate(keys):
            if key in self.policy:
                self.policy.touch(key)
                chain.add(key)
                continue
            if self.capacity_blocks is not None and len(self.policy) >= self.capacity_blocks:
                victim = self.policy.victim(protected)
                if victim is None:
                    return ChainAdded(evicted, pos, inserted)
                self.policy.remove(victim)
                evicted.append(victim)
            self.policy.insert(key, pos)
            inserted.append(key)
            chain.add(key)
        return ChainAdded(evicted, len(keys), inserted)

    def _add_chain_lru(self, order: OrderedDict[Key, None], keys: Sequence[Key]) -> ChainAdded:
        """:meth:`add_chain` under LRU with nothing pinned, on the policy's ordered dict itself
        (this runs per simulated prefill, per block: no method call per key). The same result:
        the chain's keys handled so far were each moved or added to the end, and nothing else
        moves, so they are the dict's last entries; the general path's victim (the first key not
        in the chain) is then the first key whenever the dict holds more keys than the ``pos``
        handled, and otherwise only if that key is not one of them."""
        capacity = self.capacity_blocks
        if capacity is None or capacity > len(keys):
            return self._add_short_chain_lru(order, keys)
        move = order.move_to_end
        evicted: list[Key] = []
        inserted: list[Key] = []
        for pos, key in enumerate(keys):
            if key in order:
                move(key)
                continue
            if len(order) >= capacity:
                victim = next(iter(order), None)
                if victim is None or (len(order) <= pos and victim in set(keys[:pos])):
                    return ChainAdded(evicted, pos, inserted)
                del order[victim]
                evicted.append(victim)
            order[key] = None
            inserted.append(key)
        return ChainAdded(evicted, len(keys), inserted)

    def _add_short_chain_lru(self, order: OrderedDict[Key, None], keys: Sequence[Key]) -> ChainAdded:
        """:meth:`_add_chain_lru` of a chain shorter than the capacity (a store's usual case): a
        full dict then always holds more keys than the chain's handled ones, so the victim is
        simply the first key, and the insert never stops early."""
        move = order.move_to_end
        evicted: list[Key] = []
        inserted: list[Key] = []
        # an int either way (unbounded: the chain's length, never used up), so that compiled
        # code counts it down natively rather than through a float/int generic subtract
        free = len(keys) if self.capacity_blocks is None else self.capacity_blocks - len(order)
        pop = order.popitem
        for key in keys:
            if key in order:
                move(key)
                continue
            if free > 0:
                free -= 1
            else:
                evicted.append(pop(last=False)[0])
            order[key] = None
            inserted.append(key)
        return tuple.__new__(ChainAdded, (evicted, len(keys), inserted))   # without the NamedTuple's Python frame

    def leading(self, keys: Sequence[Key], touch: Callable[[Key], object] | None = None) -> int:
        """How many leading keys of ``keys`` are cached; ``touch`` (None: nothing) is called on each."""
        policy = self.policy
        members: OrderedDict[Key, None] | EvictionPolicy = policy._order if type(policy) is LRUPolicy else policy
        n = 0
        for key in keys:
            if key not in members:
                break
            if touch is not None:
                touch(key)
            n += 1
        return n

    def remove(self, key: Key) -> None:
        self.policy.remove(key)

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    def __len__(self) -> int:
        return len(self.policy)


class PinTable:
    """Keys held against eviction by named owners (cached contexts), each until its expiry.

    Pure bookkeeping, no clock: callers pass ``now`` (wall-clock seconds, so a journal of the
    table stays meaningful across a restart). A key is pinned while any live owner holds it;
    eviction policies take :meth:`is_pinned` as their ``is_pinned`` check.
    """

    def __init__(self) -> None:
        self._owners: dict[str, tuple[frozenset[Key], float]] = {}
        self._counts: dict[Key, int] = {}

    def pin(self, owner: str, keys: Sequence[Key], expires_at: float) -> tuple[list[Key], list[Key]]:
        """Hold ``keys`` for ``owner`` until ``expires_at`` (replacing what it held before).
        Returns (keys newly pinned, keys no longer pinned by anyone)."""
        old = self._owners.get(owner, (frozenset(), 0.0))[0]
        new = frozenset(keys)
        self._owners[owner] = (new, expires_at)
        added = [k for k in new - old if self._add(k)]
        return added, [k for k in old - new if self._drop(k)]

    def unpin(self, owner: str) -> list[Key]:
        """Forget ``owner``; returns the keys no longer pinned by anyone."""
        keys, _ = self._owners.pop(owner, (frozenset(), 0.0))
        return [k for k in keys if self._drop(k)]

    def forget_key(self, key: Key) -> None:
        """The key is gone (deleted): no owner holds it any more."""
        if self._counts.pop(key, None) is None:
            return
        for owner, (keys, expires_at) in list(self._owners.items()):
            if key in keys:
                self._owners[owner] = (keys - {key}, expires_at)

    def expired(self, now: float) -> list[str]:
        """Owners whose expiry is at or before ``now`` (still pinned: the caller unpins them)."""
        return [owner for owner, (_, expires_at) in self._owners.items() if expires_at <= now]

    def is_pinned(self, key: Key) -> bool:
        return key in self._counts

    def get(self, owner: str) -> tuple[frozenset[Key], float] | None:
        """(keys, expires_at) that ``owner`` holds, or None."""
        return self._owners.get(owner)

    def entries(self) -> dict[str, tuple[frozenset[Key], float]]:
        """owner -> (keys, expires_at), for a journal or a listing."""
        return dict(self._owners)

    def __len__(self) -> int:
        return len(self._counts)

    def _add(self, key: Key) -> bool:
        self._counts[key] = self._counts.get(key, 0) + 1
        return self._counts[key] == 1

    def _drop(self, key: Key) -> bool:
        num = self._counts.get(key, 0) - 1
        if num > 0:
            self._counts[key] = num
            return False
        self._counts.pop(key, None)
        return True
