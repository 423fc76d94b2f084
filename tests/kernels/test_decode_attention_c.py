"""The CPU decode-attention kernel (``kernels/decode_attention.c``) against the torch reference:
GQA groups, ragged context lengths, scattered block tables, head widths that are and are not a
multiple of the AVX-512 path's 16 lanes, and the portable loops; bad block ids refused before a read."""

from __future__ import annotations

import pytest
import torch

from mooncake_kernels.attention import paged_decode_attention, paged_decode_attention_c, paged_decode_attention_ref
from mooncake_kernels.quant_build import build, library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the reference serves")


def caches(num_blocks: int, block_size: int, kv_heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, block_size, kv_heads, dim, generator=g) for _ in range(2))


def attention_case(heads: int, kv_heads: int, lens: list[int], dim: int = 32):
    k_cache, v_cache = caches(64, 16, kv_heads, dim)
    width = max(-(-n // 16) for n in lens)
    tables = torch.stack([torch.randperm(64)[:width] for _ in lens])
    return torch.randn(len(lens), heads, dim), k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("lens", [[1], [257], [5, 40, 17], [16, 16]])
def test_the_kernel_matches_the_reference(heads, kv_heads, lens):
    case = attention_case(heads, kv_heads, lens)
    out = paged_decode_attention_c(*case)
    torch.testing.assert_close(out, paged_decode_attention_ref(*case), atol=1e-5, rtol=1e-5)
    assert torch.equal(paged_decode_attention(*case), out)   # what the model runs


@pytest.mark.parametrize("dim", [64, 40, 8, 136])
def test_head_widths_off_the_vector_width_and_groups_past_four_heads(dim):
    """The vector path holds 64 columns of up to four heads at a time and masks a partial 16."""
    case = attention_case(10, 2, [3, 33, 70], dim)
    torch.testing.assert_close(paged_decode_attention_c(*case), paged_decode_attention_ref(*case),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
@pytest.mark.parametrize("dim", [40, 64, 136])
def test_the_avx2_and_portable_builds_match_the_reference(monkeypatch, march, dim):
    """Built without AVX-512 (x86-64-v3: the AVX2 path, eight lanes with masked tails) and
    without AVX (x86-64: the plain loops), on head widths off either vector width."""
    lib = build(march)
    if lib is None:
        pytest.skip(f"the compiler cannot target {march} here")
    monkeypatch.setattr("mooncake_kernels.quant_build.library", lambda: lib)
    case = attention_case(9, 3, [5, 40, 17, 300], dim)
    torch.testing.assert_close(paged_decode_attention_c(*case), paged_decode_attention_ref(*case),
                               atol=1e-5, rtol=1e-5)


def test_a_block_id_outside_the_cache_is_refused():
    k_cache, v_cache = caches(4, 16, 1, 8)
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="block ids"):
        paged_decode_attention_c(q, k_cache, v_cache, torch.tensor([[0, 9]]), torch.tensor([20]))
    with pytest.raises(ValueError, match="context lengths"):
        paged_decode_attention_c(q, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([33]))
