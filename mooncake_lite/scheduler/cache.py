"""The scheduler's one incremental cache: what it derived from each instance's state, kept
between decisions while that state shows the same thing.

A decision reads every instance's state, but between two decisions only a few change (a job
queued or finished, a request joining or leaving a batch). :class:`EstimateCache` keeps, per
instance id, the inputs each derived value came from — the queue or batch tuple and the cost
model, by identity: the states are immutable and the cache holds on to them, so the same object
means the same values — and the value. On the next decision an instance whose inputs are the
same objects costs a lookup; a decode batch that changed only by requests joining and leaving
(with the TBT their t_d are sized with unchanged) has its leave profile edited by exactly
those; anything else is derived anew from the definitions in ``estimate.py``. A value handed
out is never changed afterwards (an edit works on copies).

:class:`FromScratch` derives everything anew on every call: the definition the cache must
equal, decision by decision (tests/scheduler/test_estimate_cache.py drives both through random
histories of the same instances).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate, compress, count
from operator import is_not
from typing import Protocol

from mooncake_lite.scheduler.costs import DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.estimate import (CONTEXT_TOKENS, Backlog, LeaveProfile, backlog_of, decode_load_now,
                                              leave_profile_of, leave_time, pricing_tbt)
from mooncake_lite.scheduler.state import DecodeInstanceState, DecodingRequest, PrefillInstanceState

# Beyond this many requests leaving a batch between two of its states, sorting its leave
# profile afresh costs about what finding and removing them would.
MAX_EDITED_LEAVES = 8


class Estimates(Protocol):
    """What a decision derives per instance (estimate.py's definitions), however it is kept."""

    def backlog(self, p: PrefillInstanceState, model: PrefillCostModel) -> Backlog: ...

    def committed_load(self, d: DecodeInstanceState) -> tuple[int, int]: ...

    def leave_profile(self, d: DecodeInstanceState, model: DecodeCostModel,
                      uniform_decode_s: float | None) -> LeaveProfile: ...


class FromScratch:
    """Every value derived anew, on every call."""

    backlog = staticmethod(backlog_of)
    committed_load = staticmethod(decode_load_now)
    leave_profile = staticmethod(leave_profile_of)


class _Profiled:
    """A decode instance's leave profile and what it was derived from."""

    __slots__ = ("running", "tbt_s", "model", "uniform_decode_s", "profile")

    def __init__(self, d: DecodeInstanceState, model: DecodeCostModel, uniform_decode_s: float | None,
                 profile: LeaveProfile) -> None:
        self.running, self.tbt_s, self.model = d.running, d.tbt_s, model
        self.uniform_decode_s, self.profile = uniform_decode_s, profile


class EstimateCache:
    """Per-instance derived values, reused and edited between decisions (module doc). One per
    :class:`~mooncake_lite.scheduler.scheduler.Scheduler`; not thread-safe."""

    def __init__(self) -> None:
        # instance id -> (queue, model, its backlog)
        self._backlogs: dict[str, tuple[tuple, PrefillCostModel, Backlog]] = {}
        # instance id -> (running, incoming, their committed load)
        self._loads: dict[str, tuple[tuple, tuple, tuple[int, int]]] = {}
        self._profiles: dict[str, _Profiled] = {}

    def backlog(self, p: PrefillInstanceState, model: PrefillCostModel) -> Backlog:
        kept = self._backlogs.get(p.instance_id)
        if kept is not None and kept[0] is p.queue and kept[1] is model:
            return kept[2]
        backlog = backlog_of(p, model)    # a queue holds a few jobs: predicting them is cheap
        self._backlogs[p.instance_id] = (p.queue, model, backlog)
        return backlog

    def committed_load(self, d: DecodeInstanceState) -> tuple[int, int]:
        kept = self._loads.get(d.instance_id)
        if kept is not None and kept[0] is d.running and kept[1] is d.incoming:
            return kept[2]
        load = decode_load_now(d)
        self._loads[d.instance_id] = (d.running, d.incoming, load)
        return load

    def leave_profile(self, d: DecodeInstanceState, model: DecodeCostModel,
                      uniform_decode_s: float | None) -> LeaveProfile:
        kept = self._profiles.get(d.instance_id)
        if kept is None or kept.model is not model or kept.uniform_decode_s != uniform_decode_s:
            return self._keep(d, model, uniform_decode_s, leave_profile_of(d, model, uniform_decode_s))
        if kept.running is d.running and kept.tbt_s == d.tbt_s:
            return kept.profile
        profile = kept.profile
        same_tbt = pricing_tbt(d, model, uniform_decode_s) == profile.tbt_s
        change = batch_change(kept.running, d.running) if same_tbt else None
        if change is None:
            return self._keep(d, model, uniform_decode_s, leave_profile_of(d, model, uniform_decode_s))
        return self._keep(d, model, uniform_decode_s, _edited(profile, *change, uniform_decode_s))

    def _keep(self, d: DecodeInstanceState, model: DecodeCostModel, uniform_decode_s: float | None,
              profile: LeaveProfile) -> LeaveProfile:
        self._profiles[d.instance_id] = _Profiled(d, model, uniform_decode_s, profile)
        return profile


def batch_change(old: tuple[DecodingRequest, ...], new: tuple[DecodingRequest, ...]
                 ) -> tuple[list[DecodingRequest], tuple[DecodingRequest, ...]] | None:
    """(left, joined) such that ``new`` holds exactly ``old`` less ``left`` plus ``joined``.

    Cheap when ``new`` is ``old`` with some records taken out (the rest in order) and others
    appended — how an instance view edits its batch: each identical run is found by C
    iterators. Correct for any two batches (a record that moved counts as leaving and joining);
    None when more than MAX_EDITED_LEAVES records would leave."""
    left: list[DecodingRequest] = []
    i = j = 0                          # the next unmatched position in new, in old
    num_new, num_old = len(new), len(old)
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
