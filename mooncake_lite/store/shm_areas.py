"""The two shared-memory areas a same-node client maps from its store: the store's slab, read
here and checked against its slot generations, and this connection's staging area, handed out
to the puts in flight and sized to the last-level cache (``store/shm_client.py`` uses them).
"""

from __future__ import annotations

import asyncio
import glob
from collections.abc import Awaitable, Callable
from typing import Any

from mooncake_lite.store.slab import Populator
from mooncake_lite.transfer.client import RemoteError
from mooncake_lite.transfer.shm import Mapping, ShmError, copy


class SharedSlab:
    """The store's slab as mapped here: read-only bytes plus the slot generations."""

    def __init__(self, mapping: Mapping, gens_offset: int, num_slots: int) -> None:
        if not (0 < gens_offset and num_slots > 0 and gens_offset + 8 * num_slots <= mapping.size):
            raise ShmError("malformed slab offer")
        self.mapping = mapping
        self.num_slots = num_slots
        self.gens = mapping.view[gens_offset:gens_offset + 8 * num_slots].cast("Q")

    def copy(self, offset: int, size: int, target: memoryview) -> None:
        if not (0 <= offset and offset + size <= self.mapping.size):
            raise RemoteError("bad_reply", f"store named bytes [{offset}, +{size}) outside its slab")
        copy(target[:size], self.mapping.view[offset:offset + size])

    def is_current(self, slot: int, gen: int) -> bool:
        if not 0 <= slot < self.num_slots:
            raise RemoteError("bad_reply", f"store named slot {slot} of {self.num_slots}")
        return self.gens[slot] == gen

    def close(self) -> None:
        self.gens.release()
        self.mapping.close()


RECHECK_S = 0.1   # a put waiting for staging room looks again at least this often


class Staging:
    """This connection's staging area, handed out first-fit to the puts in flight. Only its
    first ``window`` bytes are used (all of it when None)."""

    def __init__(self, mapping: Mapping, window: int | None = None) -> None:
        self.mapping = mapping
        self.size = mapping.size if window is None else max(1, min(window, mapping.size))
        # Its pages, faulted in by a background thread: a first write into a page costs a page
        # fault (0.2 GB/s here against 5-7 into resident pages), which the first puts would pay.
        # Small chunks: closing the connection waits for the one under way, on the event loop.
        self.populator = Populator(mapping.map, mapping.view[:self.size], "staging area", sync_bytes=0,
                                   chunk=2 << 20)
        self._free: list[tuple[int, int]] = [(0, self.size)]   # (start, length), sorted
        self._waiters: list[asyncio.Future] = []

    async def alloc(self, nbytes: int, unblock: Callable[[], Awaitable[bool]] | None = None,
                    pending: Callable[[], bool] | None = None, timeout: float | None = None) -> int | None:
        """A range of ``nbytes``; waits for one to be freed (``unblock``: tried first, true when
        it freed something). None, at once, when ``pending()`` says nothing in flight could free
        room, or after ``timeout`` seconds of waiting: a range that stays taken (a channel the
        store never retired) must not hold a put for ever."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while (start := self._take(nbytes)) is None:
            if unblock is not None and await unblock():
                continue
            if pending is not None and not pending():
                return None
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            waiter = loop.create_future()
            self._waiters.append(waiter)
            # Looked at again now and then: what was in flight may end freeing nothing (a
            # single get), and nothing wakes us then.
            try:
                await asyncio.wait_for(waiter, RECHECK_S if left is None else min(left, RECHECK_S))
            except TimeoutError:
                pass
        return start

    def _take(self, nbytes: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= nbytes:
                self._free[i:i + 1] = [(start + nbytes, length - nbytes)] if length > nbytes else []
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        self._free.append((start, nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged
        self.wake()

    def close(self) -> None:
        self.populator.stop()
        self.mapping.close()

    def wake(self) -> None:
        """Let every ``alloc`` waiting try again (room was freed, or can now be flushed free)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def staging_window(slot_bytes: Any) -> int:
    """How much of a staging area to use: about the last-level cache, so that what a put copies
    in is still in the cache when the store copies it out (first fit reuses the same ranges).
    Spread over a bigger area, both copies miss: batched puts of 1 MiB blocks through a 128 MiB
    area 2.4-2.8 GB/s and 0.39-0.42 CPU s/GB, through 8-32 MiB 3.1-3.7 GB/s and 0.24-0.33 (32 MiB
    of L3 here). Room for two of the store's largest blocks at least."""
    slot = slot_bytes if isinstance(slot_bytes, int) and not isinstance(slot_bytes, bool) else 0
    return max(last_level_cache_bytes(), 2 * slot)


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache of this machine (Linux sysfs), else ``default``."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as fh:
                text = fh.read().strip()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=default)
