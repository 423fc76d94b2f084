"""The SSD tier: one checksummed file per block, written back off the request path.

File ``<ssd-dir>/<hex[:2]>/<hex>.blk`` (names come only from key bytes, never from the network)::

    magic b"MCKS" | version u16 | chain_pos u16 | num_layers u32 | key 16s | length u64 | crc32 u32 | data

(chain_pos, capped at 65535, lets a promoted block keep its length-aware eviction rank.) Format
version 3: the CRC-32 covers the header's first 36 bytes (everything but the CRC itself) and then
the data, so a changed header field is caught like a changed payload byte, and the data is in the
KV block layout version 1 (head-major, ``transfer/kv_layout.py``; a new layout version is a new
file version). Version 1 files (CRC of the data only) and version 2 files (token-major blocks,
which would be misread) are not read: they count as invalid (logged, counted, deleted).

Writes go to ``.tmp`` and are renamed into place after (optional) fsync, so a crash leaves either
the whole file or none; a block counts as "on SSD" only after the rename. On start the directory
is re-indexed from headers (cheap): every field is checked against the file (magic, version, the
key against the file name, length against the file size, num_layers >= 1 and dividing the
length), and a bad file is deleted and counted. Anything else in the directory (other names,
directories, links) is skipped with a log line, never fatal. The checksum is verified on every
read, and a block that fails it (or any header check) is deleted, counted and reported as a
miss, never served.

Context holds (``BlockStore.hold``) are journaled beside the files (``store/pin_journal.py``), so
pinned blocks stay pinned across a restart; the tier never evicts a held block to make room.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import aiofiles
import aiofiles.os

from mooncake_lite.store.eviction import LRUPolicy
from mooncake_lite.store.pin_journal import PIN_JOURNAL, PinJournal

log = logging.getLogger(__name__)

FILE_MAGIC = b"MCKS"
# 3: blocks in KV layout v1, head-major (2: token-major; 1: the CRC of the data only; neither read)
FILE_VERSION = 3
FILE_HEADER = struct.Struct("<4sHHI16sQI")
CRC_OFFSET = FILE_HEADER.size - 4   # the header bytes before the CRC, all covered by it
KEY_BYTES = 16
_HEX = frozenset("0123456789abcdef")   # key.hex() is lowercase


def file_crc(head: bytes | memoryview, data: bytes | memoryview) -> int:
    """The file's CRC-32: the header up to the CRC field, then the data."""
    return zlib.crc32(data, zlib.crc32(head[:CRC_OFFSET]))


def pack_header(key: bytes, data: bytes | memoryview, num_layers: int, chain_pos: int) -> bytes:
    head = FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION, chain_pos, num_layers, key, len(data), 0)
    return head[:CRC_OFFSET] + struct.pack("<I", file_crc(head, data))


def header_problem(fields: tuple, file_size: int, key: bytes, max_block_bytes: int | None = None) -> str | None:
    """What is wrong with an unpacked header of the file for ``key`` that is ``file_size`` bytes
    long (None: nothing the header alone can tell; the CRC is checked with the data)."""
    magic, version, _, num_layers, file_key, length, _ = fields
    if magic != FILE_MAGIC:
        return f"bad magic {magic!r}"
    if version != FILE_VERSION:
        return f"format version {version} (this store reads version {FILE_VERSION})"
    if file_key != key:
        return "the key in the header is not the file's name"
    if length != file_size - FILE_HEADER.size:
        return f"header length {length} but {file_size - FILE_HEADER.size} bytes of data"
    if num_layers < 1 or length % num_layers:
        return f"{length} bytes do not split into {num_layers} layers"
    if max_block_bytes is not None and length > max_block_bytes:
        return f"{length} bytes is more than a block may hold ({max_block_bytes})"
    return None


def _key_of(path: Path) -> bytes | None:
    """The key a block file's path names, when it is where :meth:`SsdTier.path_of` puts it."""
    name = path.stem
    if path.suffix != ".blk" or len(name) != 2 * KEY_BYTES or not set(name) <= _HEX or \
            path.parent.name != name[:2]:
        return None
    return bytes.fromhex(name)


