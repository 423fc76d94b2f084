"""Weights kept in a GGUF file's own quantization (Q4_0, Q4_1, Q8_0) instead of dequantized.

A :class:`QuantizedWeight` holds a projection's rows as the file's blocks (4.5 to 8.5 bits a
weight instead of 32) and computes with them (``mooncake_kernels.quant_linear``); ``linear()`` runs it
where a plain or oneDNN-packed weight would run, and the model's own ``nn.Linear`` weight is
then a shape on the ``meta`` device, as after ``Transformer.pack_``. :class:`QuantizedEmbedding`
looks rows up in the same blocks, so a head tied to the embedding reads one copy.

``weights="hybrid"`` (a prefill's ``--weights auto``) also keeps a float32 copy of each layer
product (:meth:`QuantizedWeight.keep_dense`): products of more than ``DEQUANTIZE_ROWS`` rows (a
prefill chunk) run on it, plain or oneDNN-packed as ``--pack-weights`` decides, the values the
blocks' tiled path gives without dequantizing every tile on every forward; fewer rows still run
the block kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mooncake_kernels.norm import rms_norm
from mooncake_kernels.quant_linear import (BLOCK, BLOCK_BYTES, DEQUANTIZE_ROWS, TYPE_NAMES, dequantize, dequantize_ref, quant_linear,
                                  quant_linear_fused, to_planar)


class QuantizedWeight:
    """``rows`` × ``cols`` values given as a file's ``blocks`` (uint8 [rows, cols / 32 * block
    bytes]) of one GGML type and held as the same bytes row-planar (``blocks``: each row's
    scales, minimums, then quants; ``mooncake_kernels.quant_linear.to_planar``), the kernels' layout;
    rows may be reordered and stacked without dequantizing."""

    def __init__(self, blocks: torch.Tensor, qtype: int, cols: int):
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"no compact form for GGML type {qtype}")
        if cols % BLOCK or blocks.dtype != torch.uint8 or blocks.shape[1] != cols // BLOCK * BLOCK_BYTES[qtype]:
            raise ValueError(f"{tuple(blocks.shape)} {blocks.dtype} blocks do not hold {cols} "
                             f"{TYPE_NAMES[qtype]} values per row")
        self.blocks, self.qtype, self.cols = to_planar(blocks, qtype), qtype, cols
        self.dense: torch.Tensor | None = None   # float32 values for wide products (keep_dense)
        self.dense_packed = False                # ... as a oneDNN-packed copy (pack_dense)

    @classmethod
    def _of_planar(cls, planar: torch.Tensor, qtype: int, cols: int) -> "QuantizedWeight":
        weight = cls.__new__(cls)
        weight.blocks, weight.qtype, weight.cols = planar, qtype, cols
        weight.dense, weight.dense_packed = None, False
        return weight

    def keep_dense(self) -> None:
        """Hold the float32 values too, for products of more than ``DEQUANTIZE_ROWS`` rows: a
        prefill forward is compute-bound, and on the copy smollm2's prefill ran 2.1-3.2x the tiled
        blocks' speed at 35-512 tokens (Zen 5, docs/results/2026-11-30-zen5.md §10), for 4-7x the bytes."""
        self.dense = self.dequantize()

    def pack_dense(self, pack: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Replace the float copy by ``pack``'s (``model.linear.pack_weight``) where it gives one."""
        if self.dense is not None and not self.dense_packed and (packed := pack(self.dense)) is not None:
            self.dense, self.dense_packed = packed, True

    def _wide(self, x: torch.Tensor) -> bool:
        return self.dense is not None and x.numel() > DEQUANTIZE_ROWS * self.cols

    def _dense_product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dense_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.dense, bias, "none", [], "")
        return F.linear(x, self.dense, bias)

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.cols

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + (0 if self.dense is None else self.dense.numel() * 4)

    @property
    def bits_per_weight(self) -> float:
        return 8 * BLOCK_BYTES[self.qtype] / BLOCK

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._wide(x):
            return self._dense_product(x, bias)
        return quant_linear(x, self.blocks, self.qtype, bias)

    def fused(self, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """``rms_norm(x) @ Wᵀ + residual`` (each where given), the norm and the sum folded into the
        product (``mooncake_kernels.quant_linear.quant_linear_fused``)."""
        if self._wide(x):
            out = self._dense_product(x if norm is None else rms_norm(x, *norm))
            return out if residual is None else out.add_(residual)
        return quant_linear_fused(x, self.blocks, self.qtype, norm=norm, residual=residual)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], equal to gguf.quants' values."""
        return dequantize_ref(self.blocks, self.qtype)

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 values of rows ``ids`` (an embedding lookup), dequantizing only those: gguf's values,
        by the C kernel where it runs (a decode step's lookup was ten torch operators, 0.19 ms)."""
        rows = self.blocks.index_select(0, ids.reshape(-1))
        return dequantize(rows, self.qtype, self.cols).reshape(*ids.shape, self.cols)

    @staticmethod
    def stack(weights: list["QuantizedWeight"]) -> "QuantizedWeight":
        """One weight holding ``weights``' rows in order (fused projections); all of one type and width."""
        first = weights[0]
        if any(w.qtype != first.qtype or w.cols != first.cols for w in weights):
            raise ValueError("stacked weights must share their type and width")
        return QuantizedWeight._of_planar(torch.cat([w.blocks for w in weights]), first.qtype, first.cols)


def layer_blocks(block: nn.Module) -> list[QuantizedWeight]:
    """A layer's products kept as GGUF blocks (its attention's and MLP's ``packs``; MoE, MLA: none)."""
    packs = {**getattr(block.attention, "packs", {}), **getattr(block.feed_forward, "packs", {})}
    return [w for w in packs.values() if isinstance(w, QuantizedWeight)]


def dense_copies(block: nn.Module) -> list[QuantizedWeight]:
    """A layer's products kept as blocks with a float copy (:meth:`QuantizedWeight.keep_dense`)."""
    return [w for w in layer_blocks(block) if w.dense is not None]


class QuantizedEmbedding(nn.Module):
    """An embedding table kept as ``weight``'s blocks: a lookup dequantizes the rows it reads."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.quantized, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.quantized.take_rows(token_ids).to(self.dtype)
