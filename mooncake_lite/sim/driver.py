"""The trace-replay loop both simulated systems share (Mooncake and the colocated baseline).

Arrivals are pushed one at a time (each arrival pushes the next), so the event queue holds
only the events of requests in flight, not the whole trace, and the trace itself may be an
iterator read as the simulation goes (``trace.format.iter_trace``): with the recorder's
``sink`` set, a run's memory does not grow with its number of requests.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Sized

from mooncake_lite.sim.recorder import SimResult
from mooncake_lite.sim.request import SimRequest
from mooncake_lite.trace.format import TraceRequest


# Net allocations between two young-generation garbage collections during a run (Python's
# default: 700). A request's tuples, records and states form no cycles, so those collections
# find next to nothing; at the default they cost 2% of a request's instructions (callgrind,
# requests 1,000-3,000 of the 128P+128D scale trace).
GC_YOUNG_THRESHOLD = 20_000


class _young_collections_every:
    """Within the block, a young collection every ``n`` allocations (the process's thresholds
    restored after)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.saved = gc.get_threshold()
        gc.set_threshold(self.n, *self.saved[1:])

    def __exit__(self, *_) -> None:
        gc.set_threshold(*self.saved)


class TraceDriver:
    """Mixin: the subclass provides ``events``, ``recorder``, ``cfg``, ``hw``, ``block_size`` and
    ``_arrive(now, request)``, which places the request (the next arrival is already queued)."""

    system = "mooncake"   # label of the results

    def _push_next_arrival(self) -> None:
        tr = next(self._trace, None)
        if tr is None:
            if self._total is None:
                self.recorder.trace_ended(self._next)
            return
        self._next += 1
        self.events.push(tr.arrival_s, self._on_arrival, SimRequest(tr, self.block_size))

    def _on_arrival(self, now: float, req: SimRequest) -> None:
        self.recorder.arrived()
        self._push_next_arrival()
        self._arrive(now, req)

    def _arrive(self, now: float, req: SimRequest) -> None:
        raise NotImplementedError

    def run(self, trace: Iterable[TraceRequest], progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate ``trace`` (in arrival order; a sequence or an iterator read as the run goes)
        to the end; ``progress(n)`` is called with the number of requests ended so far, now and
        then."""
        if self.events.num_events:
            raise RuntimeError(f"a {type(self).__name__} runs once; build a new one")
        self._total = len(trace) if isinstance(trace, Sized) else None
        self._trace, self._next = iter(trace), 0
        self.recorder.start(self._total, progress)
        wall, cpu = time.perf_counter(), time.process_time()
        self._push_next_arrival()
        with _young_collections_every(GC_YOUNG_THRESHOLD):
            self.events.run()
        self.recorder.cpu_s = time.process_time() - cpu
        return self.recorder.result(self.cfg, self.hw, time.perf_counter() - wall, self.events.num_events,
                                    system=self.system)
