"""Collects what happened in a run: one result per request (exactly once), load samples over
time, counters; and packs them into a :class:`SimResult`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mooncake_lite.sim.request import RequestResult, SimRequest


@dataclass
class SimResult:
    """Everything a run produced. ``requests`` is in request-id order."""

    system: str
    config: dict[str, Any]
    requests: list[RequestResult]
    timeline: list[dict[str, float]]
    counters: dict[str, int]
    wall_s: float
    num_events: int
    duration_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """``owner`` must offer ``events`` (EventQueue) and ``sample(now) -> dict`` for the load
    timeline, taken every ``interval_s`` of simulated time while requests are in flight."""

    def __init__(self, owner: Any, interval_s: float) -> None:
        self.owner = owner
        self.interval_s = interval_s
        self.results: dict[int, RequestResult] = {}
        self.timeline: list[dict[str, float]] = []
        self.counters = {"arrived": 0, "completed": 0, "rejected": 0, "migrations": 0, "migrated_blocks": 0}
        self._total: int | None = 0
        self._progress: Callable[[int], None] | None = None
        self._sampling = False
        self.miss_check: Callable[[SimRequest], bool] | None = None
        self.miss_budget = 0   # read only with miss_check set
        self._misses = 0
        self.aborted = False
        self.cpu_s = 0.0
        # Set: each result goes there and is not kept (a run of millions of requests stays
        # bounded in memory; the sink keeps what it needs, e.g. metrics.StreamingSummary).
        self.sink: Callable[[RequestResult], None] | None = None
        self.num_ended = 0
        self._last_end = 0.0

    def abort_after_misses(self, is_miss: Callable[[SimRequest], bool], budget: int) -> None:
        """Stop the run once more than ``budget`` ended requests satisfy ``is_miss`` (a capacity
        probe that already failed need not run to the end)."""
        self.miss_check, self.miss_budget = is_miss, budget

    def start(self, total: int | None, progress: Callable[[int], None] | None) -> None:
        """``total``: the trace's length (None: not known until :meth:`trace_ended`)."""
        self._total = total
        self._progress = progress
        if total is None or total:
            self._sampling = True
            self.owner.events.push(0.0, self._sample, None)

    def arrived(self) -> None:
        self.counters["arrived"] += 1

    def migrated(self, num_blocks: int) -> None:
        self.counters["migrations"] += 1
        self.counters["migrated_blocks"] += num_blocks

    def trace_ended(self, total: int) -> None:
        """The driver read the last request of a trace whose length it did not know."""
        self._total = total

    def ended(self, req: SimRequest) -> None:
        result = RequestResult.of(req)
        if self.sink is None:
            rid = req.request_id
            if rid in self.results:
                raise AssertionError(f"request {rid} ended twice ({self.results[rid].status}, then {req.status})")
            self.results[rid] = result
        else:
            self.sink(result)
            end = result.finish or result.arrival
            self._last_end = end if end > self._last_end else self._last_end
        status = req.status
        assert status is not None   # the request has ended
        self.counters[status] += 1
        self.num_ended = n = self.num_ended + 1
        if self.miss_check is not None and self.miss_check(req):
            self._misses += 1
            if self._misses > self.miss_budget and not self.aborted:
                self.aborted = True
                self.owner.events.stop()
        if self._progress is not None and (n % 256 == 0 or n == self._total):
            self._progress(n)

    def _sample(self, now: float, _: Any) -> None:
        row = {"t": now, "ended": float(self.num_ended), "rejected": float(self.counters["rejected"])}
        row.update(self.owner.sample(now))
        self.timeline.append(row)
        if self._total is None or self.num_ended < self._total:
            self.owner.events.push(now + self.interval_s, self._sample, None)

    def result(self, cfg: Any, hw: Any, wall_s: float, num_events: int, system: str = "mooncake") -> SimResult:
        from dataclasses import asdict, is_dataclass
        config = asdict(cfg) if is_dataclass(cfg) and not isinstance(cfg, type) else dict(cfg)
        config["hardware_model"] = hw.to_dict()
        reqs = [self.results[k] for k in sorted(self.results)]
        end = max((r.finish or r.arrival for r in reqs), default=self._last_end)
        return SimResult(system, config, reqs, self.timeline, dict(self.counters), wall_s, num_events, end,
                         extra={"aborted": self.aborted, "cpu_s": self.cpu_s})
