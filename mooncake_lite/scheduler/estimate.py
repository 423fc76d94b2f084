"""Estimators built on the cost models: queue time, prefill finish times, decode load now and at
a future time (the prediction of docs/paper.md §3).

Each ``*_of`` function is a definition: it derives one thing from one instance state, from
scratch, independent of ``now``. A decision gets them for every instance of a role at once
from an estimate cache (:mod:`mooncake_lite.scheduler.cache`), which reuses what it derived for
an instance while that instance's state shows the same thing, and combines them with ``now``
and ``t`` here (:func:`queues_at`, :func:`late_prefills`, :func:`loads_at`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from math import inf
from operator import attrgetter
from typing import NamedTuple, Protocol

from mooncake_lite.scheduler import rules
from mooncake_lite.scheduler.block_index import PrefixMatch
from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.scheduler.costs import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.packing import NO_TAIL, packed_queue
from mooncake_lite.scheduler.state import (DecodeInstanceState, DecodingRequest, IncomingRequest, PrefillInstanceState,
                                           QueuedPrefill, ScheduleRequest)

# map() with attrgetter avoids a Python-level generator frame per item in these hot sums.
CONTEXT_TOKENS = attrgetter("context_tokens")
# A NamedTuple's own constructor is a Python-level function (collections.namedtuple builds it
# with eval); tuple.__new__ with every field, in order, makes the same tuple without that frame
# (~0.4 µs, ~7 records a simulated request).
_new = tuple.__new__
_REQUEST_ID = attrgetter("request_id")
_NO_IDS: set[str] = set()
_PACK_TOKENS = attrgetter("pack_tokens")


def prefill_model(p: PrefillInstanceState, costs: CostModels) -> PrefillCostModel:
    """The instance's self-profiled model if it reported one, else the cluster default."""
    return p.cost or costs.prefill


# ---- prefill queues ------------------------------------------------------------------------
class Backlog(NamedTuple):
    """A prefill queue's predicted work, independent of ``now``: the queue and cost model it is
    of, each job's predicted duration, their running sums (job i ends ``cumulative_s[i]`` after
    the queue's work started), the (duration, started_at) of the leading jobs that have
    started, and the jobs' request ids. An instance that packs (``pack_tokens`` > 0) has its
    queue priced packed (:mod:`~mooncake_lite.scheduler.packing`: a pack's first job carries
    its time) and names the last waiting pack a new request may join (``tail_tokens``, ``tail_s``).
    ``queue_scale``: the instance's (``PrefillInstanceState.queue_scale``): its work left is waited
    for that many times its price (:func:`queues_at`); the durations stay as priced (1 when empty:
    nothing to wait for, and the empty queue is one object, which the estimate cache keys on)."""

    queue: tuple[QueuedPrefill, ...]
    model: PrefillCostModel
    durations_s: list[float]
    cumulative_s: list[float]
    started: tuple[tuple[float, float], ...]
    request_ids: tuple[str, ...]
    pack_tokens: int = 0
    tail_tokens: int = NO_TAIL
    tail_s: float = 0.0
    tail_bound: int = 0
    queue_scale: float = 1.0


def durations_of(queue: Sequence[QueuedPrefill], model: PrefillCostModel) -> list[float]:
    """Each queued job's predicted prefill time."""
    predict = model.predict
    return [predict(job.num_tokens, job.num_prefix_tokens) for job in queue]


def backlog_of(p: PrefillInstanceState, model: PrefillCostModel) -> Backlog:
    if p.pack_tokens > 0:
        packed = packed_queue(p.queue, model, p.pack_tokens)
        return backlog_from(p.queue, model, packed.durations_s)._replace(
            pack_tokens=p.pack_tokens, tail_tokens=packed.tail_tokens, tail_s=packed.tail_s,
            tail_bound=packed.tail_bound, queue_scale=p.queue_scale if p.queue else 1.0)
    b = backlog_from(p.queue, model, durations_of(p.queue, model))
    return b if p.queue_scale == 1.0 or not p.queue else b._replace(queue_scale=p.queue_scale)


