"""Shared memory between processes of one node: the same-node fast path's memory.

A ``Region`` is an anonymous memfd (no name in any filesystem, freed when the last process
holding it exits, so a killed store leaves nothing behind in /dev/shm) mapped by its creator.
Another process opens it as ``/proc/<pid>/fd/<fd>``, which the kernel allows only to processes
that may inspect the creator (same user, same PID namespace), and maps it too. Its first 16
bytes are a random nonce the creator also announces on the authenticated control connection;
an opener that reads the same nonce knows it mapped that very memory, not a file of another
process or host that happens to have the same pid.

``seal_readonly`` seals a region so that no process can map it writable or ``write()`` to it any
more (the creator's own mapping stays writable): readers of the store's slab cannot write it,
whatever they do with the file descriptor.

``host_identity`` names this node as seen from here (machine id, boot id, network and PID
namespaces); two processes that differ in it never try each other's memory.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

NONCE_BYTES = 16
PAGE = mmap.PAGESIZE
# Linux >= 5.1: no new writable mappings or writes, existing ones keep working. Not exported by
# Python's fcntl module.
F_SEAL_FUTURE_WRITE = 0x10


class ShmError(OSError):
    """Shared memory cannot be created, opened or verified here (callers fall back to TCP)."""


def is_supported() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


def host_identity() -> str:
    """What two processes must share to use each other's memfds: one boot of one machine (a
    fresh boot reuses pids), and one network and PID namespace (pids name different processes
    in different PID namespaces; network namespaces stand for "nodes" in the tests)."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    for ns in ("net", "pid"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("")
    return "/".join(parts)


def align(value: int, to: int = PAGE) -> int:
    return -(-value // to) * to


class Region:
    """A memfd of ``size`` bytes mapped read-write by its creator; ``nonce`` fills bytes [0, 16)."""

    def __init__(self, size: int, name: str = "mooncake", populate: bool = True) -> None:
        if not is_supported():
            raise ShmError("memfd_create or /proc/<pid>/fd is not available here")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # MAP_POPULATE allocates every page now (first-touch faults would halve the first
            # writes); without it pages are allocated as they are touched (staging areas).
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self.map = mmap.mmap(self.fd, size, flags=flags)
        except OSError:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.view[:NONCE_BYTES] = self.nonce

    def seal_readonly(self) -> None:
        """From now on nobody can map this memfd writable or write to it (our mapping stays)."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)

    def offer(self, **extra: Any) -> dict[str, Any]:
        """What a peer needs to open and verify this region (sent on an authenticated connection)."""
        return {"pid": os.getpid(), "fd": self.fd, "size": self.size, "nonce": self.nonce.hex(),
                "host": host_identity(), **extra}

    def close_fd(self) -> None:
        """No new opener can reach the memfd any more; mappings stay valid."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.close_fd()
        self.view.release()
        try:
            self.map.close()
        except BufferError:   # a view of it is still alive somewhere: the GC unmaps it later
            pass


@dataclass
class Mapping:
    """A peer's region as this process mapped it."""
    map: mmap.mmap
    view: memoryview
    size: int

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:
            pass


def open_offer(offer: Any, writable: bool = False, populate: bool = False) -> Mapping:
    """Map the region a peer offered (``Region.offer``), after checking it is ours to use: same
    host identity, the file opens, has the announced size, and starts with the announced nonce.
    ``ShmError`` when any of that fails (the caller uses TCP instead). Not populated unless asked:
    mapping a 1 GiB slab with MAP_POPULATE took 0.2-0.4 s per connection here, and a read fault
    maps 16 pages of it at once (the kernel's fault-around), so a lazily mapped page costs
    little, once."""
    try:
        pid, fd, size, nonce = int(offer["pid"]), int(offer["fd"]), int(offer["size"]), bytes.fromhex(offer["nonce"])
        host = offer["host"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ShmError(f"malformed shared-memory offer: {exc}") from None
    if host != host_identity():
        raise ShmError("the peer is on another host or namespace")
    if size < NONCE_BYTES or len(nonce) != NONCE_BYTES:
        raise ShmError("malformed shared-memory offer")
    try:
        handle = os.open(f"/proc/{pid}/fd/{fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError as exc:
        raise ShmError(f"cannot open the peer's memory: {exc}") from None
    try:
        if os.fstat(handle).st_size != size:
            raise ShmError("the peer's memory has another size than announced")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        mapped = mmap.mmap(handle, size, flags=flags, prot=prot)
    except OSError as exc:
        raise ShmError(f"cannot map the peer's memory: {exc}") from None
    finally:
        os.close(handle)
    mapping = Mapping(mapped, memoryview(mapped), size)
    if mapping.view[:NONCE_BYTES] != nonce:
        mapping.close()
        raise ShmError("the peer's memory does not carry the announced nonce")
    return mapping


def address(buf: memoryview) -> int:
    """Where a writable buffer's bytes start."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` (same length), fast whatever ``dst``'s alignment: memmove's ``rep movsb``
    is up to 10x slower into a destination misaligned against a cache-line aligned source (a
    64 KiB copy: 22 µs instead of 2; 256 KiB: 90 µs instead of 7), so the few head bytes go
    first and the bulk is copied into an aligned destination."""
    head = -address(dst) % 64 if src.nbytes >= 4096 else 0
    if head:
        dst[:head] = src[:head]
    dst[head:] = src[head:]


def aligned_buffer(nbytes: int, to: int = 64) -> memoryview:
    """Fresh writable memory starting on a ``to``-byte boundary (see ``copy``), not zeroed first:
    it is about to be overwritten, and zeroing is a pass over memory as costly as the copy
    (a fresh 16 MiB result: 2.7 GB/s with ``np.empty``, 1.5 with ``bytearray`` here)."""
    raw = memoryview(np.empty(nbytes + to, dtype=np.uint8))
    start = -address(raw) % to   # (``ndarray.ctypes`` costs 1.5 µs, a third of a 64 KiB get's copy)
    return raw[start:start + nbytes]
