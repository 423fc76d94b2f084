"""A decode step's rotary embedding and KV write in one C call (``rope_kv.c``): q and k of the
fused q/k/v product rotated in place, k and v written into the paged cache at their slots, where
torch dispatches a dozen operators a layer. The reference is ``model/llama.py``'s ``apply_rope``
and ``index_copy_``, which the caller runs where :func:`rope_kv_write` answers False."""

from __future__ import annotations

import os

import torch

from mooncake_kernels.device import traced
from mooncake_kernels.quant_build import library


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, heads: int) -> bool:
    """Rotates ``qkv`` [n, heads + 2 kv_heads, dim]'s q and k heads in place by (cos, signed sin)
    [n, (1,) dim] and writes its k and v heads into ``k_cache``/``v_cache`` (any shape whose last
    two dimensions are kv_heads × dim) at flat ``slots`` [n]. False (nothing done) where the C
    kernel does not run for these tensors: the caller's torch path serves."""
    n, width, dim = qkv.shape
    kv_heads = (width - heads) // 2
    if not (qkv.device.type == "cpu" and qkv.dtype == k_cache.dtype == v_cache.dtype == cos.dtype == torch.float32
            and qkv.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype == torch.int64
            and cos.shape[-1] == dim and cos.numel() == signed_sin.numel() == n * dim
            and slots.shape == (n,) and k_cache.shape[-2:] == (kv_heads, dim)
            and os.environ.get("MOONCAKE_KERNELS") != "ref" and (lib := library()) is not None):
        return False
    args = (qkv.data_ptr(), n, heads, kv_heads, dim, cos.data_ptr(), signed_sin.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.contiguous().data_ptr(), k_cache.numel() // (kv_heads * dim))
    status = traced("rope_kv_write", lib.rope_kv_write, *args)
    if status != 0:
        raise ValueError(f"rope_kv_write: slots {slots.tolist()} outside a cache of "
                         f"{k_cache.numel() // (kv_heads * dim)}, or head width {dim} odd or over 1024")
    return True
