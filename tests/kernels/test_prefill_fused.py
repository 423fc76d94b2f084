"""Prefill attention without a dense mask equals the masked reference, prefix or not."""

import warnings

import pytest
import torch

import mooncake_kernels.attention as attention
from mooncake_kernels.attention import paged_prefill_attention, paged_prefill_attention_fused, paged_prefill_attention_ref

BS, HD = 4, 16


def case(start: int, n: int, num_heads: int, kv_heads: int, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    needed = -(-(start + n) // BS)
    num_blocks = needed + 4
    k_cache = torch.randn(num_blocks, BS, kv_heads, HD, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, BS, kv_heads, HD, generator=g).to(device, dtype)
    table = torch.randperm(num_blocks, generator=g)[:needed].to(device)   # blocks out of order
    q = torch.randn(n, num_heads, HD, generator=g).to(device, dtype)
    return q, k_cache, v_cache, table


@pytest.mark.parametrize("start, n", [(0, 1), (0, 9), (BS, 3), (BS + 2, 2 * BS + 1), (5 * BS - 1, 1), (3, 12)])
@pytest.mark.parametrize("num_heads, kv_heads", [(2, 2), (4, 2), (6, 2)])
def test_fused_equals_masked_reference(start, n, num_heads, kv_heads):
    q, k_cache, v_cache, table = case(start, n, num_heads, kv_heads, seed=start * 31 + n)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, table, start)
    with warnings.catch_warnings():   # on CPU torch materialises the lower-right bias and says so
        warnings.simplefilter("ignore")
        out = paged_prefill_attention_fused(q, k_cache, v_cache, table, start)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_prefill_from_zero_uses_no_mask(monkeypatch):
    """From position 0 the dispatcher never builds the reference's mask, on any device."""
    def no_ref(*args):
        raise AssertionError("the masked reference ran")
    q, k_cache, v_cache, table = case(0, 10, 4, 2)
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, table, 0)
    monkeypatch.setattr(attention, "paged_prefill_attention_ref", no_ref)
    torch.testing.assert_close(paged_prefill_attention(q, k_cache, v_cache, table, 0), expected, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start, n", [(0, 64), (48, 17), (200, 64)])
def test_cuda_fused_matches_reference_without_materialising(dtype, start, n):
    q, k_cache, v_cache, table = case(start, n, 9, 3, device="cuda", dtype=dtype)   # smollm2's 3-way GQA
    ref = paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), table, start)
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # a fallback that builds the mask warns: that fails here
        out = paged_prefill_attention(q, k_cache, v_cache, table, start)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)
