"""The machine's speed through the replay, measured: live's forwards and decode steps over the
exported model's price, their median in each third of the replay's time, and the slowest
stretch of consecutive forwards against the run's median.

Why: the simulator runs the whole slice on one exported model, the speed the corrections had
learned by the end. A shared VM is not that steady: on Zen 3 the same slice ran ~1.3x slower
from one hour to the next with no steal to show for it (docs/results/2026-12-01-zen3-admission.md
§19); on the Xeon one run's hour drifted within the run, its slice 22% slower than its own export
and fidelity's mean TTFT -22.4% (2026-12-04-xeon-2vcpu.md, 48c run 1).
Each run now says how far its own machine moved, so a figure missed in a drifting hour is seen
as that and not put on the scheduler. A ratio is relative to the end's model, so only the
parts' differences mean drift; a part whose work was of another kind (busier, longer prompts)
moves it too, which is why both roles are shown: the decode's steps are many and alike.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence

from mooncake_lite.bench.fidelity.anchored import SCALE_MAX_TOKENS, jobs_of
from mooncake_lite.instance.colocation import TIMELINE_LEN, padded_step

PARTS = 3
MIN_POINTS = 5          # a part with fewer forwards or steps shows no figure
DRIFT_NOTED = 0.15      # parts further apart than this (slowest over fastest − 1) are called drift
STRETCH = 5             # consecutive single-prompt forwards: a burst or two, ~15-30 s at --speed 0.2
STRETCH_NOTED = 1.25    # a stretch this much slower than the run's median is called out


def by_part(points: Sequence[tuple[float, float]], start_s: float, end_s: float,
            parts: int = PARTS) -> list[float | None]:
    """The median ratio of the (time, ratio) ``points`` in each of ``parts`` equal spans of
    [start_s, end_s]; None for a span with fewer than :data:`MIN_POINTS` (outside points ignored)."""
    span = (end_s - start_s) / parts
    buckets: list[list[float]] = [[] for _ in range(parts)]
    if span <= 0:
        return [None] * parts
    for at, ratio in points:
        if start_s <= at <= end_s:      # the end itself, and a float's last ulp, in the last part
            buckets[min(int((at - start_s) // span), parts - 1)].append(ratio)
    return [statistics.median(b) if len(b) >= MIN_POINTS else None for b in buckets]


def decode_points(timelines: Mapping[str, Mapping], step: Callable[[int, int, int], float]) -> list[tuple[float, float]]:
    """Each decode step's (start, measured / ``step(batch, context, longest)``), every decode's
    timeline (a step is ``(start, seconds, batch, context, waited, longest context)``)."""
    out = []
    for line in timelines.values():
        for s in line.get("steps") or ():
            start, seconds, batch, context, _, longest = s[:6]
            priced = step(batch, context, longest)
            if priced > 0:
                out.append((start, seconds / priced))
    return out


def complete_from(timelines: Mapping[str, Mapping]) -> float:
    """From when every decode's steps are all there: a role keeps its newest
    :data:`~mooncake_lite.instance.colocation.TIMELINE_LEN`, so a long replay's first steps are
    gone, and a forward then would read idle for want of them (-inf: none was cut)."""
    cut = [line["steps"][0][0] for line in timelines.values() if len(line.get("steps") or ()) >= TIMELINE_LEN]
    return max(cut, default=-math.inf)


def prefill_points(jobs: Sequence, price: Callable[[int, int, bool], float], busy: Callable[[float, float], bool],
                   max_tokens: int) -> list[tuple[float, float]]:
    """Each forward that held one prompt of at most ``max_tokens`` uncached alone (``anchored.Job``s,
    matched to forwards by first token): (start, measured / ``price(tokens, prefix, busy)``), the
    node state ``busy(start, end)``: a decode stepped during it. A longer prompt's matched forward
    is its last chunk only; a pack's price has parts a single prompt's has not; the weighed price
    of both states read the first of a burst (idle) at 0.72x where its idle price read 1.0x.

    The state is the one the forward ran in, where the live conductor learns each state's model
    by the one it predicted at placement (a job queued behind another, or a decode with
    requests); on three of session 50's replays the two differed for 0, 1 and 5 of 227 forwards."""
    per_forward: dict[tuple[str, float], list] = {}
    for j in jobs:
        per_forward.setdefault((j.node, j.end_s), []).append(j)
    return [(j.start_s, (j.end_s - j.start_s) / p) for js in per_forward.values()
            if len(js) == 1 and (j := js[0]).uncached <= max_tokens
            and (p := price(j.tokens, j.prefix, busy(j.start_s, j.end_s))) > 0]