def backlog_from(queue: tuple[QueuedPrefill, ...], model: PrefillCostModel, durations: list[float]) -> Backlog:
    """The backlog of ``queue`` whose jobs take ``durations`` by ``model``; the started head's
    forward (its first job carries it) takes what its instance reported instead, where it did
    (``QueuedPrefill.reported_s``); the list given is not changed (the estimate cache keeps it)."""
    if queue and queue[0].ends_at is not None:
        reported = queue[0].reported_s()
        if reported is not None:
            durations = [reported, *durations[1:]]
    started = []
    for duration, job in zip(durations, queue):
        if job.started_at is None:
            break
        started.append((duration, job.started_at))
    return _new(Backlog, (queue, model, durations, list(accumulate(durations)), tuple(started),
                          tuple(map(_REQUEST_ID, queue)), 0, NO_TAIL, 0.0, 0, 1.0))


class QueuesAt(NamedTuple):
    """Every prefill instance's backlog at one ``now`` (lists in the instances' order): the
    work already done on its started jobs, and its queue time (EstimatePrefillQueueTime). Job i
    of instance k ends at ``now - done_s[k] + backlogs[k].cumulative_s[i]``."""

    backlogs: list[Backlog]
    done_s: list[float]
    queue_s: list[float]
    scaled: bool = False     # a backlog's queue_scale is not 1 (else the per-job sums skip it)

    @property
    def packing(self) -> bool:
        return any(map(_PACK_TOKENS, self.backlogs))

    def queue_at(self, i: int) -> float:
        return self.queue_s[i]

    def kvcache_row(self, req: ScheduleRequest, match: PrefixMatch, cfg: SchedulerConfig,
                    costs: CostModels) -> tuple[int, int, bool] | None:
        return None     # no rows: the loop decides


class Queues(Protocol):
    """What a decision reads of every prefill's backlog at ``now``: a :class:`QueuesAt`, or the
    wide table's ``wide.RowQueues`` (the same lists, made from its arrays when read, and
    Algorithm 1 over its rows)."""

    @property
    def backlogs(self) -> list[Backlog]: ...

    @property
    def done_s(self) -> list[float]: ...

    @property
    def queue_s(self) -> list[float]: ...

    @property
    def scaled(self) -> bool:
        """Whether a backlog's ``queue_scale`` is not 1."""

    @property
    def packing(self) -> bool:
        """Whether an instance packs its queue (prefill batching)."""

    def queue_at(self, i: int) -> float:
        """Instance i's queue time."""

    def kvcache_row(self, req: ScheduleRequest, match: PrefixMatch, cfg: SchedulerConfig,
                    costs: CostModels) -> tuple[int, int, bool] | None:
        """Algorithm 1's choice over rows (instance, its local blocks, whether it fetches), or
        None: the per-instance loop decides."""


def queues_at(backlogs: list[Backlog], now: float, scaled: bool | None = None) -> QueuesAt:
    """A started job counts as done for its elapsed time, never more than its duration; the work
    left is waited for ``queue_scale`` times its price (the backlog's). ``scaled``: whether any
    backlog's scale may not be 1 (None: look; the estimate cache knows, and a decision reads
    these sums several times: reading each scale cost 1.3% of a live decision)."""
    if scaled is None:
        scaled = any(b.queue_scale != 1.0 for b in backlogs)
    done_s, queue_s = [], []
    for b in backlogs:
        cum, done = b.cumulative_s, 0.0
        for duration, started_at in b.started:
            elapsed = now - started_at
            if elapsed > 0.0:
                done += duration if elapsed > duration else elapsed
        done_s.append(done)
        queue_s.append(cum[-1] - done if cum else 0.0)
    if scaled:
        queue_s = [left * b.queue_scale for left, b in zip(queue_s, backlogs)]
    return QueuesAt(backlogs, done_s, queue_s, scaled)


