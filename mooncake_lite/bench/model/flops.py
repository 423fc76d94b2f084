"""A model's useful work: FLOPs of a prefill and of a decode step (matmuls plus causal attention),
and the weight bytes a decode step reads; the figures are stated against these."""

from __future__ import annotations

import torch

from mooncake_lite.model.args import ModelArgs


def layer_matmul_params(a: ModelArgs) -> int:
    """Matmul weights one token runs through in the layers: with experts, only the ``top_k``
    routed ones it is sent to (and the router and shared experts): ``active_params`` less the
    embeddings and the vectors (norm weights, DeepSeek's correction bias)."""
    if a.moe is None and a.mla is None:
        kv = a.num_kv_heads * a.head_dim
        return a.num_layers * (2 * a.dim * a.q_width + 2 * a.dim * kv + 3 * a.dim * a.ffn_dim)
    per_layer = 2 * a.dim + (2 * a.head_dim if a.qk_norm else 0)
    if a.mla is not None:
        per_layer += a.mla.kv_lora_rank + (a.mla.q_lora_rank or 0)
    vectors = a.num_layers * per_layer + a.dim
    if a.moe is not None and a.moe.has_correction_bias:
        vectors += a.moe.num_experts * sum(a.moe.is_sparse(i) for i in range(a.num_layers))
    return a.active_params() - a.vocab_size * a.dim * (1 if a.tie_embeddings else 2) - vectors


def prefill_flops(a: ModelArgs, num_tokens: int) -> float:
    """Useful FLOPs of a prefill from position 0; the head runs on the last position only."""
    attention = 4 * a.num_layers * a.q_width * num_tokens * (num_tokens + 1) / 2  # QK^T and PV, causal
    return 2 * layer_matmul_params(a) * num_tokens + attention + 2 * a.dim * a.vocab_size


def decode_flops(a: ModelArgs, batch: int, context_len: int) -> float:
    per_token = 2 * matmul_weights(a) + 4 * a.num_layers * a.q_width * context_len
    return batch * per_token


def matmul_weights(a: ModelArgs) -> int:
    """Weights a decode step's products multiply by: every layer's and the head's."""
    return layer_matmul_params(a) + a.dim * a.vocab_size


def weight_bytes(a: ModelArgs, dtype: torch.dtype, touched_experts: int | None = None) -> int:
    """Bytes a decode step must read: every matmul weight (the embedding lookup reads one row).
    With experts, those the step ran: ``touched_experts`` summed over the layers (the union over
    its tokens, ``MoE.num_touched``), else one token's top-k per sparse layer."""
    params = matmul_weights(a)
    if a.moe is not None and touched_experts is not None:
        m = a.moe
        active = m.top_k * sum(m.is_sparse(i) for i in range(a.num_layers))
        params += (touched_experts - active) * 3 * a.dim * m.expert_ffn_dim
    return params * torch.empty((), dtype=dtype).element_size()


def held_weight_bytes(model) -> int:
    """Bytes a decode step of ``model`` (a whole one) reads: :func:`weight_bytes` in its dtype,
    less what each product kept as a GGUF's blocks saves (``model/quantized.py``; a tied head's
    blocks, shared with the embedding, read once)."""
    from mooncake_lite.model.quantized import QuantizedWeight
    size = next(p for p in model.parameters() if p.device.type != "meta").element_size()
    parts = [*(p for b in model.layers.values() for p in (*b.attention.packs.values(), *b.feed_forward.packs.values())),
             model.output_pack]
    compact = {id(p): p for p in parts if isinstance(p, QuantizedWeight)}.values()
    return matmul_weights(model.args) * size - sum(p.shape[0] * p.shape[1] * size - p.nbytes for p in compact)
