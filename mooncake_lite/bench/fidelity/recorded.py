"""A refused request's turn read off the instance's own record of its waiting list
(``scheduler/waiting.py``, ``GET /v1/timeline``'s ``turns``): where it would have landed among the
jobs the instance really had, and when its turn would have come, each job's overtakes as the
instance counted them. ``anchored.py`` guesses that order from the client's send times (kept for a
timeline without a record); its worst guess was whether a long job's burst-mates that ran before it
had passed it or were placed before it (docs/results/2026-12-01-zen3-admission.md §5).

The record names a job by the conductor's request id, which the client saw as the completion's
``id`` (a retry's or a continuation's attempt adds ``-retryN`` / ``-contN``). A refused request was
never sent on; where it would have landed:

- after the request the conductor placed last before it: a refusal's ``X-Mooncake-Placed`` is how
  many the conductor had placed, an admitted request's its own number, so it lands just behind the
  landing of the admitted request of that number (on another instance: at that landing's time).
  That is the conductor's own order, its bursts and their shortest-first placing included, where a
  guess from send times missed a burst the conductor took in two (a busy box accepts a burst's
  HTTP requests over more than the window);
- without those numbers (an older conductor) or that request in no record: at its send time plus
  the median lag from an admitted request's send to its landing, its burst (the sends within the
  conductor's burst window either side of it) placed shortest first: just before the first
  member longer than it landed, else after the last shorter one;
- its forward starts after its turn by the median lag from a turn to the next forward's start.

What it would have done to the others (delayed them, joined a pack) is not its own TTFT and is
left out, as in ``anchored.py``.
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import chain

from mooncake_lite.scheduler.waiting import GRANT, LAND, Added, replay

_ATTEMPT = re.compile(r"-(retry|cont)\d+.*$")


def landed(events: Sequence[Sequence], ids: Mapping[str, int]) -> dict[int, tuple[int, float, int]]:
    """Each client request (by ``ids``: completion id → client id) the record saw land first:
    (event index, time, uncached tokens)."""
    out: dict[int, tuple[int, float, int]] = {}
    for i, (t, kind, rid, uncached, *_) in enumerate(events):
        if kind == LAND and (cid := ids.get(_ATTEMPT.sub("", rid))) is not None and cid not in out:
            out[cid] = (i, t, uncached)
    return out


def arrival_lag(land: Mapping[int, tuple[int, float, int]], sends: Mapping[int, float]) -> float | None:
    """The median from a request's send to its landing (None: none matched)."""
    lags = [t - sends[cid] for cid, (_, t, _) in land.items() if cid in sends]
    return statistics.median(lags) if lags else None


def turn_lead(events: Sequence[Sequence], forwards: Sequence[Sequence[float]]) -> float:
    """The median from a turn to the start of the next forward (0 without either)."""
    starts = sorted(f[0] for f in forwards)
    leads = []
    for t, kind, *_ in events:
        if kind == GRANT and (i := bisect_left(starts, t)) < len(starts):
            leads.append(starts[i] - t)
    return statistics.median(leads) if leads else 0.0


def placed(events: Sequence[Sequence], land: Mapping[int, tuple[int, float, int]], sends: Mapping[int, float],
           send_s: float, uncached: int, lag: float, window_s: float) -> Added:
    """Where a request of ``uncached`` tokens sent at ``send_s`` would have landed (module doc)."""
    burst = [(i, t, n, sends[cid]) for cid, (i, t, n) in land.items()
             if cid in sends and abs(sends[cid] - send_s) <= window_s]
    longer = [(i, t) for i, t, n, s in burst if (n, s) > (uncached, send_s)]
    if longer:
        i, t = min(longer)
        return Added(t, uncached, i)
    at = Added(send_s + lag, uncached)
    shorter = [(i, t) for i, t, n, s in burst if (n, s) < (uncached, send_s)]
    if not shorter:
        return at
    i, t = max(shorter)
    return Added(max(at.at_s, t), uncached, max(i + 1, at.position(events)))


def numbered(land: Mapping[int, tuple[int, float, int]], numbers: Mapping[int, int]) -> dict[int, tuple[int, float]]:
    """Each landed request's (event index, time) by its number in the conductor's order."""
    return {numbers[cid]: (i, t) for cid, (i, t, _) in land.items() if cid in numbers}


def behind(events: Sequence[Sequence], here: Mapping[int, tuple[int, float]], elsewhere: Mapping[int, float],
           after: int, at_s: float, uncached: int) -> Added:
    """A refusal the conductor placed right after its request number ``after``: it lands after
    that one's landing and before the next-numbered one's in this record, at ``at_s`` (its own
    send plus the usual lag) where that falls between them (a burst's first member follows a
    request placed long before it)."""
    lo = here[after][0] + 1 if after in here else 0
    at_s = max(at_s, here[after][1] if after in here else elsewhere[after])
    nxt = min((n for n in here if n > after), default=None)
    hi = here[nxt][0] if nxt is not None else len(events)
    index = min(max(Added(at_s, uncached).position(events), lo), hi)
    return Added(min(at_s, events[hi][0]) if hi < len(events) else at_s, uncached, index,
                 _placed_next(events, here, after))


def _placed_next(events: Sequence[Sequence], here: Mapping[int, tuple[int, float]], after: int):
    """A refusal's place in its conductor's order, just after its request number ``after``. The
    instance lands a burst in placed order whatever order it arrives in (``waiting.land``); a
    refusal without a place landed before the burst-mates placed before it that arrived later:
    live on Zen 3 a 351-token prompt refused behind a 182-token one that took the last pass over
    two long jobs was judged to pass them instead (5.3 s against 29 s priced). None: the record
    names no conductor."""
    at = here.get(after)
    own = (events[at[0]],) if at is not None else ()
    placed = (e[5] for e in chain(own, (e for e in events if e[1] == LAND)) if len(e) > 5 and e[5])
    conductor = next(placed, None)
    return None if conductor is None else (conductor[0], after + 0.5)


def recorded_start(events: Sequence[Sequence], forwards: Sequence[Sequence[float]], ids: Mapping[str, int],
                   sends: Mapping[int, float], bound: int, window_s: float, numbers: Mapping[int, int] | None = None,
                   elsewhere: Mapping[int, float] | None = None):
    """A function (client id, send time, uncached tokens) → when that request's forward would have
    started on this instance (None: the record cannot tell: no request matched, or its turn not
    within it); ``numbers``: each request's ``X-Mooncake-Placed``; ``elsewhere``: by number, the
    landing time of the requests other instances' records hold (module doc)."""
    land = landed(events, ids)
    lag = arrival_lag(land, sends)
    lead = turn_lead(events, forwards)
    numbers, elsewhere = numbers or {}, elsewhere or {}
    here = numbered(land, numbers)

    def start(cid: int, send_s: float, uncached: int) -> float | None:
        after = numbers.get(cid)
        if after in here or after in elsewhere:
            added = behind(events, here, elsewhere, after, send_s + (lag or 0.0), uncached)
        elif lag is not None:
            added = placed(events, land, sends, send_s, uncached, lag, window_s)
        else:
            return None
        turn = replay(events, bound, added).turn_s
        return None if turn is None else turn + lead
    return start
