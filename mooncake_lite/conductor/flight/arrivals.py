"""A burst placed together (``scheduler/arrivals.py``, the rule shared with the simulator): a
request that arrives while every prefill instance has a job waits up to the window for the rest
of its burst, then the burst is placed shortest uncached first, so each one's prediction (and
admission) already knows the others.

Order: the window's end resolves the held requests' futures in the decision order, so their
tasks wake in that order (asyncio runs ready callbacks first in, first out), and each places
itself before its first await (``Flight.start`` → ``placement.place`` is synchronous): the burst
reaches the scheduler in the decision order with nothing between its members. A request whose
client left while held is skipped (its future is cancelled). A callback queued after theirs runs
once all have placed: ``on_placed`` gets the members in the decision order, to price each one's
forward as the burst left it (``scheduler.arrivals.burst_shifts``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from mooncake_lite.scheduler import ClusterState, PrefillCostModel
from mooncake_lite.scheduler.arrivals import burst_shifts, decision_order, holds


class Arrivals:
    """The conductor's burst window (``--burst-window``; 0: every request placed as it comes)."""

    def __init__(self, window_s: float, on_placed: Callable[[Sequence[Any]], None] | None = None) -> None:
        self.window_s = window_s
        self.on_placed = on_placed
        self._held: list[tuple[Callable[[], int], asyncio.Future, Any]] = []

    async def turn(self, cluster: Callable[[], ClusterState], uncached: Callable[[], int],
                   member: Any = None) -> None:
        """Return when this request may be placed: at once, or when its burst's window closes.
        ``cluster``: the snapshot (read only when a window could open); ``uncached``: its
        ordering key (``scheduler.arrivals.uncached_now``), read at the window's end; ``member``:
        what ``on_placed`` is given for it (its flight)."""
        if self.window_s <= 0 or (not self._held and not holds(cluster(), self.window_s)):
            return
        loop = asyncio.get_running_loop()
        if not self._held:
            loop.call_later(self.window_s, self._release)
        done = loop.create_future()
        self._held.append((uncached, done, member))
        await done

    def _release(self) -> None:
        burst, self._held = self._held, []
        order = [i for i in decision_order([key() for key, _, _ in burst]) if not burst[i][1].done()]
        for i in order:
            burst[i][1].set_result(None)
        if self.on_placed is not None and len(order) > 1:
            asyncio.get_running_loop().call_soon(self.on_placed, [burst[i][2] for i in order])


def reprice(flights: Sequence[Any], membership: Any, default: Callable[[], PrefillCostModel]) -> None:
    """Each placed member's prediction with its forward as its burst left it
    (``scheduler.arrivals.burst_shifts``, on the model each view shows; ``default``: an instance's
    that reported none): its TTFT and own prefill (the forward it runs in) move by the shift, so
    the check and the correction see that forward whole, and the join share learns only joiners
    the burst did not show. ``flights``: the burst in the decision order."""
    placed = [(f.request_id, f.decision.prefill_id)
              for f in flights if f.prediction is not None and f.decision is not None and f.decision.prefill_id]

    def queue(pid: str) -> tuple[Sequence, int, PrefillCostModel]:
        inst = membership.get(pid)
        if inst is None:
            return (), 0, default()
        state = inst.view.state()
        return state.queue, inst.reg.pack_tokens, state.cost or default()
    shifts = burst_shifts(placed, queue)
    for f in flights:
        if (shift := shifts.get(f.request_id)) is not None:
            p = f.prediction
            f.prediction = replace(p, ttft_s=p.ttft_s + shift, prefill_s=max(p.prefill_s + shift, 0.0))