def prefill_queue_time(p: PrefillInstanceState, costs: CostModels, now: float) -> float:
    """EstimatePrefillQueueTime: the sum of predicted prefill times of the work ahead (its
    packed forwards when the instance packs)."""
    return queues_at([backlog_of(p, prefill_model(p, costs))], now).queue_s[0]


def late_prefills(queues: Queues, now: float, t: float) -> set[str]:
    """Request ids of queued prefills predicted (``queues``: at ``now``) to finish *after* ``t``:
    an incoming request (committed to a decode) not among them has joined its batch by ``t`` —
    step 1 of the §3 prediction; one in no queue has already finished prefill."""
    late: set[str] = set()
    horizon = t - now
    if queues.scaled:     # (a call per decode and time: the scales read only where there are any)
        return _late_scaled(queues, horizon)
    for b, done in zip(queues.backlogs, queues.done_s):
        cum = b.cumulative_s
        first = bisect_right(cum, horizon + done)   # jobs run in order: the rest end later
        if first < len(cum):
            late.update(b.request_ids[first:])
    return late


def _late_scaled(queues: Queues, horizon: float) -> set[str]:
    """:func:`late_prefills` where a backlog's work left is waited for ``queue_scale`` times its price."""
    late: set[str] = set()
    for b, done in zip(queues.backlogs, queues.done_s):
        cum = b.cumulative_s
        first = bisect_right(cum, horizon / b.queue_scale + done)
        if first < len(cum):
            late.update(b.request_ids[first:])
    return late


def prefill_ends(queues: Queues, now: float) -> dict[str, float]:
    """When each queued prefill is predicted (``queues``: at ``now``) to finish, by request id (job
    i of instance k at ``now + (cumulative_s[i] - done_s[k]) × queue_scale``): when its incoming
    request joins."""
    ends: dict[str, float] = {}
    scaled = queues.scaled
    for b, done in zip(queues.backlogs, queues.done_s):
        if scaled and b.queue_scale != 1.0:
            q = b.queue_scale
            ends.update(zip(b.request_ids, [now + (c - done) * q for c in b.cumulative_s]))
            continue
        start = now - done
        ends.update(zip(b.request_ids, [start + c for c in b.cumulative_s]))
    return ends


# ---- decode load now -----------------------------------------------------------------------
def decode_has_room(d: DecodeInstanceState, num_tokens: int, max_output_tokens: int,
                    batch_size: int, context_tokens: int) -> bool:
    """Capacity check for adding one request to a batch of the given size/context (the
    decode pick's rule: :func:`rules.decode_has_room`)."""
    return rules.decode_has_room(d.max_batch_size, d.max_context_tokens, batch_size, context_tokens,
                                 num_tokens + max_output_tokens)


def decode_tbt(d: DecodeInstanceState, costs: CostModels, batch_size: int, context_tokens: int) -> float:
    return (d.cost or costs.decode).predict(batch_size, context_tokens)


def running_load(d: DecodeInstanceState) -> tuple[int, int]:
    """(batch size, context tokens) of the running batch only (KV arrived): what the decode
    instance itself sees, for its own double check and its current step time."""
    return len(d.running), sum(map(CONTEXT_TOKENS, d.running))


def decode_load_now(d: DecodeInstanceState) -> tuple[int, int]:
    """(batch size, context tokens) committed now: the running batch plus every incoming
    request (dispatched here, KV not arrived yet — it will be in this batch). Counting them is
    what keeps a burst from herding onto the instance that merely *looks* least loaded."""
    batch, context = running_load(d)
    return batch + len(d.incoming), context + sum(map(CONTEXT_TOKENS, d.incoming))


# ---- decode load at a future time ----------------------------------------------------------
class LeaveProfile(NamedTuple):
    """A decode batch's running requests sorted by predicted leave time: ``ends`` ascending,
    ``members`` the records in that order, ``prefix`` the running sums of their contexts
    (``prefix[i]`` = contexts of the first i). ``tbt_s`` is the TBT their per-request t_d
    were sized with (None with a uniform t_d). A query at ``t`` is one bisection."""

    tbt_s: float | None
    ends: list[float]
    members: list[DecodingRequest]
    prefix: list[int]


