"""Triton paged-attention decode (CUDA only): one query token per sequence over its block table.

One program per (sequence, query head). It walks the sequence's context in tiles of ``BLOCK_N``
tokens, looks each token's physical block up in the block table, and keeps an online softmax
(running max, running sum, weighted accumulator) in float32, so it never materialises the
gathered context the torch reference builds. Importing this module raises ImportError without
Triton, which makes :func:`mooncake_kernels.attention.paged_decode_attention` use the reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mooncake_kernels.attention import paged_decode_attention_ref


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_tb,
                   stride_cb, stride_ct, stride_ch,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_head = (head // GROUP).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + d, mask=d_mask, other=0.0).to(tl.float32)
    context_len = tl.load(lens_ptr + seq)

    running_max = -float("inf")
    running_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, context_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < context_len
        block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        tile_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(pos_mask, scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        probs = tl.exp(scores - new_max)
        rescale = tl.exp(running_max - new_max)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(probs[:, None] * v, axis=0)
        running_sum = running_sum * rescale + tl.sum(probs, axis=0)
        running_max = new_max
    out = acc / running_sum
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`mooncake_kernels.attention.paged_decode_attention_ref`."""
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    inner_ok = all(t.stride(-1) == 1 for t in (q, k_cache, v_cache)) and k_cache.stride() == v_cache.stride()
    if not inner_ok or num_heads % num_kv_heads or batch == 0:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens)
    tables = block_tables.to(device=q.device, dtype=torch.int32).contiguous()
    lens = context_lens.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    block_n = max(16, min(64, 8192 // block_d))  # keeps the [BLOCK_N, BLOCK_D] tiles in registers
    _decode_kernel[(batch, num_heads)](
        q, k_cache, v_cache, out, tables, lens, 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n)
    return out
