"""Effective request capacity: the highest replay speed at which a system still serves
``target`` of all requests within TTFT and TBT SLOs (rejections count as misses), found by
bisection on the trace's time-scale factor. Hopeless probes stop early (see Recorder)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mooncake_lite.sim.metrics import slo_attainment
from mooncake_lite.sim.recorder import SimResult
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
          tbt_slo_s: float, target: float) -> float:
    """SLO attainment at ``speed`` (a lower bound when the probe was abandoned as failing)."""
    sim = factory()
    sim.recorder.abort_after_misses(_is_miss(ttft_slo_s, tbt_slo_s), int((1 - target) * len(trace)))
    res: SimResult = sim.run(scale_time(trace, speed))
    if res.extra.get("aborted"):
        return min(target - 1e-9, slo_attainment(res.requests, ttft_slo_s, tbt_slo_s))
    return slo_attainment(res.requests, ttft_slo_s, tbt_slo_s)


def find_capacity(system: str, factory: SimFactory, trace: Sequence[TraceRequest], ttft_slo_s: float,
                  tbt_slo_s: float, target: float = 0.9, lo: float = 0.125, hi: float = 8.0,
                  iterations: int = 6, on_probe: Callable[[], None] | None = None) -> CapacityResult:
    """Bisection in log space between ``lo`` and ``hi`` (assumes attainment falls with speed)."""
    out = CapacityResult(system, tbt_slo_s, 0.0)

    def ok(speed: float) -> bool:
        att = probe(factory, trace, speed, ttft_slo_s, tbt_slo_s, target)
        out.probes.append((speed, att))
        if on_probe is not None:
            on_probe()
        return att >= target

    if not ok(lo):
        return out
    if ok(hi):
        out.speed = hi
        return out
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    out.speed = lo
    return out
