"""A decode step's layers in one C call (``decode_layers.c``), for a model whose every layer's
products are GGUF blocks kept: the calls ``Block._compact_forward`` makes one by one (the
reference, model/llama.py), with the loop over layers and SwiGLU in C. Its logits are the
per-layer path's within the tolerance ``tests/kernels/test_decode_layers.py`` states (SwiGLU's
exp is the kernel's own). ``MOONCAKE_DECODE_LAYERS=python`` keeps the per-layer path."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mooncake_kernels.device import traced
from mooncake_kernels.quant_build import library
from mooncake_kernels.quant_linear import DEQUANTIZE_ROWS, int8_runs

LAYERS_ENV = "MOONCAKE_DECODE_LAYERS"   # c (default) or python


class CompactLayer(ctypes.Structure):
    """decode_layers.c's ``compact_layer``: one layer's products (q/k/v, o, gate/up, down), norms, K/V."""
    _fields_ = [("w", ctypes.c_void_p * 4), ("type", ctypes.c_int32 * 4), ("attn_norm", ctypes.c_void_p),
                ("ffn_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class DecodeShape(ctypes.Structure):
    """decode_layers.c's ``decode_shape``: the widths and the cache geometry, every layer's."""
    _fields_ = [(name, ctypes.c_int64) for name in ("dim", "heads", "kv_heads", "head_dim", "ffn_dim", "num_blocks",
                                                     "block_size", "max_blocks")] + [("eps", ctypes.c_float),
                                                                                     ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class LayerParts:
    """One layer as the C loop reads it: its four products (each with row-planar ``blocks`` and a
    GGML ``qtype``: ``model.quantized.QuantizedWeight``), its norms' weights and its K/V caches
    ([num_blocks, block_size, kv_heads, head_dim] float32, contiguous)."""
    products: tuple
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class DecodePlan:
    """The C structures for :func:`decode_layers`, built once per model and cache (the pointers
    stay valid while ``parts`` hold the tensors)."""

    def __init__(self, parts: Sequence[LayerParts], *, heads: int, eps: float):
        self.parts = tuple(parts)
        self.table = (CompactLayer * len(parts))()
        for row, p in zip(self.table, parts):
            row.w[:] = [w.blocks.data_ptr() for w in p.products]
            row.type[:] = [w.qtype for w in p.products]
            row.attn_norm, row.ffn_norm = p.attn_norm.data_ptr(), p.ffn_norm.data_ptr()
            row.k_cache, row.v_cache = p.k_cache.data_ptr(), p.v_cache.data_ptr()
        k = parts[0].k_cache
        num_blocks, block_size, kv_heads, head_dim = k.shape
        self.head_dim = head_dim
        self.shape = DecodeShape(dim=parts[0].attn_norm.numel(), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                 ffn_dim=parts[0].products[2].shape[0] // 2, num_blocks=num_blocks,
                                 block_size=block_size, eps=eps, scale=head_dim ** -0.5)


def plan_runs(parts: Sequence[LayerParts]) -> bool:
    """Whether :func:`decode_layers` can run these layers at all (C kernels with the int8 path,
    float32 contiguous caches of one geometry)."""
    lib = library()
    return (bool(parts) and lib is not None and lib.has_int8
            and all(p.k_cache.dtype == p.v_cache.dtype == torch.float32 and p.k_cache.is_contiguous()
                    and p.v_cache.is_contiguous() and p.k_cache.shape == parts[0].k_cache.shape for p in parts))


def decode_layers(plan: DecodePlan, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> bool:
    """``x`` [batch, dim] through every layer of ``plan`` in place; False (nothing done) where
    the C loop does not take this step (the caller's per-layer path serves)."""
    batch = x.shape[0]
    if not (os.environ.get(LAYERS_ENV, "c") == "c" and x.dim() == 2 and batch <= DEQUANTIZE_ROWS
            and int8_runs(x) and x.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous()
            and cos.numel() == signed_sin.numel() == batch * plan.head_dim and slots.shape == (batch,)
            and x.shape[1] == plan.shape.dim and cos.dtype == signed_sin.dtype == torch.float32
            and block_tables.dim() == 2 and block_tables.shape[0] == batch and context_lens.shape == (batch,)
            and slots.dtype == block_tables.dtype == context_lens.dtype == torch.int64
            and block_tables.is_contiguous() and context_lens.is_contiguous()):
        return False
    plan.shape.max_blocks = block_tables.shape[1]
    args = (plan.table, len(plan.table), ctypes.byref(plan.shape), x.data_ptr(), batch, cos.data_ptr(),
            signed_sin.data_ptr(), slots.contiguous().data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
            torch.get_num_threads())
    status = traced("decode_layers", library().decode_layers, *args)
    if status != 0:
        raise ValueError(f"decode_layers: slots {slots.tolist()}, context lengths {context_lens.tolist()} or "
                         f"block tables do not fit a cache of {plan.shape.num_blocks} blocks of {plan.shape.block_size}")
    return True
