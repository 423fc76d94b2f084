"""The machine's own limits beside ``mooncake bench store``, measured in the same run: single-
thread memcpy (cache-hot, best of N passes; and "cold", out of and into memory of the kind the
store's slab is) and a plain blocking-socket loopback transfer between two processes
(``recv_into`` preallocated buffers). The store's figures are printed as ratios to these."""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import time

from mooncake_kernels.timing import best_seconds
from mooncake_lite.transfer.shm import aligned_buffer, copy

MEMCPY_PASSES = 5


def memcpy_gbps(size: int, total: int) -> float:
    src = bytearray(os.urandom(4096)) * (size // 4096) + os.urandom(size % 4096)
    dst_view, src_view = memoryview(bytearray(size)), memoryview(src)
    count = max(4, total // size // MEMCPY_PASSES)

    def one_pass() -> None:
        for _ in range(count):
            dst_view[:] = src_view  # one memcpy of the whole block
    # best of N passes (kernels/timing.py): the machine's limit, not a pass another process slowed
    return count * size / best_seconds(one_pass, None, MEMCPY_PASSES, warmup=1) / 1e9


def memcpy_cold_gbps(size: int, total: int, arena_bytes: int, sources: int) -> tuple[float, float]:
    """Single-thread memcpy as the same-node path makes it, with memory far larger than the
    last-level cache: (GB/s out of ``sources`` distinct blocks into one reused buffer, as a get
    from the slab; GB/s from one buffer into successive blocks of an ``arena_bytes`` arena, as
    the store's copy of a put into its slab). The arena is populated first (as the slab is)."""
    slots = max(1, arena_bytes // size)
    arena = slab_like(slots * size)
    view, buf = memoryview(arena), aligned_buffer(size)
    buf[:] = view[:size]
    count = max(16, total // size)
    sources = max(1, min(sources, slots))
    start = time.perf_counter()
    for i in range(count):
        at = (i % sources) * size
        copy(buf, view[at:at + size])
    read = count * size / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    for i in range(count):
        at = (i % slots) * size
        copy(view[at:at + size], buf)
    return read, count * size / (time.perf_counter() - start) / 1e9


def slab_like(nbytes: int) -> mmap.mmap:
    """Memory of the kind the store's slab is: a shared memfd mapping (4 KiB pages: this
    kernel gives shared memory no transparent huge pages), every page resident."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if not hasattr(os, "memfd_create"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | populate)
    fd = os.memfd_create("bench-arena", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | populate)
    finally:
        os.close(fd)


def socket_sender(hostport: str, size: int, count: int) -> int:
    host, port = hostport.rsplit(":", 1)
    data = memoryview(bytearray(b"\x5a" * size))
    with socket.create_connection((host, int(port))) as sock:
        for _ in range(count):
            sock.sendall(data)
        sock.recv(1)
    return 0


def socket_gbps(size: int, total: int, arena_bytes: int = 0) -> tuple[float, float]:
    """Blocking sockets between two processes, receiver uses recv_into a preallocated buffer
    (with ``arena_bytes``: into successive buffers across an arena that large, which is what a
    store does with its slab and costs cache misses a single reused buffer never has).
    Returns (GB/s, CPU seconds per GB of both processes together)."""
    count = max(16, total // size)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-m", "mooncake_lite.bench.store.limits",
                                   f"127.0.0.1:{port}", str(size), str(count)])
        conn, _ = listener.accept()
    num_bufs = max(1, arena_bytes // size)
    arena = mmap.mmap(-1, num_bufs * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    with conn:  # the arena is unmapped when its last view goes
        bufs = [memoryview(arena)[i * size:(i + 1) * size] for i in range(num_bufs)]
        sender_cpu0 = process_cpu(sender.pid)
        start, cpu0 = time.perf_counter(), time.process_time()
        for i in range(count):
            buf = bufs[i % num_bufs]
            got = 0
            while got < size:
                n = conn.recv_into(buf[got:])
                if not n:
                    raise ConnectionError("socket sender stopped early")
                got += n
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
        cpu += process_cpu(sender.pid) - sender_cpu0
        conn.sendall(b"k")
    sender.wait(30)
    gb = count * size / 1e9
    return gb / elapsed, cpu / gb


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":   # the sending end of socket_gbps: HOST:PORT SIZE COUNT
    sys.exit(socket_sender(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