class SsdTier:
    """Index + write-back queue over a directory. ``on_dropped(key)`` fires when a block leaves
    the tier for good (capacity eviction, failed write, corruption)."""

    def __init__(self, root: str | Path, capacity_bytes: int, *, fsync: bool = True,
                 max_pending_bytes: int = 256 << 20, on_dropped: Callable[[bytes], None] | None = None,
                 max_block_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.max_pending_bytes = max_pending_bytes
        self.max_block_bytes = max_block_bytes   # files holding more are invalid (None: no limit)
        self.on_dropped = on_dropped or (lambda key: None)
        self.is_pinned: Callable[[bytes], bool] = lambda key: False   # held blocks are never evicted
        self.journal = PinJournal(self.root / PIN_JOURNAL, fsync=fsync)
        self._index: dict[bytes, tuple[int, int, int]] = {}  # key -> (length, num_layers, chain_pos) on disk
        self._lru = LRUPolicy()
        self._pending: dict[bytes, tuple[bytes, int, int]] = {}  # queued writes, readable meanwhile
        self._pending_bytes = 0
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.used_bytes = 0
        self.num_writes = self.num_reads = self.num_corrupt = self.num_dropped = self.num_evicted = 0

    # ---- index ------------------------------------------------------------------------------
    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / f"{name}.blk"

    def __contains__(self, key: object) -> bool:
        return key in self._index or key in self._pending

    def __len__(self) -> int:
        return len(self._index) + sum(1 for k in self._pending if k not in self._index)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def keys(self) -> set[bytes]:
        return set(self._index) | set(self._pending)

    def scan(self) -> list[bytes]:
        """Re-index the directory (startup). Removes temp files and block files that fail a header
        check (counted as corrupt); skips, with a log line, anything else it finds."""
        self.root.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, bytes, int, int, int]] = []
        for sub in self._entries(self.root):
            if sub.name in (PIN_JOURNAL, PIN_JOURNAL + ".tmp"):
                continue
            if not (len(sub.name) == 2 and set(sub.name) <= _HEX and self._is_dir(sub)):
                log.warning("SSD tier %s: skipping %s (not a block directory)", self.root, sub.name)
                continue
            for path in self._entries(sub):
                entry = self._scan_entry(path)
                if entry is not None:
                    found.append(entry)
        for _, key, length, num_layers, chain_pos in sorted(found):  # oldest first = least recently used
            self._add(key, length, num_layers, chain_pos)
        log.info("SSD tier %s: re-indexed %d blocks (%d bytes)", self.root, len(self._index), self.used_bytes)
        return [entry[1] for entry in sorted(found)]

    @staticmethod
    def _entries(folder: Path) -> list[Path]:
        try:
            return sorted(folder.iterdir())
        except OSError as exc:
            log.warning("SSD tier: skipping %s: %s", folder, exc)
            return []

    @staticmethod
    def _is_dir(path: Path) -> bool:
        try:
            return stat.S_ISDIR(path.lstat().st_mode)   # a link is never followed
        except OSError:
            return False

    def _scan_entry(self, path: Path) -> tuple[float, bytes, int, int, int] | None:
        try:
            st = path.lstat()
        except OSError as exc:
            log.warning("SSD tier: skipping %s: %s", path, exc)
            return None
        if not stat.S_ISREG(st.st_mode):
            log.warning("SSD tier: skipping %s (not a regular file)", path)
            return None
        if path.suffix == ".tmp":   # a write cut short by a crash
            self._remove_file(path)
            return None
        key = _key_of(path)
        if key is None:
            log.warning("SSD tier: skipping %s (not a block file name)", path)
            return None
        try:
            with open(path, "rb") as fh:
                raw = fh.read(FILE_HEADER.size)
        except OSError as exc:
            log.warning("SSD tier: skipping %s: %s", path, exc)
            return None
        problem = "truncated header" if len(raw) < FILE_HEADER.size else \
            header_problem(FILE_HEADER.unpack(raw), st.st_size, key, self.max_block_bytes)
        if problem is not None:
            self.num_corrupt += 1
            log.warning("SSD file %s is invalid (%s); deleted", path, problem)
            self._remove_file(path)
            return None
        _, _, chain_pos, num_layers, _, length, _ = FILE_HEADER.unpack(raw)
        return st.st_mtime, key, length, num_layers, chain_pos

    @staticmethod
    def _remove_file(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("SSD tier: could not delete %s: %s", path, exc)

    def _add(self, key: bytes, length: int, num_layers: int, chain_pos: int) -> None:
        self._index[key] = (length, num_layers, chain_pos)
        self._lru.insert(key, 0)
        self.used_bytes += FILE_HEADER.size + length

    def _forget(self, key: bytes) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._lru.remove(key)
        self.used_bytes -= FILE_HEADER.size + entry[0]
        return True

    # ---- writes -----------------------------------------------------------------------------
    def enqueue(self, key: bytes, data: bytes, num_layers: int, chain_pos: int = 0) -> bool:
        """Queue a write-back. False (block dropped) when the queue is over its byte budget or
        the block can never fit."""
        if key in self:
            return True
        if self._pending_bytes + len(data) > self.max_pending_bytes or \
                FILE_HEADER.size + len(data) > self.capacity_bytes:
            self.num_dropped += 1
            return False
        self._pending[key] = (data, num_layers, min(chain_pos, 0xFFFF))
        self._pending_bytes += len(data)
        self._queue.put_nowait(key)
        return True

    async def run_writer(self) -> None:
        """Background task: write queued blocks until a None sentinel arrives."""
        while (key := await self._queue.get()) is not None:
            try:
                await self._write_pending(key)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    async def _write_pending(self, key: bytes) -> None:
        item = self._pending.get(key)
        if item is None:
            return  # removed while queued
        try:
            if not await self._make_room(FILE_HEADER.size + len(item[0])):
                raise OSError("the SSD tier is full of held (pinned) blocks")
            await self._write(key, *item)
            if self._pending.get(key) is not item:  # removed while being written
                self._forget(key)
                await self._unlink(self.path_of(key))
        except OSError as exc:
            log.error("SSD write of %s failed: %s; block dropped", key.hex(), exc)
            self.num_dropped += 1
            self.on_dropped(key)
        finally:
            if self._pending.get(key) is item:
                del self._pending[key]
                self._pending_bytes -= len(item[0])

    async def flush(self) -> None:
        """Wait until every queued write has finished."""
        await self._queue.join()

    async def stop(self) -> None:
        await self.flush()
        self._queue.put_nowait(None)
        await self._queue.join()

    async def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used unheld blocks until ``nbytes`` fit; False if they cannot."""
        while self.used_bytes + nbytes > self.capacity_bytes:
            victim = self._lru.victim(self.is_pinned)
            if victim is None:
                return False
            self._forget(victim)
            self.num_evicted += 1
            await self._unlink(self.path_of(victim))
            self.on_dropped(victim)
        return True

    async def _write(self, key: bytes, data: bytes, num_layers: int, chain_pos: int) -> None:
        header = await asyncio.to_thread(pack_header, key, data, num_layers, chain_pos)
        path = self.path_of(key)
        tmp = path.with_suffix(".tmp")
        await aiofiles.os.makedirs(path.parent, exist_ok=True)
        async with aiofiles.open(tmp, "wb") as fh:
            await fh.write(header)
            await fh.write(data)
            await fh.flush()
            if self.fsync:
                await asyncio.to_thread(os.fsync, fh.fileno())
        await aiofiles.os.replace(tmp, path)
        self._add(key, len(data), num_layers, chain_pos)
        self.num_writes += 1

    # ---- reads and deletes --------------------------------------------------------------------
    async def read(self, key: bytes) -> tuple[bytes | memoryview, int, int] | None:
        """(data, num_layers, chain_pos), or None if absent or corrupt (a corrupt file is deleted)."""
        pending = self._pending.get(key)
        if pending is not None:
            return pending
        if key not in self._index:
            return None
        self._lru.touch(key)
        path = self.path_of(key)
        try:
            async with aiofiles.open(path, "rb") as fh:
                raw = await fh.read()
        except FileNotFoundError:
            self._forget(key)
            self.on_dropped(key)
            return None
        except OSError as exc:   # not a file any more, unreadable: a miss, never an error for the batch
            log.warning("SSD block %s cannot be read (%s); dropped", key.hex(), exc)
            self.num_corrupt += 1
            self._forget(key)
            self.on_dropped(key)
            return None
        self.num_reads += 1
        problem = await asyncio.to_thread(self._verify, key, raw, self.max_block_bytes)
        if problem is not None:
            self.num_corrupt += 1
            log.warning("SSD block %s is corrupt (%s); deleted, not served", key.hex(), problem)
            self._forget(key)
            await self._unlink(path)
            self.on_dropped(key)
            return None
        _, _, chain_pos, num_layers, _, _, _ = FILE_HEADER.unpack_from(raw)
        return memoryview(raw)[FILE_HEADER.size:], num_layers, chain_pos

    @staticmethod
    def _verify(key: bytes, raw: bytes, max_block_bytes: int | None = None) -> str | None:
        if len(raw) < FILE_HEADER.size:
            return "truncated header"
        fields = FILE_HEADER.unpack_from(raw)
        problem = header_problem(fields, len(raw), key, max_block_bytes)
        if problem is not None:
            return problem
        view = memoryview(raw)
        if file_crc(view, view[FILE_HEADER.size:]) != fields[-1]:
            return "checksum mismatch (header or data)"
        return None

    async def remove(self, key: bytes) -> bool:
        """Delete a block from the tier (queued or on disk)."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            self._pending_bytes -= len(pending[0])
        on_disk = self._forget(key)
        if on_disk:
            await self._unlink(self.path_of(key))
        return on_disk or pending is not None

    @staticmethod
    async def _unlink(path: Path) -> None:
        try:
            await aiofiles.os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as exc:   # e.g. a directory in its place: leave it, never fail the caller
            log.warning("SSD tier: could not delete %s: %s", path, exc)
