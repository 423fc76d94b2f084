"""Estimators built on the cost models: queue time, prefill finish times, decode TBT now and at
a future time (the prediction of REFERENCE.md §3).

Per-instance derived data (predicted job durations, batch totals) is computed
once per state object and kept in its ``__dict__`` (the ``functools.cached_property`` trick:
the snapshot is immutable, so the derived data never goes stale). A caller that keeps unchanged
instance states between decisions therefore pays only for the instances that changed.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from math import inf
from operator import attrgetter

from mooncake_lite.scheduler.costs import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.state import ClusterState, DecodeInstanceState, PrefillInstanceState

# map() with attrgetter avoids a Python-level generator frame per item in these hot sums.
_CONTEXT_TOKENS = attrgetter("context_tokens")
_NUM_TOKENS = attrgetter("num_tokens")
_NUM_PREFIX = attrgetter("num_prefix_tokens")
_JOINED_AT = attrgetter("joined_at")
_MAX_OUTPUT = attrgetter("max_output_tokens")
_REQUEST_ID = attrgetter("request_id")


def prefill_model(p: PrefillInstanceState, costs: CostModels) -> PrefillCostModel:
    """The instance's self-profiled model if it reported one, else the cluster default."""
    return p.cost or costs.prefill


def decode_model(d: DecodeInstanceState, costs: CostModels) -> DecodeCostModel:
    return d.cost or costs.decode


def _backlog(p: PrefillInstanceState, model: PrefillCostModel) -> tuple:
    """(model, cumulative predicted durations, (duration, started_at) of the leading started
    jobs, the jobs' request ids). Independent of ``now``: kept on the state, the per-decision
    part is a short loop."""
    durations = list(map(model.predict, map(_NUM_TOKENS, p.queue), map(_NUM_PREFIX, p.queue)))
    started = []
    for duration, job in zip(durations, p.queue):
        if job.started_at is None:
            break
        started.append((duration, job.started_at))
    return model, list(accumulate(durations)), tuple(started), tuple(map(_REQUEST_ID, p.queue))


# Per prefill instance at one ``now``: (queue time, cumulative predicted durations of the queued
# jobs, work already done on them, their request ids). Job i is predicted to finish at
# ``now - done + cum[i]``; the queue time is ``cum[-1] - done``.
PrefillView = tuple[float, list[float], float, tuple[str, ...]]


def prefill_views(prefills: tuple[PrefillInstanceState, ...], costs: CostModels,
                  now: float) -> list[PrefillView]:
    """Every prefill instance's backlog at ``now``, in one pass: a decision reads it twice (the
    prefill choice, then the decode prediction). A started job counts as done for its elapsed
    time, never more than its predicted duration. The now-independent part is cached on each
    state per cost model, so a reused state costs a short loop."""
    views = []
    for p in prefills:
        model = p.cost or costs.prefill
        cached = p.__dict__.get("_backlog")
        if cached is None or cached[0] is not model:
            cached = p.__dict__["_backlog"] = _backlog(p, model)  # derived data; fields stay frozen
        _, cum, started, request_ids = cached
        done = 0.0
        for duration, started_at in started:
            elapsed = now - started_at
            if elapsed > 0.0:
                done += duration if elapsed > duration else elapsed
        views.append((cum[-1] - done if cum else 0.0, cum, done, request_ids))
    return views


def prefill_queue_time(p: PrefillInstanceState, costs: CostModels, now: float) -> float:
    """EstimatePrefillQueueTime: the sum of predicted prefill times of the work ahead."""
    return prefill_views((p,), costs, now)[0][0]


def decode_has_room(d: DecodeInstanceState, num_tokens: int, max_output_tokens: int,
                    batch_size: int, context_tokens: int) -> bool:
    """Capacity check for adding one request to a batch of the given size/context."""
    if d.max_batch_size is not None and batch_size + 1 > d.max_batch_size:
        return False
    if d.max_context_tokens is not None and \
            context_tokens + num_tokens + max_output_tokens > d.max_context_tokens:
        return False
    return True


def running_load(d: DecodeInstanceState) -> tuple[int, int]:
    """(batch size, context tokens) of the running batch only (KV arrived): what the decode
    instance itself sees, for its own double check and its current step time."""
    total = d.__dict__.get("_context_tokens")
    if total is None:
        total = d.__dict__["_context_tokens"] = sum(map(_CONTEXT_TOKENS, d.running))
    return len(d.running), total


# Derived data that depends on a decode state's running batch alone (anything else it uses, such
# as the cost model, is part of the cached value and checked on use).
_RUNNING_ONLY = ("_context_tokens", "_leave")


