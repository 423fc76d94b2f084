"""Estimators built on the cost models: queue time, prefill finish times, decode TBT now and at
a future time (the prediction of REFERENCE.md §3).

Per-instance derived data (predicted job durations, batch totals, the sorted leave profile) is
computed once per state object and kept in its derived slots (state.py; like
``functools.cached_property``: the snapshot is immutable, so the derived data never goes
stale). A caller that keeps unchanged instance states between decisions therefore pays only for
the instances that changed, and one that rebuilds a state from the previous one
(:func:`carry_queue_estimates`, :func:`carry_running_estimates`) pays only for the job queued
or finished, or the request that joined or left. A decision computes each instance's view
(prefill backlog at ``now``, decode load at ``t``) in one pass per role.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate, compress, count
from math import inf
from operator import attrgetter, is_not
from typing import NamedTuple

from mooncake_lite.scheduler.costs import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.state import (DecodeInstanceState, DecodingRequest, PrefillInstanceState,
                                           QueuedPrefill)

# Sets a derived slot on a frozen state (state.py ``_derived``): its fields never change.
_keep = object.__setattr__

# map() with attrgetter avoids a Python-level generator frame per item in these hot sums.
_CONTEXT_TOKENS = attrgetter("context_tokens")
_NUM_TOKENS = attrgetter("num_tokens")
_NUM_PREFIX = attrgetter("num_prefix_tokens")
_REQUEST_ID = attrgetter("request_id")


def prefill_model(p: PrefillInstanceState, costs: CostModels) -> PrefillCostModel:
    """The instance's self-profiled model if it reported one, else the cluster default."""
    return p.cost or costs.prefill


def _backlog(p: PrefillInstanceState, model: PrefillCostModel) -> tuple:
    """(model, cumulative predicted durations, (duration, started_at) of the leading started
    jobs, the jobs' request ids, their predicted durations). Independent of ``now``: kept on
    the state, the per-decision part is a short loop. Edited from the previous state's when
    :func:`carry_queue_estimates` linked them and one job was queued or the head finished."""
    durations = _edited_durations(p, model)
    if durations is None:
        durations = list(map(model.predict, map(_NUM_TOKENS, p.queue), map(_NUM_PREFIX, p.queue)))
    started = []
    for duration, job in zip(durations, p.queue):
        if job.started_at is None:
            break
        started.append((duration, job.started_at))
    return (model, list(accumulate(durations)), tuple(started), tuple(map(_REQUEST_ID, p.queue)),
            durations)


def _edited_durations(p: PrefillInstanceState, model: PrefillCostModel) -> list[float] | None:
    """The previous state's predicted durations with the job queued since appended, or without
    the head that finished; None when anything else changed (or nothing links them)."""
    previous = p._previous
    if previous is None:
        return None
    _keep(p, "_previous", None)        # used once: do not keep the old state alive
    old = previous._backlog
    if old is None or old[0] is not model:
        return None
    queue, old_queue, durations = p.queue, previous.queue, old[4]
    k = len(old_queue)
    if len(queue) == k + 1 and queue[:k] == old_queue:
        job = queue[k]
        return [*durations, model.predict(job.num_tokens, job.num_prefix_tokens)]
    if len(queue) == k - 1 and queue[1:] == old_queue[2:] and queue and _same_job(queue[0], old_queue[1]):
        return durations[1:]
    return None


def _same_job(a: QueuedPrefill, b: QueuedPrefill) -> bool:
    """The same job, perhaps shown again with a new started_at."""
    return a is b or (a.request_id == b.request_id and a.num_tokens == b.num_tokens
                      and a.num_prefix_tokens == b.num_prefix_tokens)


def carry_queue_estimates(old: PrefillInstanceState, new: PrefillInstanceState) -> None:
    """For a caller that rebuilds a prefill state from the previous one: ``new``'s backlog is
    then edited from ``old``'s (one job queued, or the head finished) instead of predicting
    every queued job again."""
    if old._backlog is not None:
        _keep(new, "_previous", old)


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
    views, default_model = [], costs.prefill
    for p in prefills:
        model = p.cost or default_model
        cached = p._backlog
        if cached is None or cached[0] is not model:
            cached = _backlog(p, model)
            _keep(p, "_backlog", cached)
        _, cum, started, request_ids, _ = cached
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
    total = d._context_tokens
    if total is None:
        total = sum(map(_CONTEXT_TOKENS, d.running))
        _keep(d, "_context_tokens", total)
    return len(d.running), total


