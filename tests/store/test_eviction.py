"""Exact eviction order per policy, and BlockCache prefix semantics."""

from __future__ import annotations

import pytest

from mooncake_lite.store.eviction import (BlockCache, EvictionPolicy, LengthAwarePolicy, LFUPolicy,
                                          LRUPolicy, make_policy)


def drain(policy: EvictionPolicy, is_pinned=None) -> list:
    """Evict everything (except pinned keys), returning the order."""
    order = []
    while (key := policy.victim(is_pinned)) is not None:
        policy.remove(key)
        order.append(key)
    return order


def test_make_policy_names():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    assert isinstance(make_policy("length-aware"), LengthAwarePolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")


def test_lru_order():
    p = make_policy("lru")
    for i, k in enumerate("abcd"):
        p.insert(k, i)
    p.touch("a")
    p.insert("b", 0)  # re-insert counts as a hit
    assert drain(p) == ["c", "d", "a", "b"]
    assert len(p) == 0 and p.victim() is None


def test_lfu_order_frequency_then_recency():
    p = make_policy("lfu")
    for i, k in enumerate("abcde"):
        p.insert(k, i)
    p.touch("a"); p.touch("a")   # a: 3
    p.touch("c")                 # c: 2
    p.touch("b")                 # b: 2, more recent than c
    # d and e have 1 (d older), then c before b, then a.
    assert drain(p) == ["d", "e", "c", "b", "a"]


def test_lfu_victim_after_removing_min_bucket():
    p = make_policy("lfu")
    p.insert("x", 0); p.insert("y", 0)
    p.touch("y")
    p.remove("x")  # the frequency-1 bucket disappears
    p.insert("z", 0)
    assert drain(p) == ["z", "y"]


def test_length_aware_order_position_then_recency():
    p = make_policy("length-aware")
    p.insert("a0", 0); p.insert("a1", 1); p.insert("a2", 2)
    p.insert("b0", 0); p.insert("b1", 1)
    p.insert("c2", 2)
    p.touch("a2")  # a2 now more recent than c2
    p.touch("a1")  # a1 more recent than b1
    assert drain(p) == ["c2", "a2", "b1", "a1", "a0", "b0"]


def test_length_aware_keeps_original_position_on_reinsert():
    p = make_policy("length-aware")
    p.insert("k", 5)
    p.insert("j", 3)
    p.insert("k", 0)  # a touch, not a move to position 0
    assert drain(p) == ["k", "j"]
    with pytest.raises(ValueError):
        p.insert("n", -1)


@pytest.mark.parametrize("name", ["lru", "lfu", "length-aware"])
def test_victim_skips_pinned(name):
    p = make_policy(name)
    for i, k in enumerate("abc"):
        p.insert(k, i)
    pinned = {"a", "c"} if name != "length-aware" else {"c", "a"}
    assert p.victim(lambda k: k in pinned) == "b"
    assert p.victim(lambda k: True) is None
    assert drain(p, lambda k: k in pinned) == ["b"]
    assert sorted(drain(p)) == ["a", "c"]


@pytest.mark.parametrize("name", ["lru", "lfu", "length-aware"])
def test_remove_unknown_and_contains(name):
    p = make_policy(name)
    p.remove("nope")
    p.insert(1, 0)
    assert 1 in p and 2 not in p and len(p) == 1


def test_lfu_heap_stays_bounded_under_churn():
    p = LFUPolicy()
    p.insert("base", 0)
    for i in range(2000):
        p.insert(i, 0)
        for _ in range(3):
            p.touch(i)
        p.remove(i)
    assert len(p._heap) <= 2 * len(p._buckets) + 17
    assert drain(p) == ["base"]


def test_block_cache_match_and_insert_lru():
    c = BlockCache(4, "lru")
    assert c.insert_chain([1, 2, 3]) == []
    assert c.match_prefix([1, 2, 9, 3]) == 2
    assert c.insert_chain([7, 8]) == [3]  # 3 is least recent (1 and 2 were touched by the match)
    assert c.match_prefix([1, 2, 3]) == 2
    assert c.policy.victim() == 7  # the second match touched 1 and 2 again


def test_block_cache_protects_chain_being_inserted():
    c = BlockCache(3, "length-aware")
    c.insert_chain(["x0", "x1"])
    # The new chain's own blocks (positions 0..2) must not evict each other: x1 then x0 go.
    assert c.insert_chain(["y0", "y1", "y2"]) == ["x1", "x0"]
    assert c.match_prefix(["y0", "y1", "y2"]) == 3
    # A chain longer than the capacity stops early instead of evicting its own prefix.
    assert c.insert_chain(["z0", "z1", "z2", "z3"]) == ["y2", "y1", "y0"]
    assert c.match_prefix(["z0", "z1", "z2", "z3"]) == 3 and "z3" not in c


def test_block_cache_length_aware_evicts_tails_first():
    c = BlockCache(4, "length-aware")
    c.insert_chain(["a0", "a1", "a2"])
    assert c.insert_chain(["b0", "b1"]) == ["a2"]
    assert c.insert_chain(["c0"]) == ["a1"]  # largest position left (b1 is newer; a1 is older)


def test_block_cache_lfu():
    c = BlockCache(3, "lfu")
    c.insert_chain(["a", "b", "c"])
    c.match_prefix(["a", "b"])
    c.match_prefix(["a"])
    assert c.insert_chain(["d"]) == ["c"]
    assert c.insert_chain(["e"]) == ["d"]  # d has frequency 1, b has 2


def test_block_cache_unbounded_and_zero():
    inf = BlockCache(None, "lru")
    assert inf.insert_chain(list(range(1000))) == [] and len(inf) == 1000
    zero = BlockCache(0, "lfu")
    assert zero.insert_chain([1, 2]) == [] and len(zero) == 0
    with pytest.raises(ValueError):
        BlockCache(-1)


def test_block_cache_respects_external_pins():
    c = BlockCache(2, "lru")
    c.insert_chain(["p", "q"])
    assert c.insert_chain(["r"], is_pinned=lambda k: k == "p") == ["q"]