def pricing_tbt(d: DecodeInstanceState, model: DecodeCostModel, uniform_decode_s: float | None) -> float | None:
    """The TBT per-request t_d are sized with: the state's ``tbt_s``, else the running batch's
    predicted TBT; None with a uniform t_d."""
    if uniform_decode_s is not None:
        return None
    return d.tbt_s if d.tbt_s is not None else model.predict(*running_load(d))


def decode_span(max_output_tokens: int | None, uniform_decode_s: float | None, tbt_s: float | None) -> float:
    """t_d: uniform, or max_output_tokens × tbt_s (unknown: never leaves — the conservative guess)."""
    if uniform_decode_s is not None:
        return uniform_decode_s
    assert tbt_s is not None, "pricing_tbt is a float without a uniform t_d"
    return inf if max_output_tokens is None else max_output_tokens * tbt_s


def own_decode_span(model: DecodeCostModel, max_output_tokens: int | None, context_tokens: int,
                    uniform_decode_s: float | None, tbt_s: float | None) -> float:
    """One request's t_d (:func:`decode_span`) at the batch's step ``tbt_s``, at least its own step
    alone (an idle decode's TBT is 0, yet each token takes a step)."""
    step = tbt_s
    if tbt_s is not None and max_output_tokens is not None:
        alone = model.predict(1, context_tokens)
        step = alone if alone > tbt_s else tbt_s
    return decode_span(max_output_tokens, uniform_decode_s, step)


def joining_step(model: DecodeCostModel, batch: int, context_tokens: int) -> float:
    """The step a request yet to join a decode has its t_d sized with (at least its own step
    alone, :func:`own_decode_span`): the batch of the ``batch`` sequences of ``context_tokens``
    still decoding at ``t`` beside it, not the batch now. A step of the batch now holds
    requests gone by then: a 3,800-token prompt's last tokens, gone 0.2 s later, priced a burst's
    short prompts 0.018 s a step where they ran at 0.006-0.008 s, and refused three of them on
    the TBT (docs/results/2026-11-30-zen5.md §28)."""
    return model.predict(batch + 1, context_tokens)


def leave_time(r: DecodingRequest, uniform_decode_s: float | None, tbt_s: float | None) -> float:
    """joined_at + t_d (:func:`decode_span`)."""
    return r.joined_at + decode_span(r.max_output_tokens, uniform_decode_s, tbt_s)


def leave_profile_of(d: DecodeInstanceState, model: DecodeCostModel,
                     uniform_decode_s: float | None) -> LeaveProfile:
    running, tbt = d.running, pricing_tbt(d, model, uniform_decode_s)
    if uniform_decode_s is not None:     # leave_time, written out: this runs over whole batches
        ends = [r.joined_at + uniform_decode_s for r in running]
    else:
        assert tbt is not None, "pricing_tbt is a float without a uniform t_d"
        ends = [inf if r.max_output_tokens is None else r.joined_at + r.max_output_tokens * tbt for r in running]
    order = sorted(range(len(ends)), key=ends.__getitem__)
    ends.sort()
    members = list(map(running.__getitem__, order))
    return LeaveProfile(tbt, ends, members, list(accumulate(map(CONTEXT_TOKENS, members), initial=0)))