def carry_running_estimates(old: DecodeInstanceState, new: DecodeInstanceState,
                            edits: Sequence[tuple[bool, DecodingRequest]] | None = None) -> None:
    """For a caller that rebuilds a decode state from the previous one: ``new`` reuses what was
    derived from ``old``'s running batch when both show the very same batch object (only its
    incoming requests or capacity changed); otherwise its leave profile may be edited from
    ``old``'s (see MAX_TBT_DRIFT). A caller that knows how ``new.running`` came from
    ``old.running`` passes ``edits``: ``(True, record)`` appended, ``(False, record)`` removed,
    in the order they happened — exactly those: edits that change the batch's size wrongly or
    remove a record the profile does not hold fall back to a fresh profile, but others (say, the
    wrong record appended) are not detected. Without ``edits``, one appended or removed record
    is recognised by comparing the two batches (which touches every record of both).

    The profile *moves* to ``new`` (edited in place, so an edit touches only the entries it
    shifts): ``old`` answers as before if asked again, but builds its profile afresh."""
    if new.running is old.running:
        if new._context_tokens is None:
            _keep(new, "_context_tokens", old._context_tokens)
        if new._leave is None:
            _keep(new, "_leave", old._leave)
            _keep(old, "_leave", None)     # a profile has one owner: the next rebuild may edit it in place
    elif old._leave is not None:
        _keep(new, "_previous", (old, edits))


def decode_load_now(d: DecodeInstanceState) -> tuple[int, int]:
    """(batch size, context tokens) committed now: the running batch plus every incoming
    request (dispatched here, KV not arrived yet — it will be in this batch). Counting them is
    what keeps a burst from herding onto the instance that merely *looks* least loaded."""
    load = d._committed_load
    if load is None:
        batch, context = running_load(d)
        if d.incoming:
            batch, context = batch + len(d.incoming), context + sum(map(_CONTEXT_TOKENS, d.incoming))
        load = (batch, context)
        _keep(d, "_committed_load", load)
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


# How far the TBT behind a per-request t_d (max_output_tokens × TBT) may drift from the
# instance's current TBT before its leave profile is rebuilt. One request joining or leaving a
# batch moves its TBT by a few percent and would otherwise re-derive and re-sort every
# member's leave time, twice per decision in a steady state; a profile edited in place instead
# keeps the TBT it was built with, within this bound — far inside the error of
# max_output_tokens as a stand-in for the output length.
MAX_TBT_DRIFT = 1 / 16


class _LeaveProfile(NamedTuple):
    """A decode state's running requests sorted by predicted leave time (``ends``), with their
    records and contexts in that order and the prefix sums of those contexts; ``tbt`` is the
    TBT the per-request t_d were computed with (None with a uniform t_d)."""

    model: DecodeCostModel
    uniform_decode_s: float | None
    tbt: float | None
    ends: list[float]
    members: list[DecodingRequest]
    contexts: list[int]
    prefix: list[int]


def _leave_time(r: DecodingRequest, uniform_decode_s: float | None, tbt: float | None) -> float:
    """joined_at + t_d, t_d uniform or max_output_tokens × tbt (unknown: never leaves — the
    conservative guess)."""
    if uniform_decode_s is not None:
        return r.joined_at + uniform_decode_s
    return inf if r.max_output_tokens is None else r.joined_at + r.max_output_tokens * tbt


def _leave_times(requests: Sequence[DecodingRequest], uniform_decode_s: float | None,
                 tbt: float | None) -> list[float]:
    """:func:`_leave_time` of each request (written out: this runs over whole batches)."""
    if uniform_decode_s is not None:
        return [r.joined_at + uniform_decode_s for r in requests]
    return [inf if r.max_output_tokens is None else r.joined_at + r.max_output_tokens * tbt
            for r in requests]


def _leave_profile(d: DecodeInstanceState, model: DecodeCostModel,
                   uniform_decode_s: float | None) -> _LeaveProfile:
    """The profile of ``d``'s running batch, per-request t_d from its current TBT: edited from
    the previous state's (see :func:`carry_running_estimates`) by the requests that joined or
    left while the TBT moved less than MAX_TBT_DRIFT, else built by sorting."""
    carried = d._previous              # (previous state, edits) from carry_running_estimates
    _keep(d, "_previous", None)        # used once: do not keep the old state alive
    profile = carried is not None and _edited_profile(d, *carried, model, uniform_decode_s)
    if profile:
        return profile
    running = d.running
    tbt = None if uniform_decode_s is not None else model.predict(*running_load(d))
    ends = _leave_times(running, uniform_decode_s, tbt)
    order = sorted(range(len(ends)), key=ends.__getitem__)
    ends.sort()
    members = list(map(running.__getitem__, order))
    contexts = list(map(_CONTEXT_TOKENS, members))
    return _LeaveProfile(model, uniform_decode_s, tbt, ends, members, contexts,
                         list(accumulate(contexts, initial=0)))


