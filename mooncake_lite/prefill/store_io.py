"""What a prefill stage needs from a KV store, and an in-process implementation.

A stage asks three things: how many leading blocks of a key chain are cached (``match``), the
bytes of one layer range of those blocks (``get_layers``, so loads go layer by layer), and to keep
new full blocks (``put_layers``, its own layer range: a CPP stage only holds its slice). A store
may also have ``prefix_loaded(keys)``, which the stage calls once a request's prefix loads are
over: a store that pinned the matched prefix (``RemoteStore`` on the store's node) lets it go.
Values follow the cluster's block layout ``[num_layers][kv_heads][2][block_size][head_dim]``
(head-major, ``transfer/kv_layout.py``), so a layer range is one contiguous byte slice of a block.

:class:`MemoryStore` is used when the instance runs without ``--store`` (each instance then
reuses only its own prefixes) and in tests; :class:`RemoteStore` adapts the store role's client;
:class:`CompressedStore` wraps either to keep blocks encoded (``--kv-compression``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import torch

from mooncake_kernels.kv_codec import decode_heads, encode_heads


class PrefixStore(Protocol):
    async def match(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` whose blocks (all layers) are stored."""

    async def get_layers(self, keys: Sequence[bytes], first_layer: int, num_layers: int,
                         out: Sequence[memoryview] | None = None) -> list[memoryview]:
        """One byte view per key: layers ``first_layer..first_layer+num_layers-1`` of its block.
        With ``out`` (one buffer per key, each exactly that size) the bytes are written into
        ``out[i]`` and the views are of it: the stage passes its load buffer's blocks, so they
        are read where it unpacks them from (a view elsewhere is copied in, never wrong).
        Raises KeyError if a block is gone (ConnectionError/OSError if the store is): the stage
        then recomputes the prefix."""

    async def put_layers(self, keys: Sequence[bytes], values: Sequence[memoryview], first_layer: int,
                         num_layers: int, first_pos: int = 0) -> None:
        """Store layers ``first_layer..`` of each block (``values[i]`` is that slice of block i);
        ``first_pos`` is keys[0]'s block position in its chain (for length-aware eviction)."""


class MemoryStore:
    """Bounded LRU of blocks in this process, assembled from per-layer-range puts. It holds the
    layers ``layer_range`` (a CPP stage's own slice); layer numbers in calls are global."""

    def __init__(self, layer_range: tuple[int, int], layer_bytes: int, max_blocks: int = 4096):
        self.first_layer, end_layer = layer_range
        self.num_layers = end_layer - self.first_layer
        self.layer_bytes = layer_bytes
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, bytearray] = OrderedDict()
        self._partial: dict[bytes, tuple[bytearray, set[int]]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    async def match(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            n += 1
        return n

    async def get_layers(self, keys: Sequence[bytes], first_layer: int, num_layers: int,
                         out: Sequence[memoryview] | None = None) -> list[memoryview]:
        lo = (first_layer - self.first_layer) * self.layer_bytes
        hi = lo + num_layers * self.layer_bytes
        views = [memoryview(self._blocks[key])[lo:hi] for key in keys]
        return views if out is None else _copied_into(views, out)

    async def put_layers(self, keys: Sequence[bytes], values: Sequence[memoryview], first_layer: int,
                         num_layers: int, first_pos: int = 0) -> None:
        for key, value in zip(keys, values, strict=True):
            if key in self._blocks:
                continue
            if value.nbytes != num_layers * self.layer_bytes:
                raise ValueError(f"value of {value.nbytes} B for {num_layers} layers of {self.layer_bytes} B")
            buf, layers = self._partial.get(key) or (bytearray(self.num_layers * self.layer_bytes), set())
            lo = (first_layer - self.first_layer) * self.layer_bytes
            buf[lo:lo + value.nbytes] = value
            layers.update(range(first_layer, first_layer + num_layers))
            if len(layers) == self.num_layers:
                self._partial.pop(key, None)
                self._blocks[key] = buf
                while len(self._blocks) > self.max_blocks:
                    self._blocks.popitem(last=False)
            else:
                self._partial[key] = (buf, layers)


class CompressedStore:
    """``--kv-compression``: the blocks of ``inner`` are kept encoded by a KV codec
    (``kernels/kv_codec.py``: 1-byte codes and per-layer, per-head scales), so the store's DRAM
    and SSD tiers and its wire carry about half (bfloat16) or a quarter (float32) of the bytes;
    loads are dequantized into the model dtype here, before the stage sees them. An encoded
    layer is still one fixed-size contiguous record, so ``inner`` slices layers unchanged.
    Everything else (store_id, slot_bytes, replicate, close, ...) is ``inner``'s."""

    def __init__(self, inner: PrefixStore, codec, block_shape: tuple[int, int, int], dtype):
        self.inner = inner
        self.codec = codec
        self.block_shape = block_shape      # (block_size, kv_heads, head_dim)
        self.dtype = dtype

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def match(self, keys: Sequence[bytes]) -> int:
        return await self.inner.match(keys)

    async def get_layers(self, keys: Sequence[bytes], first_layer: int, num_layers: int,
                         out: Sequence[memoryview] | None = None) -> list[memoryview]:
        # The encoded bytes are not what ``out`` is for: they are decoded, then copied into it.
        views = await self.inner.get_layers(keys, first_layer, num_layers)
        decoded = await asyncio.to_thread(self._decode, views, num_layers)
        return decoded if out is None else _copied_into(decoded, out)

    async def put_layers(self, keys: Sequence[bytes], values: Sequence[memoryview], first_layer: int,
                         num_layers: int, first_pos: int = 0) -> None:
        if not values:
            return
        encoded = await asyncio.to_thread(self._encode, values, num_layers)
        await self.inner.put_layers(keys, encoded, first_layer, num_layers, first_pos=first_pos)

    def _decode(self, views: Sequence[memoryview], num_layers: int) -> list[memoryview]:
        out = []
        for view in views:
            raw = torch.frombuffer(bytearray(view), dtype=torch.uint8).view(num_layers, -1)
            kv = decode_heads(raw, self.block_shape, self.codec, self.dtype)
            out.append(memoryview(kv.contiguous().view(torch.uint8).numpy()).cast("B"))
        return out

    def _encode(self, values: Sequence[memoryview], num_layers: int) -> list[memoryview]:
        block_size, kv_heads, head_dim = self.block_shape
        shape = (len(values), num_layers, kv_heads, 2, block_size, head_dim)
        packed = torch.stack([torch.frombuffer(bytearray(v), dtype=self.dtype) for v in values]).view(shape)
        encoded = encode_heads(packed, self.codec).reshape(len(values), -1)
        return [memoryview(row.numpy()).cast("B") for row in encoded]


def _copied_into(views: Sequence[memoryview], out: Sequence[memoryview]) -> list[memoryview]:
    """``get_layers``'s ``out`` for a store whose bytes are elsewhere: copied into the caller's
    buffers (views of another size are handed back as they are; the caller refuses them)."""
    if len(out) != len(views):
        raise ValueError(f"{len(views)} keys but {len(out)} output buffers")
    result = []
    for view, target in zip(views, out):
        if view.nbytes != target.nbytes:
            result.append(view)
            continue
        target[:] = view
        result.append(target)
    return result
