"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of latents.

Each token caches one row per layer: its normalised latent (``kv_lora_rank`` values) and its
rotated rope key (``qk_rope_head_dim``), shared by every head — 576 values for DeepSeek-V3
where grouped-query K/V would cache thousands. The cache's K and V planes (one "head" half the
row wide, ``ModelArgs.from_hf_config``) hold the row's two halves, so blocks, the store, the SSD
tier and the prefill → decode stream carry the latent as they carry K/V.

A prefill expands the latent into per-head keys and values (its queries are many; the expansion
is paid once per context token). A decode step absorbs the up-projections instead: the query
moves into latent space and the output leaves it, so attention reads the cached rows as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mooncake_lite.model.args import ModelArgs, YarnScaling
from mooncake_lite.model.llama import AttentionMetadata, RMSNorm, apply_rope

LORA_NORM_EPS = 1e-6   # the q and kv latent norms' epsilon: DeepSeek's default, not config.rms_norm_eps


class MLAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        m = self.mla = args.mla
        self.num_heads = args.num_heads
        q_out = args.num_heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(args.dim, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.dim, m.latent_width, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, args.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(args.num_heads * m.v_head_dim, args.dim, bias=False)
        yarn = args.rope_scaling if isinstance(args.rope_scaling, YarnScaling) else None
        self.scale = m.qk_head_dim ** -0.5 * (yarn.softmax_mscale if yarn is not None else 1.0)
        self.qkv, self.packs = None, {}   # nothing fused or packed (Transformer.fuse_/pack_ ask)

    def fuse_(self) -> None:
        pass

    def pack_(self) -> None:
        pass

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.mla.rope_interleave:   # pairs (x0, x1), (x2, x3)...: as halves, the same rotation
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, cos, sin)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        m, n = self.mla, x.shape[0]
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.num_heads, m.qk_head_dim)
        q_nope, q_rot = q[..., :m.qk_nope_head_dim], self._rope(q[..., m.qk_nope_head_dim:], cos, sin)
        kv = self.kv_a_proj_with_mqa(x)
        rows = torch.cat([self.kv_a_layernorm(kv[:, :m.kv_lora_rank]),
                          self._rope(kv[:, None, m.kv_lora_rank:], cos, sin)[:, 0]], dim=-1)
        write_rows(k_cache, v_cache, meta.slot_mapping, rows)
        if not meta.is_prefill:
            out = self.attend_absorbed(q_nope, q_rot, read_rows(k_cache, v_cache, meta.block_tables),
                                       meta.context_lens)
        else:
            segments = meta.segments or ((0, n, meta.start_pos),)
            out = torch.cat([self.attend_expanded(q_nope[off:off + cnt], q_rot[off:off + cnt],
                                                  read_rows(k_cache, v_cache, meta.block_tables[i])[:start + cnt], start)
                             for i, (off, cnt, start) in enumerate(segments)])
        return self.o_proj(out.reshape(n, -1).to(x.dtype))

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as per-head key [heads, nope, rank] and value [heads, v, rank] up-projections."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def attend_expanded(self, q_nope, q_rot, rows: torch.Tensor, start: int) -> torch.Tensor:
        """Causal attention of queries at ``start..`` over ``rows`` [context, latent_width], the
        latent expanded to per-head keys and values: [n, heads, v_head_dim]."""
        m, ctx = self.mla, rows.shape[0]
        rows = rows.to(q_nope.dtype)
        kv = self.kv_b_proj(rows[:, :m.kv_lora_rank]).view(ctx, self.num_heads, -1)
        k_rot = rows[:, None, m.kv_lora_rank:].expand(ctx, self.num_heads, m.qk_rope_head_dim)
        k = torch.cat([kv[..., :m.qk_nope_head_dim], k_rot], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        visible = (torch.arange(ctx, device=q.device)[None, :]
                   <= start + torch.arange(q.shape[0], device=q.device)[:, None])
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             kv[..., m.qk_nope_head_dim:].transpose(0, 1),
                                             attn_mask=visible, scale=self.scale)
        return out.transpose(0, 1)

    def attend_absorbed(self, q_nope, q_rot, rows: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """One query per sequence over its cached rows [batch, slots, latent_width] (the first
        ``context_lens`` valid), in latent space: q·k = (q_nope W_uk)·latent + q_rot·k_rot, and
        the output is (attention-weighted latent) W_uv. [batch, heads, v_head_dim]."""
        m = self.mla
        w_uk, w_uv = self._up_weights()
        rows = rows.to(q_nope.dtype)
        latent, k_rot = rows[..., :m.kv_lora_rank], rows[..., m.kv_lora_rank:]
        q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
        scores = (torch.einsum("bhr,blr->bhl", q_latent, latent)
                  + torch.einsum("bhd,bld->bhl", q_rot, k_rot)).float() * self.scale
        slots = torch.arange(rows.shape[1], device=rows.device)
        scores.masked_fill_(slots[None, None, :] >= context_lens[:, None, None], float("-inf"))
        probs = scores.softmax(dim=-1).to(latent.dtype)
        return torch.einsum("bhr,hvr->bhv", torch.einsum("bhl,blr->bhr", probs, latent), w_uv)


def write_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Rows [n, latent_width] into ``slots``: the first half in the K plane, the second in V."""
    half = k_cache.shape[-1]
    k_cache.view(-1, half).index_copy_(0, slots, rows[:, :half].to(k_cache.dtype))
    v_cache.view(-1, half).index_copy_(0, slots, rows[:, half:].to(v_cache.dtype))


def read_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The rows of ``block_table``'s blocks in order: [slots, latent_width] for one table,
    [batch, slots, latent_width] for a batch of them."""
    rows = torch.cat([k_cache[block_table], v_cache[block_table]], dim=-1)   # [..., blocks, block_size, 1, width]
    return rows.reshape(*block_table.shape[:-1], -1, rows.shape[-1])
