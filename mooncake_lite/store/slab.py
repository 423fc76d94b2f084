"""The DRAM tier's memory: one preallocated buffer carved into equal slots, O(1) free list.

With CUDA present the buffer is page-locked (``torch.empty(..., pin_memory=True)``) so GPUs can
DMA from it; otherwise it is an anonymous mmap populated at start (about 0.3 s per GiB). Slots never move: a block's bytes stay where they were received
until the slot is freed, which is what lets the transfer layer read and write them in place.

With ``shared=True`` the slab lives in a sealed memfd (``transfer/shm.py``) that clients on the
same node map read-only: a page of header (the nonce), one u64 generation per slot, then the
slots. A slot's generation goes up each time it is freed, before it can be written again, so a
reader that copied a block and then still sees the generation it was given knows the copy is
whole (see docs/store.md, same-node fast path).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections import deque
from collections.abc import Iterable

from mooncake_lite.transfer.shm import PAGE, Region, align

log = logging.getLogger(__name__)


def _allocate(total_bytes: int, pin: bool) -> tuple[object, memoryview]:
    if pin:
        import torch
        tensor = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
        return tensor, memoryview(tensor.numpy()).cast("B")
    # MAP_POPULATE faults every page in now: first-touch page faults during puts would
    # otherwise halve receive throughput until the slab has been written once.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, total_bytes, flags=flags)
    return buf, memoryview(buf)


def cuda_available() -> bool:
    # Importing torch costs seconds; skip it on machines without an NVIDIA driver at all.
    if not os.path.exists("/proc/driver/nvidia") and not os.path.exists("/dev/nvidiactl"):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class Slab:
    """``num_slots`` slots of ``slot_bytes`` each inside one buffer."""

    def __init__(self, total_bytes: int, slot_bytes: int, pin: bool | None = None, shared: bool = False) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot size must be positive, got {slot_bytes}")
        if total_bytes < slot_bytes:
            raise ValueError(f"DRAM size {total_bytes} is smaller than one slot ({slot_bytes} bytes)")
        self.slot_bytes = slot_bytes
        self.num_slots = total_bytes // slot_bytes
        self.capacity_bytes = self.num_slots * slot_bytes
        self.is_pinned = cuda_available() if pin is None else pin
        self.region: Region | None = None
        self.slab_offset = 0                  # where slot 0 starts in the shared region
        self.gens: memoryview | None = None   # u64 per slot, shared slabs only
        if shared:
            self._owner, self._view = self._allocate_shared()
        else:
            self._owner, self._view = _allocate(self.capacity_bytes, self.is_pinned)
        # FIFO: slots freed together (one evicted batch) are handed out together and in order,
        # so a batch of full-slot blocks usually lands in one contiguous range (see ``views``).
        self._free = deque(range(self.num_slots))
        self._is_free = bytearray(b"\x01") * self.num_slots
        log.info("DRAM slab: %d slots x %d bytes (%s%s)", self.num_slots, slot_bytes,
                 "pinned" if self.is_pinned else "pageable", ", shared" if shared else "")

    def _allocate_shared(self) -> tuple[object, memoryview]:
        # Page-lock a shared slab for CUDA is not built (cudaHostRegister); shared means pageable.
        self.is_pinned = False
        self.slab_offset = align(PAGE + 8 * self.num_slots)
        self.region = Region(self.slab_offset + self.capacity_bytes, name="mooncake-slab")
        self.gens = self.region.view[PAGE:PAGE + 8 * self.num_slots].cast("Q")
        self.region.seal_readonly()
        return self.region, self.region.view[self.slab_offset:]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot number, or None when every slot is in use."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._is_free[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if self._is_free[slot]:
            raise ValueError(f"slot {slot} freed twice")
        self._is_free[slot] = 1
        if self.gens is not None:
            self.gens[slot] += 1   # before the slot can be written again: readers' copies are stale
        self._free.append(slot)

    def view(self, slot: int, nbytes: int | None = None, offset: int = 0) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of a slot (the whole slot by default)."""
        start = slot * self.slot_bytes + offset
        end = start + (self.slot_bytes - offset if nbytes is None else nbytes)
        if offset < 0 or end > (slot + 1) * self.slot_bytes:
            raise ValueError(f"range [{offset}, {offset + (end - start)}) is outside a {self.slot_bytes}-byte slot")
        return self._view[start:end]

    def offset_of(self, slot: int, offset: int = 0) -> int:
        return slot * self.slot_bytes + offset

    def views(self, spans: Iterable[tuple[int, int]]) -> list[memoryview]:
        """Views of ``(slab offset, nbytes)`` spans, merging spans that touch: one big view
        means one big ``recv``/``writev`` entry instead of many small ones."""
        merged: list[list[int]] = []
        for start, nbytes in spans:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += nbytes
            else:
                merged.append([start, nbytes])
        return [self._view[start:start + nbytes] for start, nbytes in merged]
