"""The simulated stores' fast paths against the general ones: ``BlockCache.add_chain`` under
LRU (the policy's ordered dict walked directly) against the general path, and the index a node's
``store_chain`` feeds with only the keys new in DRAM against one told every key held, as before."""

from __future__ import annotations

import random

import pytest

from mooncake_lite.scheduler.block_index import BlockIndex
from mooncake_lite.sim.store import NodeStore, store_chain
from mooncake_lite.store.eviction import BlockCache


def _chains(rng: random.Random, n: int) -> list[list[int]]:
    """Chains sharing prefixes (documents), with fresh tails, some longer than small caches,
    a few repeating a key."""
    docs = [list(range(1000 * d, 1000 * d + rng.randint(1, 12))) for d in range(6)]
    out, fresh = [], 10**6
    for _ in range(n):
        doc = rng.choice(docs)
        tail = list(range(fresh, fresh + rng.randint(0, 10)))
        fresh += len(tail)
        chain = doc[:rng.randint(0, len(doc))] + tail
        if chain and rng.random() < 0.05:
            chain.append(rng.choice(chain))
        out.append(chain)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_lru_add_chain_fast_path_equals_the_general_path(seed):
    rng = random.Random(seed)
    capacity = rng.choice([0, 1, 5, 17, 60, None])
    fast, general = BlockCache(capacity, "lru"), BlockCache(capacity, "lru")
    never = lambda key: False        # noqa: E731 - a pin check sends add_chain down the general path
    for chain in _chains(rng, 300):
        a, b = fast.add_chain(chain), general.add_chain(chain, never)
        assert a == b
        assert list(fast.policy._order) == list(general.policy._order)
        assert fast.leading(chain) == a.num_held or a.num_held < len(chain)
        if rng.random() < 0.2:
            fast.match_prefix(chain[:3])
            general.match_prefix(chain[:3])


@pytest.mark.parametrize("seed,ssd", [(0, 0), (1, 0), (2, 7), (3, 30), (4, 3)])
@pytest.mark.parametrize("policy", ["lru", "length-aware"])
def test_an_index_told_only_new_keys_equals_one_told_every_key_held(seed, ssd, policy):
    rng = random.Random(seed)
    dram = rng.choice([4, 9, 25])
    told_new = {s: NodeStore(dram, ssd, policy) for s in "ab"}
    told_all = {s: NodeStore(dram, ssd, policy) for s in "ab"}
    idx_new, idx_all = BlockIndex(), BlockIndex()
    for chain in _chains(rng, 300):
        store = rng.choice("ab")
        store_chain(told_new[store], idx_new, store, chain)
        held, dropped = told_all[store].insert(chain)        # the old feeding: every key held
        idx_all.remove(store, dropped)
        idx_all.add(store, held)
        assert told_new[store].prefix(chain) == told_all[store].prefix(chain)
        assert idx_new._masks == idx_all._masks and idx_new.store_ids() == idx_all.store_ids()
        assert all(idx_new.num_blocks(s) == idx_all.num_blocks(s) for s in idx_all.store_ids())
