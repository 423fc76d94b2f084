"""Moving KV between the paged cache and contiguous transfer buffers.

Paged cache (one instance's layers): ``kv`` is ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
Store block bytes, the cluster's one layout (``transfer/kv_layout.py``): one block is
``[num_layers, kv_heads, 2, block_size, head_dim]`` contiguous, head-major, so a layer range is one
contiguous slice and a head range one contiguous run per layer (a TP rank's share of a block).
Token stream (prefill -> decode): one layer's new tokens are ``[2, num_tokens, kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch

from mooncake_kernels.dispatch import fast_module


def pack_blocks_ref(kv: torch.Tensor, block_ids: torch.Tensor, first_layer: int = 0,
                    num_layers: int | None = None) -> torch.Tensor:
    """``[len(block_ids), num_layers, kvh, 2, block_size, hd]`` contiguous copy of the given blocks."""
    last = kv.shape[0] if num_layers is None else first_layer + num_layers
    return kv[first_layer:last, :, block_ids].permute(2, 0, 4, 1, 3, 5).contiguous()


def as_blocks(packed: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``packed`` ``[blocks, layers, ...]`` (block bytes in the cluster layout, whatever the
    trailing dims say) as ``[blocks, layers, kvh, 2, block_size, hd]`` for the cache ``kv``."""
    _, _, _, bs, kvh, hd = kv.shape
    return packed.reshape(packed.shape[0], packed.shape[1], kvh, 2, bs, hd)


def unpack_blocks_ref(kv: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor,
                      first_layer: int = 0) -> None:
    """Inverse of :func:`pack_blocks_ref`: write packed blocks into the cache in place."""
    num_layers = packed.shape[1]
    blocks = as_blocks(packed, kv)
    kv[first_layer:first_layer + num_layers, :, block_ids] = blocks.permute(1, 3, 0, 4, 2, 5).to(kv.dtype)


def gather_tokens_ref(kv: torch.Tensor, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """``[2, len(slots), kvh, hd]``: K and V of one layer at flat slot ids (block*block_size + offset)."""
    layer_kv = kv[layer].flatten(1, 2)  # [2, num_blocks*bs, kvh, hd]
    return layer_kv[:, slots].contiguous()


def scatter_tokens_ref(kv: torch.Tensor, layer: int, slots: torch.Tensor, data: torch.Tensor) -> None:
    """Inverse of :func:`gather_tokens_ref`."""
    layer_kv = kv[layer].flatten(1, 2)
    layer_kv[:, slots] = data.to(kv.dtype)


def pack_blocks(kv, block_ids, first_layer=0, num_layers=None):
    fast = fast_module("triton_kv_pack", kv)
    if fast is not None:
        return fast.pack_blocks_triton(kv, block_ids, first_layer, num_layers)
    return pack_blocks_ref(kv, block_ids, first_layer, num_layers)


def unpack_blocks(kv, block_ids, packed, first_layer=0):
    fast = fast_module("triton_kv_pack", kv, packed)
    if fast is not None:
        return fast.unpack_blocks_triton(kv, block_ids, packed, first_layer)
    return unpack_blocks_ref(kv, block_ids, packed, first_layer)


def gather_tokens(kv, layer, slots):
    fast = fast_module("triton_kv_pack", kv)
    if fast is not None:
        return fast.gather_tokens_triton(kv, layer, slots)
    return gather_tokens_ref(kv, layer, slots)


def scatter_tokens(kv, layer, slots, data):
    fast = fast_module("triton_kv_pack", kv, data)
    if fast is not None:
        return fast.scatter_tokens_triton(kv, layer, slots, data)
    return scatter_tokens_ref(kv, layer, slots, data)
