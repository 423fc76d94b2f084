"""The paged-attention references against a naive per-sequence, per-head loop."""

import math

import pytest
import torch

from mooncake_kernels import paged_decode_attention, paged_prefill_attention

BS, KVH, HD = 4, 2, 16
ATOL = 1e-5  # float32; the loop and SDPA differ only in summation order


def naive(q_row, keys, values):
    """softmax(q·K/sqrt(d))·V for one head, written out."""
    scores = torch.stack([torch.dot(q_row, k) for k in keys]) / math.sqrt(q_row.shape[0])
    weights = torch.exp(scores - scores.max())
    weights = weights / weights.sum()
    return sum(w * v for w, v in zip(weights, values))


def context(cache, table, length, kv_head):
    return [cache[table[p // BS], p % BS, kv_head] for p in range(length)]


def make_cache(num_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, BS, KVH, HD, generator=g), torch.randn(num_blocks, BS, KVH, HD, generator=g))


@pytest.mark.parametrize("num_heads", [2, 4, 8])  # GQA groups of 1, 2, 4
def test_decode_matches_naive_loop(num_heads):
    k_cache, v_cache = make_cache(24, num_heads)
    lens = [1, BS, BS + 1, 3 * BS - 1, 5 * BS]   # block-boundary edge cases
    tables = [[3], [10], [0, 7], [23, 4, 11], [9, 8, 2, 15, 20]]
    width = max(map(len, tables))
    # Padding entries point at a block full of huge values: reading past the length would show.
    k_cache[22], v_cache[22] = 1e4, 1e4
    padded = torch.tensor([t + [22] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), num_heads, HD, generator=torch.Generator().manual_seed(1))
    out = paged_decode_attention(q, k_cache, v_cache, padded, torch.tensor(lens))
    group = num_heads // KVH
    for b, (table, n) in enumerate(zip(tables, lens)):
        for h in range(num_heads):
            ref = naive(q[b, h], context(k_cache, table, n, h // group), context(v_cache, table, n, h // group))
            torch.testing.assert_close(out[b, h], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("start, n", [(0, 1), (0, 7), (BS, 3), (BS + 2, 2 * BS), (3, 1)])
def test_prefill_matches_naive_causal_loop(start, n):
    k_cache, v_cache = make_cache(8, start + n)
    table = torch.tensor([5, 0, 6, 2, 7])
    num_heads = 4
    q = torch.randn(n, num_heads, HD, generator=torch.Generator().manual_seed(2))
    out = paged_prefill_attention(q, k_cache, v_cache, table, start)
    for i in range(n):
        visible = start + i + 1  # causal: token i sees positions 0..start+i
        for h in range(num_heads):
            kvh = h // (num_heads // KVH)
            ref = naive(q[i, h], context(k_cache, table, visible, kvh), context(v_cache, table, visible, kvh))
            torch.testing.assert_close(out[i, h], ref, atol=ATOL, rtol=0)


def test_decode_is_prefill_of_the_last_token():
    k_cache, v_cache = make_cache(6, 9)
    table = torch.tensor([4, 1, 3])
    q = torch.randn(1, 4, HD, generator=torch.Generator().manual_seed(3))
    n = 2 * BS + 3
    dec = paged_decode_attention(q, k_cache, v_cache, table[None], torch.tensor([n]))
    pre = paged_prefill_attention(q, k_cache, v_cache, table, n - 1)
    torch.testing.assert_close(dec, pre, atol=ATOL, rtol=0)
