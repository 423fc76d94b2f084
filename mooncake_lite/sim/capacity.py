"""Effective request capacity: the highest replay speed at which a system still serves
``target`` of all requests within TTFT and TBT SLOs (rejections count as misses), found by
bisection on the trace's time-scale factor.

A probe stops as soon as more than ``1 − target`` of the requests have missed the *loosest*
TBT threshold asked for (it has failed them all). A completed probe answers every threshold at
once, so systems whose behaviour does not depend on the threshold (the colocated baseline)
share probes between thresholds through :class:`ProbeCache`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mooncake_lite.sim.metrics import slo_attainment
from mooncake_lite.sim.request import SimRequest
from mooncake_lite.trace.format import TraceRequest, scale_time

# Builds a fresh simulator for one probe; returns an object with .recorder and .run(trace).
SimFactory = Callable[[], object]


@dataclass
class CapacityResult:
    system: str
    tbt_slo_s: float
    speed: float                       # highest passing speed found (0 if even the lowest fails)
    probes: list[tuple[float, float]] = field(default_factory=list)  # (speed, attainment)


def _is_miss(ttft_slo_s: float, tbt_slo_s: float) -> Callable[[SimRequest], bool]:
    def miss(r: SimRequest) -> bool:
        if r.status != "completed":
            return True
        return (r.first_token - r.arrival) > ttft_slo_s or (r.tbt is not None and r.tbt > tbt_slo_s)
    return miss


def probe(factory: SimFactory, trace: Sequence[TraceRequest], speed: float, ttft_slo_s: float,
          tbt_slos: Sequence[float], target: float) -> dict[float, float]:
    """SLO attainment per TBT threshold at ``speed`` (below ``target`` for all when abandoned)."""
    sim = factory()
    sim.recorder.abort_after_misses(_is_miss(ttft_slo_s, max(tbt_slos)), int((1 - target) * len(trace)))
    res = sim.run(scale_time(trace, speed))
    out = {t: slo_attainment(res.requests, ttft_slo_s, t) * len(res.requests) / len(trace) for t in tbt_slos}
    if res.extra.get("aborted"):
        out = {t: min(target - 1e-9, a) for t, a in out.items()}
    return out


class ProbeCache:
    """Memoised probes of one system for several thresholds at once."""

    def __init__(self, factory: SimFactory, trace: Sequence[TraceRequest], ttft_slo_s: float,
                 tbt_slos: Sequence[float], target: float, on_probe: Callable[[], None] | None = None) -> None:
        self.factory, self.trace, self.ttft_slo_s = factory, trace, ttft_slo_s
        self.tbt_slos, self.target, self.on_probe = list(tbt_slos), target, on_probe
        self._memo: dict[float, dict[float, float]] = {}

    def attainment(self, speed: float, tbt_slo_s: float) -> float:
        if speed not in self._memo:
            self._memo[speed] = probe(self.factory, self.trace, speed, self.ttft_slo_s, self.tbt_slos, self.target)
            if self.on_probe is not None:
                self.on_probe()
        return self._memo[speed][tbt_slo_s]

    @property
    def num_probes(self) -> int:
        return len(self._memo)


def find_capacity(system: str, probes: ProbeCache, tbt_slo_s: float, start: float = 1.0,
                  iterations: int = 3, min_speed: float = 1 / 64, max_speed: float = 64.0) -> CapacityResult:
    """Bracket by doubling/halving from ``start`` (powers of two, so systems sharing a
    ProbeCache reuse probes across thresholds), then bisect the bracket in log space
    ``iterations`` times (3 → within 9%). Assumes attainment falls with speed. Speed 0 means even
    ``min_speed`` fails; ``max_speed`` means it still passes there."""
    out = CapacityResult(system, tbt_slo_s, 0.0)

    def ok(speed: float) -> bool:
        att = probes.attainment(speed, tbt_slo_s)
        out.probes.append((speed, att))
        return att >= probes.target

    if ok(start):
        lo = start
        while lo * 2 <= max_speed and ok(lo * 2):
            lo *= 2
        if lo * 2 > max_speed:
            out.speed = lo
            return out
        hi = lo * 2
    else:
        hi = start
        while hi / 2 >= min_speed and not ok(hi / 2):
            hi /= 2
        if hi / 2 < min_speed:
            return out
        lo = hi / 2
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    out.speed = lo
    return out
