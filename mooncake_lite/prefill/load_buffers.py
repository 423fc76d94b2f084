"""Host buffers a prefix load reads each layer's block bytes straight into.

A layer load of n prefix blocks asks the store for layer ``l`` of each block with ``out=``
views of one ``[n, 1, kv_heads, 2, block_size, head_dim]`` tensor (the block layout): the store client copies
(shared memory) or receives (TCP) each block's slice into its place, and that tensor is what
``unpack_blocks`` writes into the paged cache. Before, each slice landed in fresh memory, was
copied again into a ``bytearray`` and once more by ``torch.stack``; with the buffer reused, its
pages are also faulted in once, not on every load.

Buffers come in powers of two of blocks, so prefixes of different lengths share them; a few
are kept idle (``max_idle_bytes``), the rest freed. Thread-safe: a buffer is taken on the
event loop and given back from the model thread once the cache holds its bytes.
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np
import torch


class LoadBuffer:
    """One buffer on loan: ``packed`` is the load's destination, ``block_views`` its blocks."""

    __slots__ = ("base", "packed", "block_views", "block_bytes")

    def __init__(self, base: torch.Tensor, num_blocks: int, block_shape: tuple[int, ...]):
        self.base = base
        self.packed = base[:num_blocks * math.prod(block_shape)].view(num_blocks, *block_shape)
        raw = memoryview(self.packed.view(torch.uint8).numpy()).cast("B")
        self.block_bytes = size = raw.nbytes // max(num_blocks, 1)
        self.block_views = [raw[i * size:(i + 1) * size] for i in range(num_blocks)]

    def holds(self, i: int, view: memoryview) -> bool:
        """``view`` is block i's place in this buffer (the store wrote it there), not a copy."""
        return view.nbytes == self.block_bytes and \
            _address(view) == self.packed.data_ptr() + i * self.block_bytes


class LoadBuffers:
    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, max_idle_bytes: int = 64 << 20):
        self.block_shape = block_shape      # one layer of one block: (1, kvh, 2, block_size, hd)
        self.dtype = dtype
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.num_allocated = 0              # buffers ever allocated (reuse keeps this flat)

    def take(self, num_blocks: int) -> LoadBuffer:
        blocks = 1 << max(num_blocks - 1, 0).bit_length()
        with self._lock:
            idle = self._idle.get(blocks)
            base = idle.pop() if idle else None
            if base is not None:
                self._idle_bytes -= base.nbytes
        if base is None:
            base = torch.empty(blocks * math.prod(self.block_shape), dtype=self.dtype)
            self.num_allocated += 1
        return LoadBuffer(base, num_blocks, self.block_shape)

    def give(self, buf: LoadBuffer) -> None:
        """Back for reuse: nothing may read ``buf`` any more (the cache has its bytes). Only a
        buffer whose load completed: never one of a failed or cancelled load, which a cancelled
        TCP read may still be writing into (handing it out again would corrupt another request's
        prefix KV); such a buffer is dropped, and freed once nothing holds it."""
        base = buf.base
        blocks = base.numel() // math.prod(self.block_shape)
        with self._lock:
            if self._idle_bytes + base.nbytes <= self.max_idle_bytes:
                self._idle.setdefault(blocks, []).append(base)
                self._idle_bytes += base.nbytes


def fill(buf: LoadBuffer, views: list[memoryview]) -> None:
    """Make ``buf.packed`` hold the loaded blocks: a store that read a block into its place
    already did; any other view (a store that ignores ``out``, or fell back to fresh memory)
    is copied in. A view of another size is not a layer of this model's block."""
    if len(views) != len(buf.block_views):
        raise ValueError(f"{len(views)} blocks loaded for {len(buf.block_views)} asked")
    for i, view in enumerate(views):
        if not (isinstance(view, memoryview) and view.format == "B"):
            view = memoryview(view).cast("B")
        if not buf.holds(i, view):
            own = buf.block_views[i]
            if view.nbytes != own.nbytes:
                raise ValueError(f"a loaded block layer of {view.nbytes} bytes, expected {own.nbytes}")
            own[:] = view


def _address(view: memoryview) -> int:
    """The view's first byte in memory. ctypes takes 0.6 us (a writable view, as the client's
    are); a read-only one goes through numpy (2 us). Per block of every layer load, so it counts."""
    if view.readonly:
        return np.frombuffer(view, dtype=np.uint8).ctypes.data
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
