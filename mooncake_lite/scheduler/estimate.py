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
from operator import attrgetter

from mooncake_lite.scheduler.costs import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.state import ClusterState, DecodeInstanceState, PrefillInstanceState

# map() with attrgetter avoids a Python-level generator frame per item in these hot sums.
_CONTEXT_TOKENS = attrgetter("context_tokens")
_NUM_TOKENS = attrgetter("num_tokens")
_NUM_PREFIX = attrgetter("num_prefix_tokens")
_JOINED_AT = attrgetter("joined_at")
_REQUEST_ID = attrgetter("request_id")


def prefill_model(p: PrefillInstanceState, costs: CostModels) -> PrefillCostModel:
    """The instance's self-profiled model if it reported one, else the cluster default."""
    return p.cost or costs.prefill


def decode_model(d: DecodeInstanceState, costs: CostModels) -> DecodeCostModel:
    return d.cost or costs.decode


def _elapsed(p: PrefillInstanceState, cum: list[float], now: float) -> float:
    """Work already done on the started jobs at the head of the queue (never more than them)."""
    done, prev = 0.0, 0.0
    for i, job in enumerate(p.queue):
        if job.started_at is None:
            break
        done += min(cum[i] - prev, max(0.0, now - job.started_at))
        prev = cum[i]
    return done


def prefill_backlog(p: PrefillInstanceState, costs: CostModels, now: float) -> tuple[list[float], float]:
    """(cumulative predicted durations of the queued jobs, work already done on them).
    Job i is predicted to finish at ``now - done + cum[i]``; the queue time is
    ``cum[-1] - done``. Cached on the state per cost model (and per ``now`` while a job is
    running), since one decision asks for it twice (prefill choice and decode prediction)."""
    model = p.cost or costs.prefill
    cached = p.__dict__.get("_backlog")
    if cached is not None and cached[0] is model and (not cached[4] or cached[1] == now):
        return cached[2], cached[3]
    if cached is not None and cached[0] is model:
        cum = cached[2]
    else:
        durations = map(model.predict, map(_NUM_TOKENS, p.queue), map(_NUM_PREFIX, p.queue))
        cum = list(accumulate(durations))
    is_running = bool(cum) and p.queue[0].started_at is not None
    done = _elapsed(p, cum, now) if is_running else 0.0
    p.__dict__["_backlog"] = (model, now, cum, done, is_running)  # derived data; fields stay frozen
    return cum, done


def queued_finish_times(p: PrefillInstanceState, costs: CostModels, now: float) -> list[float]:
    """Predicted finish time of each queued job, running them back to back from ``now``; a
    started job only has its predicted remainder (never negative) left."""
    cum, done = prefill_backlog(p, costs, now)
    return [now - done + c for c in cum]


def prefill_queue_time(p: PrefillInstanceState, costs: CostModels, now: float) -> float:
    """EstimatePrefillQueueTime: the sum of predicted prefill times of the work ahead."""
    cum, done = prefill_backlog(p, costs, now)
    return cum[-1] - done if cum else 0.0


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
    return decode_model(d, costs).predict(batch_size, context_tokens)


def late_prefills(cluster: ClusterState, costs: CostModels, now: float, t: float) -> set[str]:
    """Request ids of queued prefills predicted to finish *after* ``t``. Every other request
    committed to a decode instance (``incoming``) has joined its batch by ``t`` — step 1 of the
    §3 prediction; one in no queue has already finished prefill."""
    late: set[str] = set()
    for p in cluster.prefills:
        if not p.queue:
            continue
        cum, done = prefill_backlog(p, costs, now)
        first = bisect_right(cum, t - now + done)   # jobs run in order: the rest end later
        if first < len(cum):
            late.update(map(_REQUEST_ID, p.queue[first:]))
    return late


def _joined_after(d: DecodeInstanceState, cutoff: float) -> tuple[int, int]:
    """(count, context tokens) of running requests with joined_at > cutoff. The first query on
    a state scans; later ones bisect a sorted profile built on the second query, so a state
    seen once costs no sort and a reused one costs O(log n)."""
    profile = d.__dict__.get("_join_profile")
    if profile is None:
        if not d.__dict__.get("_join_seen"):
            d.__dict__["_join_seen"] = True
            staying = [r.context_tokens for r in d.running if r.joined_at > cutoff]
            return len(staying), sum(staying)
        ordered = sorted(d.running, key=_JOINED_AT)
        suffix = list(accumulate(map(_CONTEXT_TOKENS, reversed(ordered))))[::-1] + [0]
        profile = d.__dict__["_join_profile"] = (list(map(_JOINED_AT, ordered)), suffix)
    joined, suffix = profile
    first = bisect_right(joined, cutoff)
    return len(joined) - first, suffix[first]


def decode_load_at(d: DecodeInstanceState, costs: CostModels, t: float, late: set[str],
                   uniform_decode_s: float | None) -> tuple[int, int]:
    """(batch size, context tokens) predicted for time ``t`` (§3): requests whose decode would
    have ended by ``t`` — joined_at + t_d <= t — leave; the incoming requests whose prefill ends
    by ``t`` (not in ``late``, see :func:`late_prefills`) join.

    With ``uniform_decode_s`` None, t_d is estimated per request as its max_output_tokens times
    the instance's current TBT (unknown max_output_tokens: assumed still decoding)."""
    if uniform_decode_s is not None:
        batch, context = _joined_after(d, t - uniform_decode_s)
    else:
        tbt_now = decode_tbt(d, costs, *running_load(d))
        staying = [r.context_tokens for r in d.running if r.max_output_tokens is None
                   or r.joined_at + r.max_output_tokens * tbt_now > t]
        batch, context = len(staying), sum(staying)
    for r in d.incoming:
        if r.request_id not in late:
            batch += 1
            context += r.context_tokens
    return batch, context
