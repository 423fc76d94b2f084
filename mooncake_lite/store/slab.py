"""The DRAM tier's memory: one preallocated buffer carved into equal slots, O(1) free list.

With CUDA present the buffer is page-locked (``torch.empty(..., pin_memory=True)``) so GPUs can
DMA from it; otherwise it is an mmap whose pages are all faulted in (writable) soon after start,
like a registered pool's: a write into a page never touched costs a page fault (first writes ran
at 0.2 GB/s against 5-7 GB/s into resident pages here). Up to ``SYNC_POPULATE_BYTES`` that happens
before the store serves; a bigger slab is populated by a background thread
(``MADV_POPULATE_WRITE``, in chunks, the GIL released), so a large ``--dram`` does not hold up
start-up (1 GiB took 0.3-5 s to populate here, depending on the load); writes before it is done
are correct, only slower. ``is_populated`` says when it is. Slots never move: a block's bytes
stay where they were received until the slot is freed, which is what lets the transfer layer
read and write them in place.

With ``shared=True`` the slab lives in a sealed memfd (``transfer/shm.py``) that clients on the
same node map read-only: a page of header (the nonce), one u64 generation per slot, then the
slots. A slot's generation goes up each time it is freed, before it can be written again, so a
reader that copied a block and then still sees the generation it was given knows the copy is
whole (see docs/store.md, same-node fast path).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Iterable

from mooncake_lite.transfer.shm import PAGE, Region, address, align

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23          # Linux >= 5.14; not exported by Python's mmap module
SYNC_POPULATE_BYTES = 64 << 20    # slabs up to this size are populated before serving (tests' small ones)
POPULATE_CHUNK = 32 << 20         # one madvise call of the background thread


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def populate_write(start: int, nbytes: int) -> bool:
    """Fault ``[start, start + nbytes)`` of one of our writable mappings in, writable, without
    writing it (a CDLL call: the GIL is released meanwhile). False where the kernel (< 5.14) or
    libc cannot: the pages then fault in as first written (no fallback writes them: the store
    may already be serving from them)."""
    libc = _libc()
    return libc is not None and libc.madvise(start, nbytes, MADV_POPULATE_WRITE) == 0


class Populator:
    """Populates a whole mapping: at once when small, else in a background thread. Holds the
    mapping's owner so it is not unmapped before the thread is done."""

    def __init__(self, owner: object, view: memoryview, what: str = "DRAM slab",
                 sync_bytes: int = SYNC_POPULATE_BYTES, chunk: int = POPULATE_CHUNK) -> None:
        self.done = threading.Event()   # set when nothing more will be faulted in
        self.resident = False           # every page was (False too where madvise cannot)
        self.seconds: float | None = None
        self.what = what
        self._owner, self._start, self._nbytes, self._chunk = owner, address(view), view.nbytes, chunk
        self._lock = threading.Lock()   # held per chunk: ``stop`` waits for the one under way
        self._stopped = False
        if self._nbytes <= sync_bytes:
            self._run()
        else:
            threading.Thread(target=self._run, name="populate", daemon=True).start()

    def _run(self) -> None:
        began = time.perf_counter()
        for offset in range(0, self._nbytes, self._chunk):
            with self._lock:
                if self._stopped:
                    break
                if not populate_write(self._start + offset, min(self._chunk, self._nbytes - offset)):
                    log.info("cannot prefault the %s (madvise: %s); its pages fault in as first written",
                             self.what, os.strerror(ctypes.get_errno()))
                    break
        else:
            self.resident = True
        self.seconds = time.perf_counter() - began
        log.debug("%s resident: %.0f MiB in %.2f s", self.what, self._nbytes / (1 << 20), self.seconds)
        self._owner = None
        self.done.set()

    def stop(self) -> None:
        """No more chunks (call before unmapping the memory early; waits for the chunk under way)."""
        with self._lock:
            self._stopped = True


def _allocate(total_bytes: int, pin: bool) -> tuple[object, memoryview]:
    if pin:
        import torch
        tensor = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
        return tensor, memoryview(tensor.numpy()).cast("B")
    # Not MAP_POPULATE, which would fault every page in before start-up goes on: the
    # Populator does it (in the background for a big slab).
    buf = mmap.mmap(-1, total_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
        # Page-locked memory is resident already.
        self._populator = None if self.is_pinned else Populator(self._owner, self._view)
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
        self.region = Region(self.slab_offset + self.capacity_bytes, name="mooncake-slab", populate=False)
        self.gens = self.region.view[PAGE:PAGE + 8 * self.num_slots].cast("Q")
        self.region.seal_readonly()
        return self.region, self.region.view[self.slab_offset:]

    @property
    def is_populated(self) -> bool:
        """Every page of the slab is resident (writes fault no more)."""
        return self._populator is None or self._populator.done.is_set()

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
