"""KV copies between the device and the host that overlap compute by construction.

On CUDA a ``.cpu()`` per layer stalls the host until the copy (and everything queued before it)
is done, so the next layer cannot be launched meanwhile. Here each copy instead runs on the
copier's own CUDA stream, into or out of a pinned staging buffer from a reusable pool, and is
recorded with an event; the caller gets a :class:`Staged` at once and awaits its event off the
event loop (:meth:`Staged.ready`, one waiter thread) while the next layer computes.

* device → host (:meth:`Copier.to_host`): the copy stream first waits for the compute stream
  (the source was produced there), and the source is marked used by the copy stream so the
  caching allocator does not hand its memory out before the copy has read it.
* host → device (:meth:`Copier.to_device`): the bytes go into a pinned buffer (a host memcpy),
  then to a fresh device tensor on the copy stream; :meth:`Copier.use` makes the compute stream
  wait for that copy before a kernel reads the tensor.
* buffer reuse: a buffer returns to the pool with its copy's event and goes out again only
  once that event has completed (and, for device → host, once the caller released it: the
  bytes may still be on their way out of a socket until then).

Off CUDA the same API passes tensors through (no copy, no event, always ready), so the code
that uses it runs the same path on every device. The stream work sits behind a small backend
(:class:`CudaBackend`); tests drive the pool and the ordering on CPU with a fake one.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

MIN_BUFFER_BYTES = 4096
MAX_IDLE_BYTES = 256 << 20   # idle staging memory kept for reuse; beyond it buffers are freed


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Backend(Protocol):
    """Where the copies run: ``pin`` says whether staging buffers are pinned."""
    pin: bool

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Event: ...
    def copy_to_device(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Event]: ...
    def wait_on_compute(self, tensor: torch.Tensor, event: Event) -> None: ...


def _size_class(nbytes: int) -> int:
    """Buffers come in powers of two, so chunks of varying lengths reuse each other's buffers."""
    return max(MIN_BUFFER_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())


def _is_done(event: Event | None) -> bool:
    return event is None or event.query()


class StagingPool:
    """Host buffers by size class; one given back is reused only once its event has completed.
    Thread-safe: buffers are taken in the compute thread and given back on the event loop."""

    def __init__(self, *, pin: bool, max_idle_bytes: int = MAX_IDLE_BYTES):
        self.pin = pin
        self._lock = threading.Lock()
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, deque[tuple[torch.Tensor, Event | None]]] = {}
        self.idle_bytes = 0
        self.num_allocated = 0   # buffers ever allocated (a pool that works keeps this flat)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` whose last copy (if any) has completed."""
        size = _size_class(nbytes)
        with self._lock:
            idle = self._idle.get(size, ())
            for i, (buf, event) in enumerate(idle):
                if _is_done(event):
                    del idle[i]
                    self.idle_bytes -= size
                    return buf
            self.num_allocated += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, event: Event | None) -> None:
        """Return ``buf``; ``event`` (its last copy) must complete before it goes out again."""
        size = buf.numel()
        with self._lock:
            self._idle.setdefault(size, deque()).append((buf, event))
            self.idle_bytes += size
            while self.idle_bytes > self.max_idle_bytes:   # free from the class holding the most bytes
                largest = max(self._idle, key=lambda s: len(self._idle[s]) * s)
                self._idle[largest].popleft()
                self.idle_bytes -= largest
                if not self._idle[largest]:
                    del self._idle[largest]


class Staged:
    """One copy: ``tensor`` holds its result once :meth:`ready` returns (at once off CUDA)."""

    def __init__(self, tensor: torch.Tensor, event: Event | None = None, buf: torch.Tensor | None = None,
                 pool: StagingPool | None = None, waiter: ThreadPoolExecutor | None = None):
        self.tensor = tensor
        self.event = event
        self._buf, self._pool, self._waiter = buf, pool, waiter

    def is_ready(self) -> bool:
        return _is_done(self.event)

    @property
    def is_plain(self) -> bool:
        """A pass-through (off CUDA): ``tensor`` is ordinary memory, ready, owing the pool nothing."""
        return self.event is None and self._buf is None

    def wait(self) -> None:
        """Block this thread until the copy has completed."""
        if self.event is not None:
            self.event.synchronize()

    async def ready(self) -> None:
        """Wait for the copy without blocking the event loop (in the copier's waiter thread)."""
        if not self.is_ready():
            await asyncio.get_running_loop().run_in_executor(self._waiter, self.wait)

    def release(self) -> None:
        """Done with ``tensor``: its buffer may go out again once the copy's event completed."""
        if self._buf is not None:
            self._pool.give(self._buf, self.event)
            self._buf = None

    def discard(self) -> None:
        """Never reuse the buffer (something may still read it, e.g. a write cut short)."""
        self._buf = None


class Copier:
    """Device ↔ host KV copies for one device: a copy stream and a staging pool on CUDA,
    pass-through elsewhere. ``backend`` replaces the CUDA one (tests)."""

    def __init__(self, device: torch.device | str, *, backend: Backend | None = None,
                 max_idle_bytes: int = MAX_IDLE_BYTES):
        self.device = torch.device(device)
        if backend is None and self.device.type == "cuda":
            backend = CudaBackend(self.device)
        self.backend = backend
        self.pool = StagingPool(pin=backend.pin, max_idle_bytes=max_idle_bytes) if backend else None
        self._waiter: ThreadPoolExecutor | None = None

    @property
    def waiter(self) -> ThreadPoolExecutor:
        # One thread: events complete in stream order, so waits finish (and frames go out) in order.
        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy-wait")
        return self._waiter

    def to_host(self, src: torch.Tensor) -> Staged:
        """Start copying ``src`` to contiguous host memory; call ``release`` when done with it."""
        if self.backend is None:
            return Staged(src.contiguous() if src.device.type == "cpu" else src.cpu())
        buf = self.pool.take(src.numel() * src.element_size())
        dst = buf[:src.numel() * src.element_size()].view(src.dtype).view(src.shape)
        event = self.backend.copy_to_host(dst, src)
        return Staged(dst, event, buf, self.pool, self.waiter)

    def to_device(self, src: torch.Tensor) -> Staged:
        """Start copying host ``src`` to the device; read the result through :meth:`use`."""
        if self.backend is None:
            return Staged(src.to(self.device))
        nbytes = src.numel() * src.element_size()
        buf = self.pool.take(nbytes)
        staging = buf[:nbytes].view(src.dtype).view(src.shape)
        staging.copy_(src)   # a host memcpy into pinned memory; the device copy then runs async
        dst, event = self.backend.copy_to_device(staging, self.device)
        self.pool.give(buf, event)   # reused only once the device copy has read it
        return Staged(dst, event, waiter=self.waiter)

    def use(self, staged: Staged) -> torch.Tensor:
        """``staged.tensor``, with kernels queued after this on the compute stream ordered after
        its copy (no host wait)."""
        if self.backend is not None and staged.event is not None:
            self.backend.wait_on_compute(staged.tensor, staged.event)
        return staged.tensor

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
            self._waiter = None


class CudaBackend:
    """Copies on a dedicated CUDA stream, pinned staging buffers, one event per copy."""
    pin = True

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))   # src is written on compute
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        src.record_stream(self.stream)   # its memory is not reused until the copy has read it
        return event

    def copy_to_device(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            dst = torch.empty(src.shape, dtype=src.dtype, device=device)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return dst, event

    def wait_on_compute(self, tensor: torch.Tensor, event: torch.cuda.Event) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        tensor.record_stream(compute)   # allocated on the copy stream, read on compute