def stepping(timelines: Mapping[str, Mapping]) -> Callable[[float, float], bool]:
    """Whether any decode step of ``timelines`` overlaps [start, end] (one box: ``mooncake up``'s)."""
    steps = sorted((s[0], s[0] + s[1]) for line in timelines.values() for s in line.get("steps") or ())
    starts = [a for a, _ in steps]
    longest = max((b - a for a, b in steps), default=0.0)

    def busy(start: float, end: float) -> bool:
        i = bisect_left(starts, start - longest)
        j = bisect_right(starts, end)
        return any(b > start for _, b in steps[i:j])
    return busy


def slowest_stretch(points: Sequence[tuple[float, float]], width: int = STRETCH) -> tuple[float, float] | None:
    """(the slowest median of ``width`` consecutive points over the median of all, around when):
    a slowdown of half a minute hides in a third's median (a run whose bursts at 45-60 s ran
    1.4x their price read 0.96 0.96 0.95 by thirds). None with fewer than 2 × ``width`` points."""
    if len(points) < 2 * width:
        return None
    ordered = sorted(points)
    ratios = [r for _, r in ordered]
    overall = statistics.median(ratios)
    if overall <= 0:
        return None
    medians = [statistics.median(ratios[i:i + width]) for i in range(len(ratios) - width + 1)]
    worst = max(medians)
    first = next(i for i, m in enumerate(medians) if m >= worst * (1 - 1e-9))
    # the middle of the first window that slow: about where the slowness begins
    return worst / overall, ordered[first + width // 2][0]


def spread(parts: Sequence[float | None]) -> float | None:
    """Slowest part over fastest, less 1 (None with fewer than two parts measured)."""
    shown = [p for p in parts if p is not None]
    return max(shown) / min(shown) - 1.0 if len(shown) >= 2 and min(shown) > 0 else None


def machine_drift(records: Sequence, tokens: Mapping[int, int], timelines: Mapping[str, Mapping], hw) -> dict:
    """Prefill and decode speed by third of the replay (from the first request sent to the last
    first token), each role's spread, and whether either passed :data:`DRIFT_NOTED`. A forward
    before the decodes' kept steps (:func:`complete_from`) is left out: its state is not known."""
    ok = [r for r in records if r.is_ok and r.request_id in tokens and r.chunk_s]
    if not ok:
        return {}
    start, end = min(r.send_s for r in ok), max(r.chunk_s[0] for r in ok)
    forwards = {url: t["forwards"] for url, t in timelines.items() if t.get("forwards")}
    served = [(r.request_id, r.send_s, r.chunk_s[0], tokens[r.request_id], r.cached_tokens or 0) for r in ok]
    jobs, _ = jobs_of(served, forwards)

    def price(num_tokens: int, prefix: int, busy: bool) -> float:
        return hw.in_state(busy).prefill.predict(num_tokens, prefix)

    def step(batch: int, context: int, longest: int) -> float:     # as the simulator prices a step
        return padded_step(hw.decode, batch, context, longest, hw.decode_padding_s_per_token)
    chunk = getattr(hw.prefill, "chunk", None) or SCALE_MAX_TOKENS     # a prompt within it: one forward
    known = complete_from(timelines)
    points = [p for p in prefill_points(jobs, price, stepping(timelines), chunk) if p[0] >= known]
    prefill = by_part(points, start, end)
    decode = by_part(decode_points(timelines, step), start, end)
    spreads = {"prefill": spread(prefill), "decode": spread(decode)}
    stretch = slowest_stretch(points)
    return {"prefill_by_part": prefill, "decode_by_part": decode,
            **{f"{role}_spread": s for role, s in spreads.items()},
            "drifted": any(s is not None and s > DRIFT_NOTED for s in spreads.values()),
            "prefill_slowest_stretch": None if stretch is None else stretch[0],
            "prefill_stretch_at_s": None if stretch is None else stretch[1] - start}


def drift_line(drift: Mapping) -> str | None:
    """The report's line: each role's median ratio by third, and the verdict."""
    if not drift:
        return None

    def shown(parts) -> str:
        return " ".join("—" if p is None else f"{p:.2f}" for p in parts)
    verdict = f"drifted (over {DRIFT_NOTED:.0%} apart): a figure here is the hour's as much as the scheduler's" \
        if drift["drifted"] else f"steady (within {DRIFT_NOTED:.0%})"
    line = (f"machine speed by third of the replay, live / exported model: prefill {shown(drift['prefill_by_part'])}, "
            f"decode {shown(drift['decode_by_part'])}; {verdict}")
    stretch = drift.get("prefill_slowest_stretch")
    if stretch is not None:
        called = " (a slow stretch: no one model of the run prices it)" if stretch > STRETCH_NOTED else ""
        line += (f"; slowest {STRETCH} forwards in a row {stretch:.2f}x the run's median, around "
                 f"{drift['prefill_stretch_at_s']:.0f} s{called}")
    return line