def loads_at(decodes: Sequence[DecodeInstanceState], profiles: list[LeaveProfile], now: float, t: float,
             queues: Queues | None, uniform_decode_s: float | None,
             default: DecodeCostModel) -> list[tuple[int, int]]:
    """Each decode instance's (batch size, context tokens) predicted for time ``t`` (§3): running
    requests with joined_at + t_d <= ``t`` leave; an incoming one is there if its prefill ends by
    ``t`` (``queues``: the backlogs at ``now``; in no queue: ended) and its t_d (at the step of the
    running requests still there at ``t``, :func:`joining_step`; at least its own step alone: an
    idle decode's TBT is 0) has not run out since. Counted for ever, a burst's tenth member was
    priced at a batch of ten where two ran (docs/results/2026-11-29-decode-load.md). Per decode
    per request: when they joined is looked up only where one may have a t_d at the batch's step
    now shorter than ``t - now`` (``DecodeInstanceState.incoming_shortest``); elsewhere only the
    late leave out (bin/decision-cost, issue #31's 5%: checked at the joining step, the look-up ran
    in 8% of its decisions, not 0.1%, and cost 6%; 2026-12-04 again +5.4%, the step alone, not
    the look-up, with 0.3% left), choice i > 0 of a late request of n counted (its record is
    ``rid#i``, the queue's ``rid``). Both err one way: where running requests leave before ``t``
    the joining step is shorter than the step now, and a request whose t_d at it runs out by ``t``
    is still counted (tests/scheduler/test_estimate_cache.py holds a history): never a lighter load."""
    late = _NO_IDS if queues is None else late_prefills(queues, now, t)
    ends: dict[str, float] | None = None
    ahead, loads = t - now, []
    uniform = inf if uniform_decode_s is None else uniform_decode_s   # read only where tbt is None: uniform
    for d, profile in zip(decodes, profiles):
        profile_ends, prefix, tbt = profile.ends, profile.prefix, profile.tbt_s
        first = bisect_right(profile_ends, t)       # running requests still decoding at t
        batch, context = len(profile_ends) - first, prefix[-1] - prefix[first]
        incoming = d.incoming
        if incoming:
            # the shortest t_d any of them has: longer than t - now, none has left by t
            if (uniform if tbt is None else d.incoming_shortest * tbt) > ahead:
                for r in incoming:
                    if r.request_id not in late:
                        batch += 1
                        context += r.context_tokens
            else:
                if ends is None:
                    ends = {} if queues is None else prefill_ends(queues, now)
                model = d.cost or default
                step = tbt if tbt is None else joining_step(model, batch, context)
                joined, tokens = _still_decoding(incoming, model, late, ends, now, t, step, uniform_decode_s)
                batch += joined
                context += tokens
        loads.append((batch, context))
    return loads


def _still_decoding(incoming: tuple[IncomingRequest, ...], model: DecodeCostModel, late: set[str],
                    ends: dict[str, float], now: float, t: float, tbt: float | None,
                    uniform_decode_s: float | None) -> tuple[int, int]:
    """(how many, their context tokens) of ``incoming`` that joined by ``t`` (their prefill's end in
    ``ends``, else ``now``) and whose t_d (:func:`decode_span` at ``tbt``, :func:`joining_step`;
    their step at least their own alone) has not run out by then."""
    joined = tokens = 0
    for r in incoming:
        rid = r.request_id
        if rid not in ends and "#" in rid:      # choice i > 0 of a request of n: queued as the request
            rid = rid.rpartition("#")[0]
        if rid in late:
            continue
        span = own_decode_span(model, r.max_output_tokens, r.context_tokens, uniform_decode_s, tbt)
        if ends.get(rid, now) + span > t:
            joined += 1
            tokens += r.context_tokens
    return joined, tokens


def decode_load_at(d: DecodeInstanceState, costs: CostModels, now: float, t: float, queues: Queues | None,
                   uniform_decode_s: float | None) -> tuple[int, int]:
    """:func:`loads_at` for one instance, from scratch. With ``uniform_decode_s`` None, t_d is
    estimated per request as its max_output_tokens times the instance's TBT (:func:`pricing_tbt`;
    an incoming one's at least its step alone; unknown max_output_tokens: assumed still decoding)."""
    profile = leave_profile_of(d, d.cost or costs.decode, uniform_decode_s)
    return loads_at((d,), [profile], now, t, queues, uniform_decode_s, costs.decode)[0]
