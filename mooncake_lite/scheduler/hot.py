"""Hot blocks: which prefix blocks many requests reuse, and where to copy them before they are needed.

Algorithm 1 copies a prefix only on the critical path of the request that fetches it (a hot-spot
migration), and how long that takes is hard to predict; the paper's answer is to replicate hot
blocks to where they are used ahead of time. This module decides what to copy where; the
conductor's background loop (``conductor/hot_replication.py``) asks the stores to do it.
Pure: no IO, no clock (``now`` is passed in).

The decision, step by step (``HotTracker.plan``):

1. **Heat.** Every accepted request counts one use of each block of the prefix it reused (its
   first ``reused_prefix_blocks`` keys, held locally or fetched). Uses older than ``window_s``
   are forgotten.
2. **Hot.** A block used by at least ``threshold`` requests within the window is hot. Every
   request that reuses block i+1 reused block i, so a hot block's predecessor is hot too.
3. **Targets.** The stores of the live prefill nodes (the caller names them) that do not hold a
   hot block, by the block index. The prefill that served a request writes its blocks back to its
   own store: the nodes that need a hot prefix next are the others, those Algorithm 1 sends load
   to when the holder's queue grows. A store still busy with an earlier plan is skipped, and so
   is a block planned for a store within ``recheck_s`` (the index hears of the copy a little later).
4. **Source.** A store holding the block: the fastest link to the target (measured, else the
   prior), ties to the index's order.
5. **Order and budget.** Per target, hottest first and in prefix order (a store serves only a
   leading run: block i is useless without block i-1, so a block whose predecessor the target
   will not hold is skipped), until the link time they take reaches ``share × period_s``: the
   bytes budget ``share × link speed × period`` of each link the target pulls over. A source
   has the same allowance for what it sends, over all targets of the plan (one store feeding
   many would otherwise spend many shares of its own link): a source whose allowance is spent
   is passed over for the next fastest holder, and a block none can send waits.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from mooncake_lite.scheduler.block_index import BlockIndex
from mooncake_lite.scheduler.links import LinkSpeeds


@dataclass(frozen=True)
class HotConfig:
    threshold: int = 3          # uses within the window that make a block hot
    window_s: float = 60.0      # how long a use counts
    share: float = 0.1          # of each link's time, for background copies (0: off)
    period_s: float = 1.0       # one plan per period
    recheck_s: float = 5.0      # a block planned for a store is not planned there again this soon
    max_requests: int = 4096    # uses remembered at most (memory bound; the oldest go first)
    max_hot: int = 4096         # hottest blocks one plan considers (bounds its time; far above what
                                # a period's budget moves on any link)

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {self.threshold}")
        if not self.window_s > 0 or not self.period_s > 0 or self.recheck_s < 0:
            raise ValueError("window_s and period_s must be positive, recheck_s >= 0")
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        if self.max_requests < 1 or self.max_hot < 1:
            raise ValueError("max_requests and max_hot must be >= 1")


@dataclass(frozen=True)
class Replication:
    """Ask ``target`` to pull ``keys`` (consecutive blocks of one prefix, the first at chain
    position ``first_pos``) from ``source``."""

    source: Hashable
    target: Hashable
    keys: tuple[Hashable, ...]
    first_pos: int
    num_bytes: int


@dataclass(frozen=True)
class Plan:
    replications: tuple[Replication, ...]
    num_hot: int                 # hot blocks (held by some store or not)


class HotTracker:
    """Counts prefix-block reuse over a sliding window and plans background replications."""

    def __init__(self, config: HotConfig) -> None:
        self.config = config
        # A reused prefix is known by its last key (equal chained keys: equal prefixes), so a
        # request costs one count, not one per block; blocks' heat is summed when planning.
        self._uses: deque[tuple[float, Hashable]] = deque()      # (time, last key), oldest first
        self._count: dict[Hashable, int] = {}                     # last key -> uses in the window
        self._chain: dict[Hashable, tuple[Hashable, ...]] = {}    # last key -> the prefix's keys
        self._planned: dict[tuple[Hashable, Hashable], float] = {}   # (target, key) -> when

    # ---- heat --------------------------------------------------------------------------------
    def note(self, now: float, reused_keys: Sequence[Hashable]) -> None:
        """One accepted request reused this prefix (its leading block keys, in order)."""
        if reused_keys:
            last = reused_keys[-1]
            if last not in self._chain:
                self._chain[last] = tuple(reused_keys)
            self._count[last] = self._count.get(last, 0) + 1
            self._uses.append((now, last))
            if len(self._uses) > self.config.max_requests:
                self._forget(self._uses.popleft()[1])
        self._expire(now)

    def _expire(self, now: float) -> None:
        horizon = now - self.config.window_s
        while self._uses and self._uses[0][0] <= horizon:
            self._forget(self._uses.popleft()[1])

    def _forget(self, last: Hashable) -> None:
        n = self._count[last] - 1
        if n:
            self._count[last] = n
        else:
            del self._count[last], self._chain[last]

    def _heat(self) -> dict[Hashable, int]:
        """Uses within the window per block: each prefix's uses count for each of its blocks."""
        heat: dict[Hashable, int] = {}
        for last, n in self._count.items():
            for key in self._chain[last]:
                heat[key] = heat.get(key, 0) + n
        return heat

    def heat(self, key: Hashable) -> int:
        return self._heat().get(key, 0)

    def _hot(self, now: float) -> tuple[list[tuple[Hashable, Hashable | None, int]], int]:
        """The hot blocks as ``(key, predecessor or None, chain position)``: hottest first, then
        prefix order, so each block comes after its predecessor (at most ``max_hot`` of them);
        and how many blocks are hot in all."""
        self._expire(now)
        threshold, heat = self.config.threshold, self._heat()
        found: dict[Hashable, tuple[Hashable | None, int, int]] = {}   # key -> (parent, position, first seen)
        for keys in self._chain.values():
            for pos, key in enumerate(keys):
                if heat[key] < threshold:
                    break          # its successors are no hotter
                if key not in found:
                    found[key] = (keys[pos - 1] if pos else None, pos, len(found))
        ranked = [(-heat[k], pos, seen, k, parent) for k, (parent, pos, seen) in found.items()]
        if len(ranked) > self.config.max_hot:
            ranked = heapq.nsmallest(self.config.max_hot, ranked)   # a block's predecessor ranks before it
        else:
            ranked.sort()
        return [(k, parent, pos) for _, pos, _, k, parent in ranked], len(found)

    # ---- plan --------------------------------------------------------------------------------
    def plan(self, now: float, index: BlockIndex, targets: Iterable[Hashable], *, block_bytes: int,
             prior_bytes_per_s: float, links: LinkSpeeds | None = None,
             busy: Iterable[Hashable] = ()) -> Plan:
        """What to replicate now. ``targets``: the live prefill nodes' stores; ``busy``: those
        still running an earlier plan (skipped). Records what it plans (see ``recheck_s``)."""
        hot, num_hot = self._hot(now)
        cfg = self.config
        self._planned = {tk: t for tk, t in self._planned.items() if now - t < cfg.recheck_s}
        if cfg.share <= 0 or not hot:
            return Plan((), num_hot)
        skip = set(busy)
        holders = {key: index.holders(key) for key, _, _ in hot}     # looked up once for all targets
        out: list[Replication] = []
        sent: dict[Hashable, float] = {}     # seconds of link time each source sends in this plan
        for target in sorted(set(targets) - skip, key=str):
            out.extend(self._plan_target(now, holders, target, hot, block_bytes, prior_bytes_per_s, links, sent))
        return Plan(tuple(out), num_hot)

    def _plan_target(self, now: float, holders_of: dict[Hashable, list[Hashable]], target: Hashable,
                     hot: list[tuple[Hashable, Hashable | None, int]], block_bytes: int,
                     prior: float, links: LinkSpeeds | None, sent: dict[Hashable, float]) -> list[Replication]:
        allowance = self.config.share * self.config.period_s    # seconds of link time
        used = 0.0
        will_hold: set[Hashable] = set()     # held, planned earlier, or planned now
        runs: list[list] = []                # [source, keys, first_pos]
        for key, parent, pos in hot:
            holders = holders_of[key]
            if target in holders or (target, key) in self._planned:
                will_hold.add(key)
                continue
            if parent is not None and parent not in will_hold:
                continue                     # the target could not reuse it
            costs = {s: block_bytes / _speed(links, s, target, prior) for s in holders if s != target}
            if not costs:
                continue                     # evicted everywhere
            if used + min(costs.values()) > allowance:
                break                        # the target's budget is spent; the rest waits for the next plan
            able = [s for s, c in costs.items() if used + c <= allowance and sent.get(s, 0.0) + c <= allowance]
            if not able:
                continue                     # every holder has spent its own allowance this plan
            source = min(able, key=costs.__getitem__)    # the fastest link, first of equals
            used += costs[source]
            sent[source] = sent.get(source, 0.0) + costs[source]
            will_hold.add(key)
            self._planned[(target, key)] = now
            last = runs[-1] if runs else None
            if last is not None and last[0] == source and last[1][-1] == parent:
                last[1].append(key)
            else:
                runs.append([source, [key], pos])
        return [Replication(s, target, tuple(keys), pos, len(keys) * block_bytes) for s, keys, pos in runs]


def _speed(links: LinkSpeeds | None, source: Hashable, target: Hashable, prior: float) -> float:
    measured = links.bandwidth(source, target) if links is not None else None
    return measured or prior
