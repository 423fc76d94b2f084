"""A LLaMA-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

The model is stateless about sequences: callers pass the paged cache and per-call metadata, and may
run it layer by layer (``embed`` → ``layer_forward`` × N → ``head``), which is what layer-wise
prefill and chunked pipeline parallelism need. A model may hold only a slice of the layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mooncake_kernels import packed_prefill_attention, paged_decode_attention, paged_prefill_attention
from mooncake_kernels.decode_layers import DecodePlan, LayerParts, decode_layers, plan_runs
from mooncake_kernels.norm import rms_norm
from mooncake_kernels.rope_kv import rope_kv_write
from mooncake_lite.model.args import ModelArgs, RopeScaling, YarnScaling
from mooncake_lite.model.kv_cache import PagedKVCache
from mooncake_lite.model.linear import PACK_GAIN, fuse_linears, linear, pack_weight, packing_speedup, unheld
from mooncake_lite.model.quantized import QuantizedWeight, dense_copies
from mooncake_lite.model.yarn import yarn_inv_freq


@dataclass
class AttentionMetadata:
    """Where the tokens of one forward call sit.

    Prefill: one sequence, tokens at positions ``start_pos..start_pos+n-1``; ``block_tables`` is [1, nb].
    Decode: one token per sequence; ``context_lens`` [batch] counts tokens including the current one.
    """
    is_prefill: bool
    positions: torch.Tensor      # [num_tokens]
    slot_mapping: torch.Tensor   # [num_tokens] flat cache slots to write the new K/V into
    block_tables: torch.Tensor   # [batch, max_blocks]
    context_lens: torch.Tensor   # [batch]
    start_pos: int = 0
    # A packed prefill (several sequences in one forward): (first token, num tokens, start_pos)
    # of each sequence's run of tokens, which attends only to its own sequence (block_tables[i]).
    segments: tuple[tuple[int, int, int], ...] | None = None


class Collectives(Protocol):
    """What a tensor-parallel rank's model asks of its group (``model/tp_comms.py``)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a row-parallel product's partial sums)."""

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits from every rank's vocab slice (last dimension), on every rank."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One C call (F.rms_norm: six operators): per-op dispatch is a visible share of a small decode step.
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()   # lower precisions normalise in float32 and round once, as HF does
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: RopeScaling | YarnScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    if isinstance(scaling, YarnScaling):
        inv_freq = yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    elif scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)  # half-rotation layout, as in HF LLaMA checkpoints
    cos, sin = emb.cos(), emb.sin()
    if isinstance(scaling, YarnScaling):   # YaRN scales cos and sin alike
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    # The sign of the rotation's first half is folded into sin once per pass (not per layer):
    # x*cos + cat(-x2, x1)*sin == x*cos + cat(x2, x1)*signed_sin, bit for bit.
    return cos, torch.cat([-sin[:, :head_dim // 2], sin[:, head_dim // 2:]], dim=-1)


def llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rule: frequencies whose wavelength exceeds ``original / low_freq_factor`` (long
    against the pretraining context) are divided by ``factor``, so longer contexts stay within the
    angles seen in training; those shorter than ``original / high_freq_factor`` stay; the band
    between blends the two linearly in ``original / wavelength``."""
    wavelen = 2 * math.pi / inv_freq
    # 0 → fully scaled, 1 → untouched; clamping gives the two outer bands exactly.
    keep = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor)).clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / s.factor + keep * inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x`` [n, heads, head_dim] rotated by ``rope_cos_sin``'s (cos, signed sin) of its positions,
    given as [n, head_dim] or already as [n, 1, head_dim] (``Transformer.rope``: once per pass)."""
    if cos.dim() == 2:
        cos, signed_sin = cos[:, None, :], signed_sin[:, None, :]
    # roll by half swaps the halves: one operator where slicing and cat took three
    swapped = x.roll(x.shape[-1] // 2, -1)
    if x.dtype == torch.float32:
        return x * cos + swapped * signed_sin
    return (x.float() * cos + swapped.float() * signed_sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.num_heads * args.head_dim, args.dim, bias=False)
        # Qwen3: every q and k head RMS-normalised over its width before RoPE (one weight each)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None   # set by fuse_()
        self.packs: dict[str, torch.Tensor] = {}   # set by pack_()

    def fuse_(self) -> None:
        """Read q, k and v with one matmul (one pass over the input, one call instead of three)."""
        if self.qkv is None:
            self.qkv = fuse_linears(self.wq, self.wk, self.wv)

    def pack_(self) -> None:
        """oneDNN copies replace the fused q/k/v and the output weights (each where it packs)."""
        if self.qkv is None:
            return
        if (qkv := pack_weight(self.qkv[0])) is not None:
            self.packs["qkv"] = qkv
            self.qkv = (self.qkv[0].to("meta"), self.qkv[1])   # the bias stays: it is added as is
            for lin in (self.wq, self.wk, self.wv):
                lin.weight = unheld(lin.weight)
        if (wo := pack_weight(self.wo.weight)) is not None:
            self.packs["wo"], self.wo.weight = wo, unheld(self.wo.weight)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv is not None:
            return linear(x, *self.qkv, packed=self.packs.get("qkv"))
        return torch.cat([self.wq(x), self.wk(x), self.wv(x)], dim=-1)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        out = self.attend(self._project(x), cos, sin, meta, k_cache, v_cache)
        return linear(out if out.dtype == x.dtype else out.to(x.dtype), self.wo.weight, packed=self.packs.get("wo"))

    def attend(self, qkv: torch.Tensor, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        """The fused q/k/v product's rows [n, q + 2 kv widths] → the attention's [n, q width], K
        and V written into the cache on the way."""
        n, heads, kv_heads = qkv.shape[0], self.num_heads, self.num_kv_heads
        qkv = qkv.view(n, heads + 2 * kv_heads, self.head_dim)
        if self.q_norm is None and rope_kv_write(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, heads):
            q = qkv[:, :heads]   # rotated in place, K and V written: one C call for what follows
        else:
            q = self._rope_and_write(qkv, cos, sin, meta, k_cache, v_cache)
        if meta.segments is not None:
            out = packed_prefill_attention(q, k_cache, v_cache, meta.segments, meta.block_tables)
        elif meta.is_prefill:
            out = paged_prefill_attention(q, k_cache, v_cache, meta.block_tables[0], meta.start_pos)
        else:
            out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens)
        return out.reshape(n, -1)

    def _rope_and_write(self, qkv: torch.Tensor, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        """``rope_kv_write``'s work in torch's operators (another dtype or device, q/k norms); returns q."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qk = qkv[:, :heads + kv_heads]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = apply_rope(qk, cos, sin)   # q and k rotated together
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        if k.dtype != k_cache.dtype:   # a no-op .to() is still an operator call, twice a layer
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.view(-1, kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        return q


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down
        self.gate_up: torch.Tensor | None = None   # set by fuse_()
        self.packs: dict[str, torch.Tensor] = {}   # set by pack_()

    def fuse_(self) -> None:
        """Gate and up projections in one matmul."""
        if self.gate_up is None:
            self.gate_up = fuse_linears(self.w1, self.w3)[0]

    def pack_(self) -> None:
        """oneDNN copies replace the fused gate/up and the down weights (each where it packs)."""
        if self.gate_up is None:
            return
        if (gate_up := pack_weight(self.gate_up)) is not None:
            self.packs["gate_up"], self.gate_up = gate_up, self.gate_up.to("meta")   # a tensor, not a parameter
            self.w1.weight, self.w3.weight = unheld(self.w1.weight), unheld(self.w3.weight)
        if (w2 := pack_weight(self.w2.weight)) is not None:
            self.packs["w2"], self.w2.weight = w2, unheld(self.w2.weight)

    def forward(self, x):
        if self.gate_up is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = linear(x, self.gate_up, packed=self.packs.get("gate_up")).split(self.w1.out_features, dim=-1)
        # in place: no new [n, ffn] tensors
        return linear(F.silu(gate, inplace=True).mul_(up), self.w2.weight, packed=self.packs.get("w2"))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, attention: nn.Module | None = None, feed_forward: nn.Module | None = None,
                 comms: Collectives | None = None):
        super().__init__()
        # A tensor-parallel rank's o and down products are partial sums: added up across ranks
        # before the residual (which every rank holds whole) joins them.
        self.reduce = comms.all_reduce if comms is not None else _whole
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention or Attention(args)   # another kind for MLA (mla.py), experts (moe.py)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward or FeedForward(args)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        if self.reduce is _whole and compact_layer(self.attention, self.feed_forward, x):
            return self._compact_forward(x, cos, sin, meta, k_cache, v_cache)
        # Residuals added into the fresh sublayer outputs (a + b == b + a exactly): no new tensors.
        h = self.reduce(self.attention(self.attention_norm(x), cos, sin, meta, k_cache, v_cache)).add_(x)
        return self.reduce(self.feed_forward(self.ffn_norm(h))).add_(h)

    def _compact_forward(self, x, cos, sin, meta, k_cache, v_cache):
        """:meth:`forward` on GGUF blocks kept (``model/quantized.py``) in five C calls and a
        few operators at decode: each norm folded into the product after it, each residual added
        by the product before it, rotary and KV write in one call (``Attention.attend``); SwiGLU
        stays torch's. The same values as :meth:`forward` (tests/model/test_quantized.py)."""
        att, ffn = self.attention, self.feed_forward
        qkv = att.packs["qkv"].fused(x, norm=(self.attention_norm.weight, self.attention_norm.eps))
        h = att.packs["wo"].fused(att.attend(qkv, cos, sin, meta, k_cache, v_cache), residual=x)
        gate_up = ffn.packs["gate_up"].fused(h, norm=(self.ffn_norm.weight, self.ffn_norm.eps))
        gate, up = gate_up.split(ffn.w1.out_features, dim=-1)
        return ffn.packs["w2"].fused(F.silu(gate, inplace=True).mul_(up), residual=h)


