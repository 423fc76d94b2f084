import pytest
from hypothesis import given, settings, strategies as st

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.scheduler import BlockEvent, BlockIndex, PrefixMatch


def test_match_reports_each_stores_leading_run_and_the_best():
    idx = BlockIndex()
    idx.add("a", [1, 2, 3])
    idx.add("b", [1, 2, 3, 4, 5])
    idx.add("c", [2, 3, 4])            # holds later blocks but not the first: prefix length 0
    m = idx.match([1, 2, 3, 4, 5, 6])
    assert (m.best_len, m.best_store_id) == (5, "b")
    assert m.lengths == {"a": 3, "b": 5}
    assert m.length_at("c") == 0 and m.length_at("nobody") == 0


def test_a_gap_ends_the_prefix_even_if_later_blocks_are_held():
    idx = BlockIndex()
    idx.add("a", [1, 2, 4, 5])
    assert idx.match([1, 2, 3, 4, 5]).lengths == {"a": 2}
    assert idx.prefix_len([1, 2, 3, 4, 5], "a") == 2


def test_eviction_shortens_the_match_and_counts_stay_right():
    idx = BlockIndex()
    idx.apply(BlockEvent("a", "stored", (1, 2, 3)))
    idx.apply(BlockEvent("a", "stored", (1, 2, 3)))   # idempotent
    assert idx.num_blocks("a") == 3 and len(idx) == 3
    idx.apply(BlockEvent("a", "evicted", (2, 99)))    # unknown key ignored
    assert idx.num_blocks("a") == 2
    assert idx.match([1, 2, 3]).lengths == {"a": 1}
    idx.remove("never-seen", [1])                      # unknown store ignored
    assert idx.holders(1) == ["a"]


def test_bad_event_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown block event kind"):
        BlockIndex().apply(BlockEvent("a", "moved", (1,)))  # type: ignore[arg-type]


def test_drop_store_forgets_it_and_its_slot_is_reused():
    idx = BlockIndex()
    idx.add("a", [1, 2])
    idx.add("b", [1])
    assert idx.drop_store("a") == 2
    assert idx.match([1, 2]).lengths == {"b": 1}
    assert len(idx) == 1
    idx.add("c", [7])                                   # takes a's freed slot
    assert idx.holders(1) == ["b"] and idx.holders(7) == ["c"]
    assert idx.match([1, 2]).lengths == {"b": 1}        # c did not inherit a's blocks
    assert idx.drop_store("a") == 0


def test_ties_go_to_the_store_registered_first():
    idx = BlockIndex()
    idx.add("z", [1, 2])
    idx.add("a", [1, 2])
    assert idx.match([1, 2, 3]).best_store_id == "z"


def test_empty_request_or_empty_index():
    idx = BlockIndex()
    m = idx.match([1, 2])
    assert (m.best_len, m.best_store_id, m.lengths) == (0, None, {})
    idx.add("a", [1])
    assert idx.match([]).best_len == 0


def test_works_with_real_16_byte_chained_keys():
    keys = prefix_hash(list(range(64)), 16)
    idx = BlockIndex()
    idx.add(("10.0.0.1", 7000), keys[:3])
    assert idx.match(keys).lengths == {("10.0.0.1", 7000): 3}


ops = st.lists(st.tuples(st.sampled_from(["add", "remove", "drop"]), st.integers(0, 4),
                         st.lists(st.integers(0, 9), max_size=6)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.integers(0, 9), max_size=8))
def test_matches_a_brute_force_model(operations, request_keys):
    idx, model = BlockIndex(), {}
    for op, store, keys in operations:
        if op == "add":
            idx.add(store, keys)
            model.setdefault(store, set()).update(keys)
        elif op == "remove":
            idx.remove(store, keys)
            model.get(store, set()).difference_update(keys)
        else:
            idx.drop_store(store)
            model.pop(store, None)
        _check_match(idx, model, request_keys)   # after every op: what match remembers stays true


def _check_match(idx: BlockIndex, model: dict, request_keys: list) -> None:
    expected = {}
    for store, held in model.items():
        n = 0
        while n < len(request_keys) and request_keys[n] in held:
            n += 1
        if n:
            expected[store] = n
    m = idx.match(request_keys)
    # before its lengths are read a match answers length_at from its runs; the same after
    assert {s: m.length_at(s) for s in model} == {s: expected.get(s, 0) for s in model}
    assert m.lengths == expected
    assert m == PrefixMatch(m.best_len, m.best_store_id, dict(expected)) and "lengths=" in repr(m)
    assert m.best_len == max(expected.values(), default=0)
    longest = [s for s, n in expected.items() if n == m.best_len]     # ties: the lowest slot
    assert m.best_store_id == (min(longest, key=idx._slots.__getitem__) if longest else None)
    assert {s: n for n, stores in m.runs for s in stores} == m.lengths
    for store in model:
        assert idx.num_blocks(store) == len(model[store])
        assert idx.prefix_len(request_keys, store) == expected.get(store, 0)


def test_keys_held_by_the_same_stores_share_one_mask_object():
    index = BlockIndex()
    for i in range(10):          # slots 0-9 taken: the masks below are ints CPython does not cache
        index.add(f"other{i}", [b"x%d" % i])
    index.add("a", [b"k1", b"k2", b"k3"])
    index.add("b", [b"k2", b"k3", b"k4"])
    index.add("z", [b"k4"])
    masks = index._masks
    assert masks[b"k2"] is masks[b"k3"] and masks[b"k1"] is not masks[b"k2"]
    index.remove("a", [b"k2"])
    index.remove("z", [b"k4"])
    assert masks[b"k2"] is masks[b"k4"] and masks[b"k2"] > 256   # both held by "b" alone
    assert index.match([b"k1", b"k2"]).lengths == {"a": 1}


def test_a_full_sync_replaces_what_the_index_believed_and_marks_the_store_synced():
    idx = BlockIndex()
    idx.add("a", [1, 2, 3])                      # events only: the index may miss some keys
    assert not idx.is_synced("a")
    assert idx.begin_full_sync("a") == 3 and idx.is_synced("a")
    idx.add("a", [2, 9])                         # the inventory as sent
    assert idx.match([2, 9]).lengths == {"a": 2} and idx.match([1]).lengths == {}
    idx.drop_store("a")                          # forgotten: a later inventory is needed again
    assert not idx.is_synced("a")


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=(1 << 300) - 1))
def test_a_masks_slots_are_its_set_bits_lowest_first(mask):
    from mooncake_lite.scheduler.block_index import _slots_of
    assert _slots_of(mask) == [i for i in range(mask.bit_length()) if mask >> i & 1]
