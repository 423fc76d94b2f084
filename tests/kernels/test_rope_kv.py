"""The decode step's rotary embedding and KV write in one C call (``kernels/rope_kv.c``) against
the torch path it replaces (``Attention._rope_and_write``: ``apply_rope`` and ``index_copy_``):
the same bits in q, k and the cache; slots outside the cache refused before any write."""

from __future__ import annotations

import pytest
import torch

from mooncake_kernels.quant_build import library
from mooncake_kernels.rope_kv import rope_kv_write
from mooncake_lite.model.llama import apply_rope, rope_cos_sin

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the kernel did not build")
HEADS, KV_HEADS, DIM = 6, 2, 64


def case(n: int):
    g = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, HEADS + 2 * KV_HEADS, DIM, generator=g) * 3
    cos, sin = rope_cos_sin(torch.arange(100, 100 + n), DIM, 10000.0)
    return qkv, cos[:, None, :], sin[:, None, :], torch.randperm(40, generator=g)[:n]


@pytest.mark.parametrize("n", [1, 5])
def test_rotation_and_cache_writes_equal_the_torch_path_bit_for_bit(n):
    qkv, cos, sin, slots = case(n)
    qk = apply_rope(qkv[:, :HEADS + KV_HEADS], cos, sin)
    k_ref, v_ref = torch.zeros(10, 4, KV_HEADS, DIM), torch.zeros(10, 4, KV_HEADS, DIM)
    k_ref.view(-1, KV_HEADS, DIM).index_copy_(0, slots, qk[:, HEADS:])
    v_ref.view(-1, KV_HEADS, DIM).index_copy_(0, slots, qkv[:, HEADS + KV_HEADS:])
    k_cache, v_cache = torch.zeros(10, 4, KV_HEADS, DIM), torch.zeros(10, 4, KV_HEADS, DIM)
    ours = qkv.clone()
    assert rope_kv_write(ours, cos, sin, k_cache, v_cache, slots, HEADS)
    assert torch.equal(ours[:, :HEADS + KV_HEADS], qk)
    assert torch.equal(ours[:, HEADS + KV_HEADS:], qkv[:, HEADS + KV_HEADS:])   # v untouched
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_a_slot_outside_the_cache_is_refused_before_any_write():
    qkv, cos, sin, _ = case(2)
    k_cache, v_cache = torch.zeros(2, 4, KV_HEADS, DIM), torch.zeros(2, 4, KV_HEADS, DIM)
    before = qkv.clone()
    with pytest.raises(ValueError, match="outside a cache of 8"):
        rope_kv_write(qkv, cos, sin, k_cache, v_cache, torch.tensor([3, 8]), HEADS)
    assert torch.equal(qkv, before) and not k_cache.any()


def test_other_dtypes_and_ref_mode_leave_it_to_torch(monkeypatch):
    qkv, cos, sin, slots = case(1)
    caches = torch.zeros(10, 4, KV_HEADS, DIM), torch.zeros(10, 4, KV_HEADS, DIM)
    assert not rope_kv_write(qkv.double(), cos, sin, *caches, slots, HEADS)
    monkeypatch.setenv("MOONCAKE_KERNELS", "ref")
    assert not rope_kv_write(qkv, cos, sin, *caches, slots, HEADS)
