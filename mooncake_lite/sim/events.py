"""The event queue: a heap ordered by (time, insertion order), so equal times stay FIFO and
runs are deterministic."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from heapq import heappush
from typing import Any

Handler = Callable[[float, Any], None]


class EventQueue:
    """``push(time, handler, payload)``; ``run()`` pops in time order and calls handlers,
    which may push more events. The clock never goes backwards."""

    __slots__ = ("_heap", "_seq", "now", "num_events", "stopped")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Handler, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.num_events = 0
        self.stopped = False

    def push(self, time: float, handler: Handler, payload: Any = None) -> None:
        if time < self.now:
            raise ValueError(f"event at {time} is in the past (now {self.now})")
        self._seq = seq = self._seq + 1
        heappush(self._heap, (time, seq, handler, payload))

    def run(self, until: float | None = None, on_step: Callable[[float], None] | None = None) -> None:
        heap = self._heap
        pop = heapq.heappop
        if until is None and on_step is None:
            return self._run_all()
        while heap and not self.stopped:
            if until is not None and heap[0][0] > until:
                break
            time, _, handler, payload = pop(heap)
            self.now = time
            self.num_events += 1
            handler(time, payload)
            if on_step is not None:
                on_step(time)

    def _run_all(self) -> None:
        """:meth:`run` with no limit and no callback (a whole simulation: millions of events),
        the count of events popped kept in a local and added once at the end."""
        heap, pop, n = self._heap, heapq.heappop, 0
        try:
            while heap and not self.stopped:
                time, _, handler, payload = pop(heap)
                self.now = time
                n += 1
                handler(time, payload)
        finally:
            self.num_events += n

    def is_next(self, time: float) -> bool:
        """Whether an event pushed now for ``time`` would run right after the current handler:
        nothing else is due by then (events at the same time run in the order pushed)."""
        return not self._heap or self._heap[0][0] > time

    def run_next(self, handler: Handler, payload: Any = None) -> None:
        """Run, at the end of the current handler, the event it would have pushed for ``now``
        after checking :meth:`is_next` (nothing pushed since can run before it: it would come
        later at the same time), without the heap; as :meth:`push` once the queue is stopped.
        Counted in ``num_events``; a ``run(on_step=...)`` callback is not called for it."""
        if self.stopped:
            self.push(self.now, handler, payload)
            return
        self.num_events += 1
        handler(self.now, payload)

    def stop(self) -> None:
        """End ``run()`` after the current event (used to abandon hopeless capacity probes)."""
        self.stopped = True

    def __len__(self) -> int:
        return len(self._heap)
