"""The CPU decode-attention kernel (``kernels/decode_attention.c``) against the torch reference:
GQA groups, ragged context lengths, scattered block tables; bad block ids refused before a read."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_decode_attention, paged_decode_attention_c, paged_decode_attention_ref
from kernels.quant_build import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the reference serves")


def caches(num_blocks: int, block_size: int, kv_heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, block_size, kv_heads, dim, generator=g) for _ in range(2))


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("lens", [[1], [257], [5, 40, 17], [16, 16]])
def test_the_kernel_matches_the_reference(heads, kv_heads, lens):
    k_cache, v_cache = caches(64, 16, kv_heads, 32)
    width = max(-(-n // 16) for n in lens)
    tables = torch.stack([torch.randperm(64)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, 32)
    context = torch.tensor(lens)
    out = paged_decode_attention_c(q, k_cache, v_cache, tables, context)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, context),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(paged_decode_attention(q, k_cache, v_cache, tables, context), out)   # what the model runs


def test_a_block_id_outside_the_cache_is_refused():
    k_cache, v_cache = caches(4, 16, 1, 8)
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="block ids"):
        paged_decode_attention_c(q, k_cache, v_cache, torch.tensor([[0, 9]]), torch.tensor([20]))
    with pytest.raises(ValueError, match="context lengths"):
        paged_decode_attention_c(q, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([33]))
