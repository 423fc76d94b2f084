from hypothesis import given, strategies as st

from mooncake_lite.common.hashing import KEY_BYTES, block_key, prefix_hash

BS = 4


def test_only_full_blocks_get_keys():
    assert prefix_hash([], BS) == []
    assert prefix_hash([1, 2, 3], BS) == []
    assert len(prefix_hash(list(range(4)), BS)) == 1
    assert len(prefix_hash(list(range(11)), BS)) == 2
    assert all(len(k) == KEY_BYTES for k in prefix_hash(list(range(12)), BS))


def test_equal_prefixes_equal_keys_and_tail_does_not_matter():
    a = prefix_hash([5, 6, 7, 8, 9, 10, 11, 12, 1], BS)
    b = prefix_hash([5, 6, 7, 8, 9, 10, 11, 12, 2, 3], BS)
    assert a == b


@given(st.lists(st.integers(0, 50_000), min_size=4 * BS, max_size=6 * BS), st.data())
def test_a_token_change_changes_that_key_and_every_later_one(tokens, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + 1) % 50_001
    before, after = prefix_hash(tokens, BS), prefix_hash(changed, BS)
    blk = i // BS
    assert before[:blk] == after[:blk]
    for j in range(blk, len(before)):
        assert before[j] != after[j]


def test_same_block_tokens_after_different_prefix_differ():
    first = block_key(None, [1, 2, 3, 4])
    assert block_key(first, [9, 9, 9, 9]) != block_key(block_key(None, [4, 3, 2, 1]), [9, 9, 9, 9])


def test_seed_changes_keys():
    assert prefix_hash(list(range(8)), BS, seed=0) != prefix_hash(list(range(8)), BS, seed=1)
