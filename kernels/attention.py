"""Attention over a paged KV cache.

Cache layout per layer: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
a sequence's tokens live in the blocks listed by its block table, in order.
"""

from __future__ import annotations

import math
import os
import threading

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from mooncake_kernels.device import traced
from mooncake_kernels.dispatch import fast_module


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, kv_heads, head_dim]`` of one sequence, read through its block table."""
    num_blocks = -(-length // cache.shape[1])
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


# Decode's gathered K/V go into buffers each thread keeps (below) up to this size; larger gathers
# (long contexts at large batches) are allocated per call rather than held for good.
WORKSPACE_MAX_BYTES = 64 << 20
_workspace = threading.local()


def _gather_blocks(cache: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
    """``cache.index_select(0, flat)``, written into a buffer this thread reuses. A fresh
    multi-megabyte tensor per layer and step is handed back to the OS by malloc when freed and
    page-faulted in again on the next call: with the shared 2-CPU box loaded, a batch-16 step of
    smollm2-135m took 2x as long that way (the same CPU time when quiet; docs/model.md, "CPU
    paths"). The result is valid until this thread's next gather under the same ``name``; callers
    consume it at once."""
    shape = (flat.numel(), *cache.shape[1:])
    numel = math.prod(shape)
    if numel * cache.element_size() > WORKSPACE_MAX_BYTES:
        return cache.index_select(0, flat)
    key = (name, cache.dtype, cache.device)
    buf = _workspace.__dict__.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):   # a normal tensor: writable inside and outside inference mode
            buf = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        _workspace.__dict__[key] = buf
    return torch.index_select(cache, 0, flat, out=buf[:numel].view(shape))


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Causal attention of ``q`` ([n, heads, head_dim], positions start_pos..start_pos+n-1) over the
    sequence's cached keys 0..start_pos+n-1 (the new tokens' K/V must already be written).
    The reference: an explicit [n, start_pos+n] boolean mask."""
    n = q.shape[0]
    ctx = start_pos + n
    k = _gather_context(k_cache, block_table, ctx)
    v = _gather_context(v_cache, block_table, ctx)
    q_pos = torch.arange(start_pos, ctx, device=q.device)
    k_pos = torch.arange(ctx, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of ``q`` [heads, n, hd] over ``k``/``v`` [kv_heads, ctx, hd] where the queries
    are the last n of the ctx positions, without a mask tensor. From position 0 (n == ctx) it is
    plain ``is_causal``. With a cached prefix the diagonal is offset (query i sees keys
    0..ctx-n+i): torch's lower-right causal bias says so without materialising it, and on CUDA
    picks the flash or memory-efficient kernel with that variant. Flash takes grouped KV heads
    as they are; where only the memory-efficient kernel applies (float32) the KV heads are
    repeated first, since grouped heads would send torch to the math kernel, which builds the
    mask. (Off CUDA, with a prefix, torch builds the mask itself and warns: see below.)"""
    n, ctx = q.shape[1], k.shape[1]
    groups = q.shape[0] // k.shape[0]
    if groups > 1 and q.is_cuda and not _flash_takes(q, k, v):
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    bias = None if n == ctx else _lower_right(n, ctx)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, is_causal=bias is None,
                                          enable_gqa=k.shape[0] != q.shape[0])[0]


def _lower_right(n: int, ctx: int):
    # Imported here, not at the top: torch.nn.attention pulls in torch._dynamo, sympy and
    # inductor (about 1,100 modules, ~1.6 s of CPU), which every prefill and decode process would
    # otherwise pay at start-up though only a prefix prefill through this path uses it.
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right(n, ctx)


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's flash kernel runs this grouped-query attention (CUDA, half precision)."""
    if not q.is_cuda:
        return False
    try:
        params = SDPAParams(q[None], k[None], v[None], None, 0.0, False, True)
        return bool(can_use_flash_attention(params, False))
    except (TypeError, RuntimeError):   # another torch's signature: repeating the heads is always right
        return False


def paged_prefill_attention_fused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_table: torch.Tensor, start_pos: int) -> torch.Tensor:
    """:func:`paged_prefill_attention_ref` through :func:`causal_sdpa`: no [n, ctx] mask."""
    ctx = start_pos + q.shape[0]
    k = _gather_context(k_cache, block_table, ctx).transpose(0, 1)
    v = _gather_context(v_cache, block_table, ctx).transpose(0, 1)
    return causal_sdpa(q.transpose(0, 1), k, v).transpose(0, 1)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One query per sequence: ``q`` [batch, heads, head_dim]; ``block_tables`` [batch, max_blocks]
    (padded with any valid block id); ``context_lens`` [batch] includes the current token."""
    batch, max_blocks = block_tables.shape
    bs = k_cache.shape[1]
    # index_select, not cache[block_tables]: the same gather at a fraction of advanced indexing's cost on CPU.
    flat = block_tables.reshape(-1)
    k = _gather_blocks(k_cache, flat, "k").view(batch, max_blocks * bs, *k_cache.shape[2:])  # [batch, ctx, kvh, hd]
    v = _gather_blocks(v_cache, flat, "v").view(batch, max_blocks * bs, *v_cache.shape[2:])
    lens = context_lens.tolist() if not context_lens.is_cuda else None   # no device sync on GPUs
    if lens and min(lens) == max(lens):
        # Equal lengths (always so at batch 1): cut the padding off instead of masking it, which
        # spares building and applying a mask per layer.
        k, v, mask = k[:, :lens[0]], v[:, :lens[0]], None
    else:
        mask = (torch.arange(max_blocks * bs, device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, enable_gqa=True)
    return out[:, :, 0, :]


def paged_prefill_attention(q, k_cache, v_cache, block_table, start_pos):
    # Prefill is compute-bound and dominated by the projections, so SDPA over the gathered context
    # serves; what matters is that it runs a fused kernel, not one fed a dense mask. From position 0
    # that is is_causal everywhere; with a prefix on CUDA, the lower-right causal bias. The CPU has
    # no fused kernel for that bias (torch would build the mask and warn each call), so there the
    # reference's explicit mask stays: n*ctx bytes, small beside the attention it masks.
    if start_pos == 0 or q.is_cuda:
        return paged_prefill_attention_fused(q, k_cache, v_cache, block_table, start_pos)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_table, start_pos)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens):
    fast = fast_module("triton_attention", q, k_cache, v_cache)
    if fast is not None:
        return fast.paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens)
    if _c_kernel_runs(q, k_cache, v_cache, block_tables, context_lens):
        return traced("decode_attention", paged_decode_attention_c, q, k_cache, v_cache, block_tables, context_lens)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens)


def _c_kernel_runs(q, k_cache, v_cache, block_tables, context_lens) -> bool:
    from mooncake_kernels.quant_build import library
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.dtype == torch.int64
            and context_lens.dtype == torch.int64 and os.environ.get("MOONCAKE_KERNELS") != "ref"
            and library() is not None)


def paged_decode_attention_c(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """:func:`paged_decode_attention_ref`'s result from ``decode_attention.c``: K/V read in place
    through the block table (no gathered copy per layer), float32 on the CPU."""
    from mooncake_kernels.quant_build import library
    q, tables, lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    batch, heads, dim = q.shape
    out = torch.empty_like(q)
    status = library().decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        batch, heads, k_cache.shape[2], dim, k_cache.shape[1], tables.shape[1], k_cache.shape[0], dim ** -0.5,
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"paged decode attention: context lengths {lens.tolist()} or block ids do not fit "
                         f"a table of {tables.shape[1]} blocks of {k_cache.shape[1]} in a cache of {k_cache.shape[0]}")
    return out


def packed_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             segments, block_tables: torch.Tensor) -> torch.Tensor:
    """Causal attention of a packed prefill: each sequence's queries (``segments``: offset in
    ``q``, length, start position) over its own context only (variable lengths, no padding). The
    projections around it run on all sequences' tokens at once, which is where packing pays;
    attention is per sequence, as in a single prefill."""
    outs = [paged_prefill_attention(q[off:off + n], k_cache, v_cache, block_tables[i], start)
            for i, (off, n, start) in enumerate(segments)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)
