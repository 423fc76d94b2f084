"""Paged KV cache: one tensor of fixed-size blocks, a free list, and per-sequence block tables."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from mooncake_lite.model.args import ModelArgs


class PagedKVCache:
    """KV storage for a contiguous range of layers (all of them, or one pipeline stage's slice).

    ``kv`` is ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``; layer indices passed to
    :meth:`layer` are global model layer numbers.
    """

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", layer_range: tuple[int, int] | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.first_layer, self.end_layer = layer_range or (0, args.num_layers)
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (self.end_layer - self.first_layer, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = layer - self.first_layer
        return self.kv[local, 0], self.kv[local, 1]

    def local_layer(self, layer: int) -> int:
        return layer - self.first_layer


class BlockAllocator:
    """O(1) free list of block ids with check/act pairs (``can_allocate`` / ``allocate``)."""

    def __init__(self, num_blocks: int):
        self._free: deque[int] = deque(range(num_blocks))
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        if not self.can_allocate(num):
            raise MemoryError(f"KV cache full: need {num} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num)]

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat slot ids (block * block_size + offset) of token positions ``start..end-1``."""
    pos = torch.arange(start, end)
    table = torch.as_tensor(block_table, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size