def carry_running_estimates(old: DecodeInstanceState, new: DecodeInstanceState) -> None:
    """Let ``new`` reuse what was derived from ``old``'s running batch when both show the very
    same batch object — for a caller that rebuilds a state because only its incoming requests
    or capacity changed."""
    if new.running is old.running:
        for key in _RUNNING_ONLY:
            if key in old.__dict__:
                new.__dict__.setdefault(key, old.__dict__[key])


def decode_load_now(d: DecodeInstanceState) -> tuple[int, int]:
    """(batch size, context tokens) committed now: the running batch plus every incoming
    request (dispatched here, KV not arrived yet — it will be in this batch). Counting them is
    what keeps a burst from herding onto the instance that merely *looks* least loaded."""
    load = d.__dict__.get("_committed_load")
    if load is None:
        batch, context = running_load(d)
        if d.incoming:
            batch, context = batch + len(d.incoming), context + sum(map(_CONTEXT_TOKENS, d.incoming))
        load = d.__dict__["_committed_load"] = (batch, context)
    return load


def decode_tbt(d: DecodeInstanceState, costs: CostModels, batch_size: int, context_tokens: int) -> float:
    return (d.cost or costs.decode).predict(batch_size, context_tokens)


def late_prefills(views: list[PrefillView], now: float, t: float) -> set[str]:
    """Request ids of queued prefills (``views``: :func:`prefill_views` at ``now``) predicted to
    finish *after* ``t``. Every other request committed to a decode instance (``incoming``) has
    joined its batch by ``t`` — step 1 of the §3 prediction; one in no queue has already
    finished prefill."""
    late: set[str] = set()
    horizon = t - now
    for _, cum, done, request_ids in views:
        first = bisect_right(cum, horizon + done)   # jobs run in order: the rest end later
        if first < len(cum):
            late.update(request_ids[first:])
    return late


def _leave_profile(d: DecodeInstanceState, costs: CostModels,
                   uniform_decode_s: float | None) -> tuple[list[float], list[int]]:
    """When each running request is predicted to finish decoding — joined_at + t_d, with t_d
    uniform or max_output_tokens × the instance's current TBT (unknown: never, the conservative
    guess) — sorted, with the prefix sums of their contexts in that order. Fixed for a given
    state, so it is built once per state; a query is then one bisection."""
    running = d.running
    joined = map(_JOINED_AT, running)
    if uniform_decode_s is not None:
        ends = [j + uniform_decode_s for j in joined]
    else:
        tbt_now = decode_tbt(d, costs, *running_load(d))
        ends = [inf if m is None else j + m * tbt_now for j, m in zip(joined, map(_MAX_OUTPUT, running))]
    order = sorted(range(len(ends)), key=ends.__getitem__)
    ends.sort()
    contexts = list(map(_CONTEXT_TOKENS, running))
    return ends, list(accumulate(map(contexts.__getitem__, order), initial=0))


def decode_loads_at(decodes: tuple[DecodeInstanceState, ...], costs: CostModels, t: float,
                    late: set[str], uniform_decode_s: float | None) -> list[tuple[int, int]]:
    """Each decode instance's (batch size, context tokens) predicted for time ``t`` (§3):
    requests whose decode would have ended by ``t`` — joined_at + t_d <= t — leave; the
    incoming requests whose prefill ends by ``t`` (not in ``late``, see
    :func:`late_prefills`) join.

    With ``uniform_decode_s`` None, t_d is estimated per request as its max_output_tokens times
    the instance's current TBT (unknown max_output_tokens: assumed still decoding). One pass
    over the instances: this runs per decode instance per request."""
    loads = []
    for d in decodes:
        model = d.cost or costs.decode
        profile = d.__dict__.get("_leave")
        if profile is None or profile[0] is not model or profile[1] != uniform_decode_s:
            profile = d.__dict__["_leave"] = (model, uniform_decode_s, *_leave_profile(d, costs, uniform_decode_s))
        ends, prefix = profile[2], profile[3]
        first = bisect_right(ends, t)               # running requests still decoding at t
        batch, context = len(ends) - first, prefix[-1] - prefix[first]
        for r in d.incoming:
            if r.request_id not in late:
                batch += 1
                context += r.context_tokens
        loads.append((batch, context))
    return loads


def decode_load_at(d: DecodeInstanceState, costs: CostModels, t: float, late: set[str],
                   uniform_decode_s: float | None) -> tuple[int, int]:
    """:func:`decode_loads_at` for one instance."""
    return decode_loads_at((d,), costs, t, late, uniform_decode_s)[0]
