"""The scheduler's one incremental cache: what it derived from each instance's state, kept
between decisions while that state shows the same thing.

A decision reads every instance's state, but between two decisions only a few change (a job
queued or finished, a request joining or leaving a batch). :class:`EstimateCache` keeps, per
instance id, the inputs each derived value came from — the queue or batch tuple and the cost
model, by identity: the states are immutable and the cache holds on to them, so the same object
means the same values — and the value. On the next decision an instance whose inputs are the
same objects costs a lookup; a decode batch that changed only by requests joining and leaving
(with the TBT their t_d are sized with unchanged) has its leave profile edited by exactly
those, and a prefill queue with jobs appended or its head gone keeps the other jobs' predicted
durations; anything else is derived anew by the definitions in ``estimate.py``. A value handed out
is never changed afterwards (an edit works on copies).

:class:`FromScratch` derives everything anew on every call: the definition the cache must
equal, decision by decision (tests/scheduler/test_estimate_cache.py drives both through random
histories of the same instances). Both answer for all instances of a role at once: a decision
asks once per role, not once per instance. On a wide cluster the cache also keeps the same
values as rows of arrays (:meth:`EstimateCache.prefill_table`, :meth:`EstimateCache.decode_table`,
``wide.py``), rewriting only the rows of instances whose state changed.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate, compress, count
from operator import is_not
from typing import Protocol

from mooncake_lite.scheduler.costs import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler import wide
from mooncake_lite.scheduler.estimate import (CONTEXT_TOKENS, Backlog, LeaveProfile, Queues, backlog_from, backlog_of,
                                              decode_load_now, durations_of, leave_profile_of, leave_time,
                                              pricing_tbt, queues_at)
from mooncake_lite.scheduler.snapshot import StateTuple
from mooncake_lite.scheduler.state import (DecodeInstanceState, DecodingRequest, PrefillInstanceState, QueuedPrefill,
                                           ScheduleRequest)
from mooncake_lite.scheduler.wide import PrefillTable
from mooncake_lite.scheduler.wide_decode import DecodeRow, DecodeTable

# Beyond this many requests leaving a batch between two of its states, sorting its leave
# profile afresh costs about what finding and removing them would.
MAX_EDITED_LEAVES = 8


class Estimates(Protocol):
    """What a decision derives per instance (estimate.py's definitions), however it is kept:
    one value per instance, in the order given."""

    def backlogs(self, prefills: Sequence[PrefillInstanceState], costs: CostModels) -> list[Backlog]: ...

    def prefill_queues(self, prefills: Sequence[PrefillInstanceState], costs: CostModels, now: float) -> Queues:
        """Every prefill's backlog at ``now`` (read by both choices)."""

    def decode_rows_now(self, decodes: Sequence[DecodeInstanceState], costs: CostModels,
                        req: ScheduleRequest) -> DecodeRow | None:
        """The decode pick on the loads now over rows of arrays (a wide cluster), or None: the
        per-instance loop decides."""

    def loads_now(self, decodes: Sequence[DecodeInstanceState]) -> list[tuple[int, int]]: ...

    def leave_profiles(self, decodes: Sequence[DecodeInstanceState], costs: CostModels,
                       uniform_decode_s: float | None) -> list[LeaveProfile]: ...

    def follow(self, prefills: StateTuple, decodes: StateTuple) -> None:
        """Snapshots to read what changed from (snapshot.py), where the estimates keep rows."""


class FromScratch:
    """Every value derived anew, on every call."""

    @staticmethod
    def backlogs(prefills: Sequence[PrefillInstanceState], costs: CostModels) -> list[Backlog]:
        return [backlog_of(p, p.cost or costs.prefill) for p in prefills]

    @staticmethod
    def prefill_queues(prefills: Sequence[PrefillInstanceState], costs: CostModels, now: float) -> Queues:
        return queues_at(FromScratch.backlogs(prefills, costs), now)

    @staticmethod
    def decode_rows_now(decodes: Sequence[DecodeInstanceState], costs: CostModels,
                        req: ScheduleRequest) -> DecodeRow | None:
        return None

    @staticmethod
    def loads_now(decodes: Sequence[DecodeInstanceState]) -> list[tuple[int, int]]:
        return list(map(decode_load_now, decodes))

    @staticmethod
    def follow(prefills: StateTuple, decodes: StateTuple) -> None:
        return None     # nothing kept between decisions

    @staticmethod
    def leave_profiles(decodes: Sequence[DecodeInstanceState], costs: CostModels,
                       uniform_decode_s: float | None) -> list[LeaveProfile]:
        return [leave_profile_of(d, d.cost or costs.decode, uniform_decode_s) for d in decodes]


FROM_SCRATCH = FromScratch()


class EstimateCache:
    """Per-instance derived values, reused and edited between decisions (module doc). One per
    :class:`~mooncake_lite.scheduler.scheduler.Scheduler`; not thread-safe."""

    def __init__(self) -> None:
        # instance id -> the value with what it was derived from (a backlog names its queue
        # and model; the tuples are unpacked by name below)
        self._backlogs: dict[str, Backlog] = {}
        self._scaled: set[str] = set()    # ids whose kept backlog has a queue_scale other than 1
        self._loads: dict[str, tuple] = {}           # (running, its context, incoming, load now)
        self._profiles: dict[str, tuple] = {}        # (running, tbt_s, model, uniform t_d, profile)
        self._prefill_table, self._decode_table = PrefillTable(), DecodeTable()
        self._followed: tuple[StateTuple, StateTuple] | None = None

    def follow(self, prefills: StateTuple, decodes: StateTuple) -> None:
        """Read what changed between decisions from these state tuples' snapshots (the
        simulator's) when a decision's states are theirs, instead of comparing every entry."""
        self._followed = (prefills, decodes)

    def backlogs(self, prefills: Sequence[PrefillInstanceState], costs: CostModels) -> list[Backlog]:
        kept, out, default = self._backlogs, [], costs.prefill
        for p in prefills:
            model = p.cost or default
            backlog = kept.get(p.instance_id)
            if backlog is None or backlog.queue is not p.queue or backlog.model is not model \
                    or backlog.pack_tokens != p.pack_tokens:   # (a new queue_scale comes with a new queue: view)
                backlog = self._backlog(p, model)
            out.append(backlog)
        return out

    def _backlog(self, p: PrefillInstanceState, model: PrefillCostModel) -> Backlog:
        """One instance's backlog: kept, edited (jobs appended, head gone) or derived anew."""
        backlog = self._backlogs.get(p.instance_id)
        if backlog is not None and backlog.queue is p.queue and backlog.model is model \
                and backlog.pack_tokens == p.pack_tokens:
            return backlog
        if p.pack_tokens > 0:   # packed: one job more or less re-cuts the packs, so derive anew
            return self._keep(p.instance_id, backlog_of(p, model))
        durations = None
        if backlog is not None and backlog.model is model and not backlog.pack_tokens:
            durations = _kept_durations(backlog.queue, p.queue, backlog.durations_s, model)
        if durations is None:
            durations = durations_of(p.queue, model)
        backlog = backlog_from(p.queue, model, durations)
        if p.queue_scale != 1.0 and p.queue:
            backlog = backlog._replace(queue_scale=p.queue_scale)
        return self._keep(p.instance_id, backlog)

    def _keep(self, instance_id: str, backlog: Backlog) -> Backlog:
        self._backlogs[instance_id] = backlog
        if backlog.queue_scale != 1.0:
            self._scaled.add(instance_id)
        elif self._scaled:
            self._scaled.discard(instance_id)
        return backlog

    def loads_now(self, decodes: Sequence[DecodeInstanceState]) -> list[tuple[int, int]]:
        kept, out = self._loads, []
        for d in decodes:
            running, context, incoming, load = kept.get(d.instance_id, _NOTHING_KEPT_4)
            if running is not d.running or incoming is not d.incoming:
                load = self._load(d)
            out.append(load)
        return out

    def _load(self, d: DecodeInstanceState) -> tuple[int, int]:
        """One instance's load now; its running batch's context summed again only if it changed."""
        running, context, incoming, load = self._loads.get(d.instance_id, _NOTHING_KEPT_4)
        if running is d.running and incoming is d.incoming:
            return load
        if running is not d.running:
            new = d.running
            if running is not None and len(new) == len(running) + 1 and new[:-1] == running:
                context += new[-1].context_tokens     # one joined (a view appends joins)
            else:
                context = sum(map(CONTEXT_TOKENS, new))
        load = (len(d.running) + len(d.incoming), context + sum(map(CONTEXT_TOKENS, d.incoming)))
        self._loads[d.instance_id] = (d.running, context, d.incoming, load)
        return load

    # ---- wide clusters: the same values as rows of arrays (scheduler/wide.py) ------------------
    def prefill_queues(self, prefills: Sequence[PrefillInstanceState], costs: CostModels, now: float) -> Queues:
        """As rows of arrays from :data:`wide.WIDE_MIN_INSTANCES` instances on, else as lists."""
        if len(prefills) >= wide.WIDE_MIN_INSTANCES:
            return self.prefill_table(prefills, costs).queues_at(now)
        backlogs = self.backlogs(prefills, costs)
        return queues_at(backlogs, now, bool(self._scaled))   # (one that left keeps it set: right, slower)

    def decode_rows_now(self, decodes: Sequence[DecodeInstanceState], costs: CostModels,
                        req: ScheduleRequest) -> DecodeRow | None:
        if len(decodes) < wide.WIDE_MIN_INSTANCES:
            return None
        return self.decode_table(decodes, costs).choose_now(req)

    def prefill_table(self, prefills: Sequence[PrefillInstanceState], costs: CostModels) -> PrefillTable:
        """The rows of ``prefills`` (their backlogs kept as :meth:`backlogs` keeps them)."""
        snapshot = self._followed[0].last if self._followed is not None else None
        self._prefill_table.update(prefills, costs, self._backlog, snapshot)
        return self._prefill_table

    def decode_table(self, decodes: Sequence[DecodeInstanceState], costs: CostModels) -> DecodeTable:
        """The rows of ``decodes`` with their loads now (kept as :meth:`loads_now` keeps them)."""
        snapshot = self._followed[1].last if self._followed is not None else None
        self._decode_table.update(decodes, costs.decode, self._load, snapshot)
        return self._decode_table

    def leave_profiles(self, decodes: Sequence[DecodeInstanceState], costs: CostModels,
                       uniform_decode_s: float | None) -> list[LeaveProfile]:
        kept, out, default = self._profiles, [], costs.decode
        for d in decodes:
            model = d.cost or default
            running, tbt_s, kept_model, kept_uniform, profile = kept.get(d.instance_id, _NOTHING_KEPT_5)
            if running is not d.running or tbt_s != d.tbt_s or kept_model is not model \
                    or kept_uniform != uniform_decode_s:
                if kept_model is model and kept_uniform == uniform_decode_s:
                    profile = _edited_or_new(d, model, uniform_decode_s, running, profile)
                else:
                    profile = leave_profile_of(d, model, uniform_decode_s)
                kept[d.instance_id] = (d.running, d.tbt_s, model, uniform_decode_s, profile)
            out.append(profile)
        return out


_NOTHING_KEPT_4 = (None, None, None, None)
_NOTHING_KEPT_5 = (None, None, None, None, None)


def _kept_durations(old: tuple[QueuedPrefill, ...], new: tuple[QueuedPrefill, ...], durations: list[float],
                    model: PrefillCostModel) -> list[float] | None:
    """The durations of ``new``'s jobs, from ``old``'s (``durations``) when ``new`` is ``old``
    with jobs appended, or without its head (the next one shown again, started); else None."""
    k = len(old)
    if len(new) >= k and new[:k] == old:
        return durations + durations_of(new[k:], model)
    if len(new) == k - 1 and new[1:] == old[2:] and (not new or _same_job(new[0], old[1])):
        return durations[1:]
    return None


def _same_job(a: QueuedPrefill, b: QueuedPrefill) -> bool:
    """The same work (its start aside): a job's predicted duration depends on nothing else."""
    return a.num_tokens == b.num_tokens and a.num_prefix_tokens == b.num_prefix_tokens


def _edited_or_new(d: DecodeInstanceState, model: DecodeCostModel, uniform_decode_s: float | None,
                   old_running: tuple[DecodingRequest, ...], profile: LeaveProfile) -> LeaveProfile:
    """``profile`` (of ``old_running``) edited into ``d``'s when only requests joined and left
    and their t_d are still sized with the same TBT, else ``d``'s derived anew."""
    if pricing_tbt(d, model, uniform_decode_s) == profile.tbt_s:
        change = batch_change(old_running, d.running)
        if change is not None:
            return _edited(profile, *change, uniform_decode_s)
    return leave_profile_of(d, model, uniform_decode_s)


def batch_change(old: tuple[DecodingRequest, ...], new: tuple[DecodingRequest, ...]
                 ) -> tuple[list[DecodingRequest], tuple[DecodingRequest, ...]] | None:
    """(left, joined) such that ``new`` holds exactly ``old`` less ``left`` plus ``joined``.

    Cheap when ``new`` is ``old`` with some records taken out (the rest in order) and others
    appended — how an instance view edits its batch: each run of the same records is found by
    C iterators, and the most common edits (requests appended; one taken out, others appended)
    by one comparison. Correct for any two batches (a record that moved counts as leaving and
    joining); None when more than MAX_EDITED_LEAVES records would leave."""
    num_new, num_old = len(new), len(old)
    i = next(compress(count(), map(is_not, new, old)), min(num_new, num_old))   # first difference
    if i == num_old:
        return [], new[i:]
    if num_new >= num_old - 1 and new[i:num_old - 1] == old[i + 1:]:
        return [old[i]], new[num_old - 1:]
    left: list[DecodingRequest] = []
    j = i                              # the next unmatched position in new (i), in old (j)
    while j < num_old and i < num_new:
        same = next(compress(count(), map(is_not, new[i:], old[j:])), min(num_new - i, num_old - j))
        i, j = i + same, j + same
        if j < num_old and i < num_new:
            if len(left) == MAX_EDITED_LEAVES:
                return None
            left.append(old[j])        # not where the next kept record would be: it left
            j += 1
    if num_old - j + len(left) > MAX_EDITED_LEAVES:
        return None
    left.extend(old[j:])
    return left, new[i:]


def _edited(profile: LeaveProfile, left: list[DecodingRequest], joined: tuple[DecodingRequest, ...],
            uniform_decode_s: float | None) -> LeaveProfile:
    """``profile`` less ``left`` plus ``joined``, priced at the same TBT, on copies."""
    tbt = profile.tbt_s
    ends, members = profile.ends.copy(), profile.members.copy()
    lowest = len(ends)                 # entries before it keep their prefix sums
    for r in left:
        # members.index compares identity first: it finds this very record (or an equal one)
        i = members.index(r, bisect_left(ends, leave_time(r, uniform_decode_s, tbt)))
        del ends[i], members[i]
        lowest = i if i < lowest else lowest
    for r in joined:
        end = leave_time(r, uniform_decode_s, tbt)
        i = bisect_right(ends, end)
        ends.insert(i, end)
        members.insert(i, r)
        lowest = i if i < lowest else lowest
    prefix = profile.prefix[:lowest]
    prefix.extend(accumulate(map(CONTEXT_TOKENS, members[lowest:]), initial=profile.prefix[lowest]))
    return LeaveProfile(tbt, ends, members, prefix)
