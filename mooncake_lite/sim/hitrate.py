"""Paper Table 1: block hit rate by eviction policy and cache capacity, replaying a trace
through one global block cache (the store's own :class:`BlockCache` and policies).

Per request, in arrival order: the leading blocks already cached are hits; then the whole
chain is inserted (hits touched once, new blocks added, evicting by the policy). Every hash id
counts as a block, the partial last one included, as in the paper's trace analysis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mooncake_lite.sim.nodes import cached_prefix
from mooncake_lite.store.eviction import BlockCache
from mooncake_lite.trace.format import TraceRequest

PAPER_CAPACITIES: tuple[int | None, ...] = (None, 100_000, 50_000, 30_000, 10_000, 1_000)
PAPER_POLICIES = ("lru", "lfu", "length-aware")


@dataclass(frozen=True)
class HitRate:
    policy: str
    capacity_blocks: int | None
    block_hit_rate: float
    token_hit_rate: float


def hit_rate(trace: Sequence[TraceRequest], policy: str, capacity_blocks: int | None,
             block_size: int = 512) -> HitRate:
    cache = BlockCache(capacity_blocks, policy)
    blocks = hit_blocks = tokens = hit_tokens = 0
    for r in trace:
        ids = r.hash_ids
        k = cached_prefix(cache, ids)
        hit_blocks += k
        blocks += len(ids)
        hit_tokens += min(k * block_size, r.input_length)
        tokens += r.input_length
        cache.insert_chain(ids)
    return HitRate(policy, capacity_blocks, hit_blocks / blocks if blocks else 0.0,
                   hit_tokens / tokens if tokens else 0.0)


def hit_rate_table(trace: Sequence[TraceRequest], policies: Sequence[str] = PAPER_POLICIES,
                   capacities: Sequence[int | None] = PAPER_CAPACITIES,
                   progress: Callable[[], None] | None = None) -> list[HitRate]:
    """Every policy × capacity; ``progress()`` is called after each cell."""
    out = []
    for policy in policies:
        for cap in capacities:
            out.append(hit_rate(trace, policy, cap))
            if progress is not None:
                progress()
    return out