def _edited_profile(d: DecodeInstanceState, previous: DecodeInstanceState,
                    edits: Sequence[tuple[bool, DecodingRequest]] | None, model: DecodeCostModel,
                    uniform_decode_s: float | None) -> _LeaveProfile | None:
    """``previous``'s profile with the requests that joined inserted and those that left
    removed, keeping its TBT while the current one is within MAX_TBT_DRIFT of it; else None."""
    old = previous._leave
    if old is None or old.model is not model or old.uniform_decode_s != uniform_decode_s:
        return None
    if edits is None:
        change = _one_change(d.running, previous.running)
        if change is None:
            return None
        edits = (change,)
    total, size = old.prefix[-1], len(old.ends)
    for joined, r in edits:
        if joined:
            total, size = total + r.context_tokens, size + 1
        else:
            total, size = total - r.context_tokens, size - 1
    if size != len(d.running):
        return None                    # the edits do not describe this batch: build it afresh
    tbt = old.tbt
    if tbt is not None and abs(model.predict(len(d.running), total) - tbt) > tbt * MAX_TBT_DRIFT:
        return None
    _keep(previous, "_leave", None)    # moved to ``d`` (see carry_running_estimates)
    ends, members, contexts, prefix = old.ends, old.members, old.contexts, old.prefix
    lowest = size                      # entries before it keep their prefix sums
    for joined, r in edits:
        end = _leave_time(r, uniform_decode_s, tbt)
        if joined:
            i = bisect_right(ends, end)
            ends.insert(i, end)
            members.insert(i, r)
            contexts.insert(i, r.context_tokens)
        else:
            try:
                i = members.index(r, bisect_left(ends, end))   # identity first: finds this very record
            except ValueError:         # not in the batch the edits start from
                return None
            del ends[i], members[i], contexts[i]
        lowest = i if i < lowest else lowest
    prefix[lowest:] = accumulate(contexts[lowest:], initial=prefix[lowest])
    if d._context_tokens is None:      # only now: the edits applied, so the total is the batch's
        _keep(d, "_context_tokens", total)
    return _LeaveProfile(model, uniform_decode_s, tbt, ends, members, contexts, prefix)


def _one_change(running: tuple, old_running: tuple) -> tuple[bool, DecodingRequest] | None:
    """(True, record) if ``running`` is ``old_running`` plus one record at the end, (False,
    record) if it is ``old_running`` minus one; else None. Records compare by identity first,
    and the first differing position is found with C iterators, so this never loops in Python."""
    n, k = len(running), len(old_running)
    if n == k + 1 and running[:k] == old_running:
        return True, running[k]
    if n == k - 1:
        i = next(compress(count(), map(is_not, running, old_running)), n)
        if running[i:] == old_running[i + 1:]:
            return False, old_running[i]
    return None


def decode_loads_at(decodes: tuple[DecodeInstanceState, ...], costs: CostModels, t: float,
                    late: set[str], uniform_decode_s: float | None) -> list[tuple[int, int]]:
    """Each decode instance's (batch size, context tokens) predicted for time ``t`` (§3):
    requests whose decode would have ended by ``t`` — joined_at + t_d <= t — leave; the
    incoming requests whose prefill ends by ``t`` (not in ``late``, see
    :func:`late_prefills`) join.

    With ``uniform_decode_s`` None, t_d is estimated per request as its max_output_tokens times
    the instance's current TBT (unknown max_output_tokens: assumed still decoding). One pass
    over the instances: this runs per decode instance per request."""
    loads, default_model = [], costs.decode
    for d in decodes:
        model = d.cost or default_model
        profile = d._leave
        if profile is None or profile.model is not model or profile.uniform_decode_s != uniform_decode_s:
            profile = _leave_profile(d, model, uniform_decode_s)
            _keep(d, "_leave", profile)
        ends, prefix = profile.ends, profile.prefix
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
