"""A burst placed together (``scheduler/arrivals.py``, the rule shared with the simulator): a
request that arrives while every prefill instance has a job waits up to the window for the rest
of its burst, then the burst is placed shortest uncached first, so each one's prediction (and
admission) already knows the others.

Order: the window's end resolves the held requests' futures in the decision order, so their
tasks wake in that order (asyncio runs ready callbacks first in, first out), and each places
itself before its first await (``Flight.start`` → ``placement.place`` is synchronous): the burst
reaches the scheduler in the decision order with nothing between its members. A request whose
client left while held is skipped (its future is cancelled)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mooncake_lite.scheduler import ClusterState
from mooncake_lite.scheduler.arrivals import decision_order, holds


class Arrivals:
    """The conductor's burst window (``--burst-window``; 0: every request placed as it comes)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._held: list[tuple[Callable[[], int], asyncio.Future]] = []

    async def turn(self, cluster: Callable[[], ClusterState], uncached: Callable[[], int]) -> None:
        """Return when this request may be placed: at once, or when its burst's window closes.
        ``cluster``: the snapshot (read only when a window could open); ``uncached``: its
        ordering key (``scheduler.arrivals.uncached_now``), read at the window's end."""
        if self.window_s <= 0 or (not self._held and not holds(cluster(), self.window_s)):
            return
        loop = asyncio.get_running_loop()
        if not self._held:
            loop.call_later(self.window_s, self._release)
        done = loop.create_future()
        self._held.append((uncached, done))
        await done

    def _release(self) -> None:
        burst, self._held = self._held, []
        for i in decision_order([key() for key, _ in burst]):
            if not burst[i][1].done():
                burst[i][1].set_result(None)
