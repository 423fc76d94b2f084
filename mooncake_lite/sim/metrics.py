"""Figures of a run: TTFT/TBT distributions, rejections, SLO attainment, goodput, sim speed."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lite.sim.recorder import SimResult
from mooncake_lite.sim.request import RequestResult


def quantile(sorted_vals: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of already sorted values (None when empty)."""
    if not sorted_vals:
        return None
    return float(sorted_vals[min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))])


def meets_slo(r: RequestResult, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    """Completed with TTFT and TBT (mean of the slowest 10% of gaps) within the SLOs."""
    return (r.status == "completed" and r.ttft is not None and r.ttft <= ttft_slo_s
            and (r.tbt is None or r.tbt <= tbt_slo_s))


def slo_attainment(requests: Sequence[RequestResult], ttft_slo_s: float, tbt_slo_s: float) -> float:
    """Share of *all* requests (rejected ones count as misses) that met both SLOs."""
    if not requests:
        return 0.0
    return sum(meets_slo(r, ttft_slo_s, tbt_slo_s) for r in requests) / len(requests)


def _dist(values: list[float]) -> dict[str, float | None]:
    values.sort()
    return {"mean": sum(values) / len(values) if values else None, "p50": quantile(values, 0.5),
            "p90": quantile(values, 0.9), "p99": quantile(values, 0.99), "max": values[-1] if values else None}


def summarize(res: SimResult, ttft_slo_s: float | None, tbt_slo_s: float | None,
              limits: Callable[[int], tuple[float, float]] | None = None) -> dict[str, Any]:
    """One flat-ish dict of the headline figures of a run. Relative SLOs (None): each request is
    judged by ``limits(its prompt tokens)`` (``MooncakeSim.slo_limits``)."""
    reqs = res.requests
    done = [r for r in reqs if r.status == "completed"]
    rejected = Counter(f"{r.reject_stage}:{r.reject_cause}" for r in reqs if r.status == "rejected")
    duration = max(res.duration_s, 1e-9)
    if ttft_slo_s is None or tbt_slo_s is None:
        if limits is None:
            raise ValueError("relative SLOs need each request's limits (MooncakeSim.slo_limits)")
        good = sum(meets_slo(r, *limits(r.input_length)) for r in reqs)
    else:
        good = sum(meets_slo(r, ttft_slo_s, tbt_slo_s) for r in reqs)
    input_tokens = sum(r.input_length for r in done)
    return {
        "system": res.system,
        "num_requests": len(reqs),
        "completed": len(done),
        "rejected": sum(rejected.values()),
        "rejected_by": dict(sorted(rejected.items())),
        "wasted_prefills": rejected.get("decode:tbt", 0),
        "ttft_s": _dist([r.ttft for r in done if r.ttft is not None]),
        "tbt_s": _dist([r.tbt for r in done if r.tbt is not None]),
        "slo": {"ttft_s": ttft_slo_s, "tbt_s": tbt_slo_s},
        "slo_attainment": good / len(reqs) if reqs else 0.0,
        "goodput_rps": good / duration,
        "throughput_rps": len(done) / duration,
        "reused_token_share": sum(r.reused_tokens for r in done) / input_tokens if input_tokens else 0.0,
        "simulated_s": res.duration_s,
        "wall_s": res.wall_s,
        "requests_per_wall_s": len(reqs) / res.wall_s if res.wall_s > 0 else None,
        "cpu_s": res.extra.get("cpu_s"),
        "num_events": res.num_events,
        "counters": res.counters,
    }


class QuantileSketch:
    """Quantiles of a stream of positive values in bounded memory: a histogram of logarithmic
    buckets each ``relative_error`` wide (about 460 buckets per factor 100 at 1%), so a
    quantile is within ``relative_error`` of the nearest-rank value :func:`quantile` gives.
    Mean and max are exact. Zero and negative values count in one bucket of their own, as 0."""

    def __init__(self, relative_error: float = 0.005) -> None:
        if not 0.0 < relative_error < 1.0:
            raise ValueError(f"relative_error must be in (0, 1), got {relative_error}")
        self._gamma = (1.0 + relative_error) / (1.0 - relative_error)
        self._log_gamma = math.log(self._gamma)
        self._counts: Counter[int | None] = Counter()   # bucket -> count (None: values <= 0)
        self.count, self.total = 0, 0.0
        self.max: float | None = None

    def add(self, value: float) -> None:
        self._counts[math.ceil(math.log(value) / self._log_gamma) if value > 0.0 else None] += 1
        self.count += 1
        self.total += value
        self.max = value if self.max is None or value > self.max else self.max

    def quantile(self, q: float) -> float | None:
        """Nearest rank, as :func:`quantile`: the bucket holding that rank, at its midpoint."""
        top = self.max
        if not self.count or top is None:
            return None
        rank = min(self.count, max(1, math.ceil(q * self.count)))
        if rank == self.count:
            return top
        seen = self._counts.get(None, 0)
        if seen >= rank:
            return 0.0
        for bucket in sorted(k for k in self._counts if k is not None):
            seen += self._counts[bucket]
            if seen >= rank:   # the bucket (gamma^(b-1), gamma^b]: its midpoint errs < relative_error
                return min(2.0 * self._gamma ** bucket / (self._gamma + 1.0), top)
        return top

    def summary(self) -> dict[str, float | None]:
        """What :func:`summarize` reports of a distribution."""
        return {"mean": self.total / self.count if self.count else None, "p50": self.quantile(0.5),
                "p90": self.quantile(0.9), "p99": self.quantile(0.99), "max": self.max}


class StreamingSummary:
    """:func:`summarize` of a run whose results are not kept: the recorder's ``sink`` (one
    :class:`RequestResult` at a time), then :meth:`summarize`. The same figures, with TTFT and
    TBT quantiles from :class:`QuantileSketch` (within its relative error); memory does not grow
    with the number of requests."""

    def __init__(self, ttft_slo_s: float, tbt_slo_s: float, relative_error: float = 0.005) -> None:
        self.ttft_slo_s, self.tbt_slo_s = ttft_slo_s, tbt_slo_s
        self.ttft, self.tbt = QuantileSketch(relative_error), QuantileSketch(relative_error)
        self.rejected: Counter[str] = Counter()
        self.count = self.completed = self.good = self.input_tokens = self.reused_tokens = 0

    def add(self, r: RequestResult) -> None:
        self.count += 1
        if r.status == "rejected":
            self.rejected[f"{r.reject_stage}:{r.reject_cause}"] += 1
        if meets_slo(r, self.ttft_slo_s, self.tbt_slo_s):
            self.good += 1
        if r.status != "completed":
            return
        self.completed += 1
        self.input_tokens += r.input_length
        self.reused_tokens += r.reused_tokens
        if r.ttft is not None:
            self.ttft.add(r.ttft)
        if r.tbt is not None:
            self.tbt.add(r.tbt)

    def summarize(self, res: SimResult) -> dict[str, Any]:
        """The dict :func:`summarize` returns, for the run ``res`` this summary was the sink of."""
        duration = max(res.duration_s, 1e-9)
        return {
            "system": res.system, "num_requests": self.count, "completed": self.completed,
            "rejected": sum(self.rejected.values()), "rejected_by": dict(sorted(self.rejected.items())),
            "wasted_prefills": self.rejected.get("decode:tbt", 0),
            "ttft_s": self.ttft.summary(), "tbt_s": self.tbt.summary(),
            "slo": {"ttft_s": self.ttft_slo_s, "tbt_s": self.tbt_slo_s},
            "slo_attainment": self.good / self.count if self.count else 0.0,
            "goodput_rps": self.good / duration, "throughput_rps": self.completed / duration,
            "reused_token_share": self.reused_tokens / self.input_tokens if self.input_tokens else 0.0,
            "simulated_s": res.duration_s, "wall_s": res.wall_s,
            "requests_per_wall_s": self.count / res.wall_s if res.wall_s > 0 else None,
            "cpu_s": res.extra.get("cpu_s"), "num_events": res.num_events, "counters": res.counters,
        }


def format_summary(rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """A terminal table, one row per summarized run."""
    head = f"{'system':<24}{'done':>7}{'rej':>7}{'TTFT avg':>10}{'TTFT p90':>10}{'TBT avg':>11}{'TBT p90':>11}{'SLO ok':>8}{'req/wall-s':>12}"
    lines = [title, head, "-" * len(head)] if title else [head, "-" * len(head)]

    def f(v: float | None, unit: str = "s", scale: float = 1.0) -> str:
        return "-" if v is None else f"{v * scale:.2f}{unit}"

    for s in rows:
        name = s.get("label", s["system"])
        lines.append(f"{name:<24}{s['completed']:>7}{s['rejected']:>7}{f(s['ttft_s']['mean']):>10}"
                     f"{f(s['ttft_s']['p90']):>10}{f(s['tbt_s']['mean'], 'ms', 1e3):>11}"
                     f"{f(s['tbt_s']['p90'], 'ms', 1e3):>11}{s['slo_attainment']:>8.1%}"
                     f"{(s['requests_per_wall_s'] or 0):>12,.0f}")
    return "\n".join(lines)