def compact_layer(attention: nn.Module, feed_forward: nn.Module, x: torch.Tensor) -> bool:
    """Whether a layer's four products run on GGUF blocks kept, with nothing between them that
    :meth:`Block._compact_forward` leaves out (a q/k/v bias), on float32 rows."""
    packs, ffn_packs = getattr(attention, "packs", {}), getattr(feed_forward, "packs", {})
    return (x.dim() == 2 and x.dtype == torch.float32 and isinstance(attention, Attention)
            and isinstance(feed_forward, FeedForward) and attention.qkv is not None and attention.qkv[1] is None
            and all(isinstance(p, QuantizedWeight) for p in (packs.get("qkv"), packs.get("wo"),
                                                             ffn_packs.get("gate_up"), ffn_packs.get("w2"))))


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


def _embedding(vocab_size: int, dim: int) -> nn.Embedding:
    # The loaders build on the meta device and load the weights after. There torch's default
    # normal_ init would import torch._dynamo and sympy (~1.6 s of CPU in every prefill and decode
    # process's start-up) to initialise nothing, so the meta build gets an empty weight instead.
    if torch.empty(0).is_meta:
        return nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))
    return nn.Embedding(vocab_size, dim)


class Transformer(nn.Module):
    """Layers ``[first_layer, end_layer)`` of the model; embedding only on the first stage,
    final norm and output head only on the last. A tensor-parallel rank's model has its share's
    shapes in ``args`` and its group in ``comms`` (built by ``model/tensor_parallel.py``)."""

    def __init__(self, args: ModelArgs, layer_range: tuple[int, int] | None = None,
                 make_block: Callable[[ModelArgs, int], nn.Module] | None = None, comms: Collectives | None = None):
        super().__init__()
        self.args = args
        self.comms = comms
        self.first_layer, self.end_layer = layer_range or (0, args.num_layers)
        if not 0 <= self.first_layer < self.end_layer <= args.num_layers:
            raise ValueError(f"bad layer range {layer_range} for {args.num_layers} layers")
        self.is_first = self.first_layer == 0
        self.is_last = self.end_layer == args.num_layers
        self.tok_embeddings = _embedding(args.vocab_size, args.dim) if self.is_first else None
        # ModuleDict keyed by the global layer number, so stage slices keep checkpoint names.
        # ``make_block(args, layer)``: a family whose layers differ (family.py); plain blocks otherwise.
        make_block = make_block or (lambda a, _: Block(a, comms=comms))
        self.layers = nn.ModuleDict({str(i): make_block(args, i) for i in range(self.first_layer, self.end_layer)})
        if self.is_last:
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.output_pack: torch.Tensor | None = None   # set by pack_()
        self.decode_plan: tuple[PagedKVCache, DecodePlan | None] | None = None   # set by _decode_in_c

    def fuse_(self) -> "Transformer":
        """Fuse each layer's q/k/v and gate/up weights (in place, no extra memory). Call it last:
        ``.to()`` after it would copy the fused tensors and their views apart."""
        for block in self.layers.values():
            block.attention.fuse_()
            block.feed_forward.fuse_()
        return self

    def pack_(self) -> "Transformer":
        """Replace the fused weights and the output head by oneDNN packed copies (on a CPU in
        float32), which every product then runs on (docs/model.md, "CPU paths"; a prefill packs only
        where :meth:`packing_speedup` says it pays). The plain weights are released one layer at a
        time (their parameters keep shape and dtype on ``meta``); a tied head's matrix stays. One-way:
        call it after ``fuse_`` and after the last write to a weight, and move the model no more."""
        for block in self.layers.values():
            block.attention.pack_()
            block.feed_forward.pack_()
            for weight in dense_copies(block):   # a hybrid GGUF's float copies (model/quantized.py)
                weight.pack_dense(pack_weight)
        if self.is_last and self.output_pack is None:
            self.output_pack = pack_weight(self.output.weight)
            if self.output_pack is not None:   # a tied embedding keeps its own reference
                self.output.weight = unheld(self.output.weight)
        return self

    def packing_speedup(self, rows: int) -> float | None:
        """:func:`packing_speedup` of products of ``rows`` rows with the first layer's weights (the
        fused q/k/v, output, gate/up and down: every layer's shapes); None where nothing packs
        or once packed. Call it after ``fuse_`` and before ``pack_``."""
        block = next(iter(self.layers.values()), None)
        if block is not None and (dense := dense_copies(block)):   # a hybrid GGUF: its float copies
            return None if any(w.dense_packed for w in dense) else packing_speedup([w.dense for w in dense], rows)
        if block is None or block.attention.qkv is None or block.feed_forward.gate_up is None or self.packed:
            return None
        return packing_speedup([block.attention.qkv[0], block.attention.wo.weight, block.feed_forward.gate_up,
                                block.feed_forward.w2.weight], rows)

    def pack_if_faster_(self, rows: int) -> float | None:
        """:meth:`pack_` where :meth:`packing_speedup` at ``rows`` rows is at least ``PACK_GAIN``
        (a prefill's ``--pack-weights auto``); returns that speedup (None where nothing packs)."""
        gain = self.packing_speedup(rows)
        if gain is not None and gain >= PACK_GAIN:
            self.pack_()
        return gain

    @property
    def packed(self) -> bool:
        return any(isinstance(p, torch.Tensor) or getattr(p, "dense_packed", False)   # blocks alone: not packed
                   for block in self.layers.values() for p in getattr(block.attention, "packs", {}).values())

    @property
    def layer_ids(self) -> range:
        return range(self.first_layer, self.end_layer)

    def rope(self, positions: torch.Tensor):
        """(cos, signed sin) as [n, 1, rope_dim]: shaped for ``apply_rope`` once per pass, not per layer."""
        cos, sin = rope_cos_sin(positions, self.args.rope_dim, self.args.rope_theta, self.args.rope_scaling)
        return cos[:, None, :], sin[:, None, :]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(token_ids)

    def layer_forward(self, layer: int, h: torch.Tensor, rope, meta: AttentionMetadata,
                      cache: PagedKVCache) -> torch.Tensor:
        k_cache, v_cache = cache.layer(layer)
        return self.layers[str(layer)](h, rope[0], rope[1], meta, k_cache, v_cache)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if isinstance(self.output_pack, QuantizedWeight):   # the norm folded into the product: one C call
            return self.output_pack.fused(h, norm=(self.norm.weight, self.norm.eps))
        logits = linear(self.norm(h), self.output.weight, packed=self.output_pack).float()
        if self.comms is not None and self.output.out_features != self.args.vocab_size:
            return self.comms.gather_vocab(logits)   # a vocab-parallel head's slice
        return logits

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        h = self.embed(token_ids)
        rope = self.rope(meta.positions)
        if meta.is_prefill or not self._decode_in_c(h, rope, meta, cache):
            for layer in self.layer_ids:
                h = self.layer_forward(layer, h, rope, meta, cache)
        return self.head(h)

    def _decode_in_c(self, h: torch.Tensor, rope, meta: AttentionMetadata, cache: PagedKVCache) -> bool:
        """A decode step's layers in one C call (``kernels/decode_layers.c``) where every layer is
        compact, without q/k norms or TP; ``h`` changes in place. False: the per-layer path runs."""
        if self.decode_plan is None or self.decode_plan[0] is not cache:   # once per cache
            blocks = [self.layers[str(i)] for i in self.layer_ids]
            parts = [LayerParts((b.attention.packs["qkv"], b.attention.packs["wo"], b.feed_forward.packs["gate_up"],
                                 b.feed_forward.packs["w2"]), b.attention_norm.weight, b.ffn_norm.weight,
                                *cache.layer(i)) for i, b in zip(self.layer_ids, blocks)
                     if self.comms is None and compact_layer(b.attention, b.feed_forward, h)
                     and b.attention.q_norm is None]
            fits = len(parts) == len(blocks) and plan_runs(parts)
            self.decode_plan = (cache, DecodePlan(parts, heads=self.args.num_heads, eps=self.args.norm_eps)
                                if fits else None)
        plan = self.decode_plan[1]
        return plan is not None and decode_layers(plan, h, *rope, meta.slot_mapping, meta.block_tables,
                                                  meta.context_lens)
