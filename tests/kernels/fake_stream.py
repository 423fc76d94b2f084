"""A CPU stand-in for a CUDA copy stream: copies queue up and run (completing their events, in
order) only when the test says so, so the copier's ordering and buffer reuse can be checked
without a GPU."""

from __future__ import annotations

import threading
from collections import deque

import torch


class FakeEvent:
    def __init__(self):
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(timeout=10.0):   # a test that forgot to run the stream fails, not hangs
            raise TimeoutError("fake copy never ran")

    def complete(self) -> None:
        self._done.set()


class FakeBackend:
    """Copies are queued, not run; :meth:`run` executes the oldest ``n`` in stream order."""
    pin = False

    def __init__(self):
        self.queue: deque[tuple[callable, FakeEvent]] = deque()
        self.waited_on_compute: list[FakeEvent] = []
        self.num_copies = 0
        self._lock = threading.Lock()

    def _enqueue(self, copy) -> FakeEvent:
        event = FakeEvent()
        with self._lock:
            self.queue.append((copy, event))
            self.num_copies += 1
        return event

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> FakeEvent:
        src = src.clone()   # what the source held when the copy was queued (stream order)
        return self._enqueue(lambda: dst.copy_(src))

    def copy_to_device(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, FakeEvent]:
        dst = torch.full(src.shape, float("nan"), dtype=src.dtype)
        return dst, self._enqueue(lambda: dst.copy_(src))   # reads the staging buffer when it runs

    def wait_on_compute(self, tensor: torch.Tensor, event: FakeEvent) -> None:
        self.waited_on_compute.append(event)

    def run(self, n: int | None = None) -> int:
        """Run the oldest ``n`` queued copies (all if None); returns how many ran."""
        ran = 0
        while self.queue and (n is None or ran < n):
            with self._lock:
                copy, event = self.queue.popleft()
            copy()
            event.complete()
            ran += 1
        return ran
