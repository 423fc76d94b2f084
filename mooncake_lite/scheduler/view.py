"""The scheduler's view of one decode (here) or prefill (``prefill_view.py``, re-exported)
instance, kept current at its owner's events.

The live conductor (``conductor/membership.py``) and the simulator (``sim/nodes.py``) both say
what happened to an instance — a job queued, started or finished; a request committed to a
decode instance, joined its batch (its KV arrived), generated tokens, left — and ask
:meth:`PrefillView.state` / :meth:`DecodeView.state` for the frozen snapshot the scheduler
reads. A state is built once and returned again until something it shows changes, so an
unchanged instance hands the scheduler the very same object (and its estimate cache a hit).

Two things a decode state shows may trail the truth, by a bound, so that it is not rebuilt on
every token:

- contexts: the running requests together may have generated up to
  :func:`context_lag_bound` tokens beyond the contexts shown; past that the next state shows
  every request's context afresh;
- ``tbt_s``, the TBT the running requests' per-request t_d are sized with: re-read from the
  instance's cost model when the batch is shown afresh, and kept while requests join and leave
  as long as the batch's predicted TBT stays within ``MAX_TBT_DRIFT`` of it (so a join or leave
  re-prices only that request, and the estimate cache edits its leave profile instead of
  sorting it again).

A request with n sequences (OpenAI's ``n``: one prefill, then n sequences on the shared prompt
KV) is n records, each a batch slot attending to the whole context, as admission priced it
(``ScheduleRequest.num_sequences``): the first under its own id, choice i under
:func:`sequence_id`, the id its tokens progress; it commits, joins and leaves as one.

No IO and no clock: times are arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import inf
from typing import NamedTuple

from mooncake_lite.scheduler.costs import DecodeCostModel
from mooncake_lite.scheduler.estimate import CONTEXT_TOKENS
from mooncake_lite.scheduler.prefill_view import PrefillView   # (re-exported: the views' one import)
from mooncake_lite.scheduler.snapshot import Shown
from mooncake_lite.scheduler.state import DecodeInstanceState, DecodingRequest, IncomingRequest

# How many tokens a decode batch's running requests may have generated, in total, beyond the
# contexts its state shows: at least MAX_CONTEXT_LAG, and up to 1/64 of the batch's shown
# context. The cost model reads the batch's *total* context, so the bound is on the total: any
# predicted TBT (now or at a future time, for any subset of the batch) is off by at most 1/64
# of the batch's context term — far inside the cost model's own error — and a batch is shown
# afresh once per ~mean context / 64 steps instead of whenever its shortest request crosses a
# bound of its own.
MAX_CONTEXT_LAG = 32

# How far a decode batch's predicted TBT may move from the ``tbt_s`` its state shows before the
# view re-reads it: within this, one request joining or leaving (a few percent of the TBT)
# leaves every other member's t_d as it was — far inside the error of max_output_tokens as a
# stand-in for the output length.
MAX_TBT_DRIFT = 1 / 16


def sequence_id(request_id: str, index: int) -> str:
    """The record of a request's choice ``index`` (its own id for choice 0; the decode's key too)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def context_lag_bound(shown_context_tokens: int) -> int:
    """Tokens a decode batch whose state shows ``shown_context_tokens`` in total may have
    generated (summed over its running requests) beyond what the state shows."""
    return max(MAX_CONTEXT_LAG, shown_context_tokens >> 6)


class ShownLoad(NamedTuple):
    """A decode state and its load now (``DecodeView.load``: running + incoming), kept from the
    view's totals: what the wide decode table reads instead of summing the tuples again."""

    state: DecodeInstanceState | None
    batch_size: int
    context_tokens: int


_new = tuple.__new__   # a NamedTuple without its constructor's Python frame (estimate.py)
_NO_LOAD = ShownLoad(None, 0, 0)

__all__ = ["MAX_CONTEXT_LAG", "MAX_TBT_DRIFT", "DecodeView", "PrefillView", "ShownLoad", "context_lag_bound"]


def _position(records: tuple, record: object) -> int | None:
    """Where ``record`` itself (not an equal one) stands in ``records``; None if nowhere."""
    # An index loop: compiled (mypyc), one pointer compare an item, where a C-level chain of
    # iterators (compress, map, operator.is_) cost 11k instructions a simulated request more at
    # 128P/128D (callgrind); interpreted, a little slower than the chain, on a request's leaving only.
    if record is not None:
        for i in range(len(records)):
            if records[i] is record:
                return i
    return None


class _Running:
    """A request in the decode batch: its true context and the record the states show. In a
    step group (:meth:`DecodeView.enter_group`) its context is ``context_tokens`` plus the
    group's tokens since ``mark``, added in by :meth:`DecodeView._settle` before it is read."""

    __slots__ = ("request_id", "context_tokens", "joined_at", "max_output_tokens", "shown", "mark")

    def __init__(self, request_id: str, context_tokens: int, joined_at: float, max_output_tokens: int | None) -> None:
        self.request_id, self.context_tokens = request_id, context_tokens
        self.joined_at, self.max_output_tokens = joined_at, max_output_tokens
        self.shown: DecodingRequest | None = None
        self.mark: int | None = None       # the group's token count when it entered (None: not in it)

    def show(self, refresh: bool) -> DecodingRequest:
        """The record a state shows: built once; a refresh rebuilds it if the context moved."""
        shown = self.shown
        if shown is None or (refresh and shown.context_tokens != self.context_tokens):
            shown = self.shown = DecodingRequest(self.request_id, self.context_tokens, self.joined_at,
                                                 self.max_output_tokens)
        return shown


class DecodeView(Shown[DecodeInstanceState]):
    """A decode instance's running batch and incoming requests as the scheduler sees them.

    A request is ``commit``-ted when it is dispatched here (incoming: KV to come), ``join``-s
    when its KV has arrived (running; no longer incoming), ``progress``-es as it generates
    tokens, and ``leave``-s when it ends for any reason. The shown batch is edited at each
    event (joins appended, leaves taken out); contexts and ``tbt_s`` trail within the bounds
    of the module doc."""

    def __init__(self, instance_id: str, cost: DecodeCostModel | None = None,
                 max_batch_size: int | None = None, max_context_tokens: int | None = None) -> None:
        self.instance_id = instance_id
        self._cost = cost
        self._limits = (max_batch_size, max_context_tokens)
        self._jobs: dict[str, _Running] = {}
        self._incoming: dict[str, IncomingRequest] = {}
        self._running: tuple[DecodingRequest, ...] | None = None   # None: show the batch afresh
        self._incoming_shown: tuple[IncomingRequest, ...] | None = None
        self._shown_context = 0        # the shown batch's total context
        self._incoming_context = 0     # the incoming requests' total context
        self.load = _NO_LOAD     # the state last built and its load now, from the totals above
        self._context_lag = 0          # tokens generated beyond it
        self._is_context_stale = False   # the lag passed the bound: refresh at the next state
        self._tbt_s: float | None = None
        self._tbt_of: tuple | None = None   # the batch _tbt_s was last checked against
        self._state = None
        # The step group (a simulated engine's batch, whose members all step together): tokens
        # each member generated since the group began, and how many members are shown.
        self._group_tokens = 0
        self._group_shown = 0
        self._num_sequences: dict[str, int] = {}   # requests of n > 1 sequences: n
        self.tail = 1.0          # the TBT's tail its states show (Corrections.tail)
        # at most the fewest max_output_tokens incoming: lowered at a commit, never raised but
        # when none is left (a bound kept low costs a look-up in the load at t; too high, it would
        # count requests gone by t)
        self._shortest = inf

    def _ids(self, request_id: str) -> Iterable[str]:
        n = self._num_sequences.get(request_id)
        return (request_id,) if n is None else [sequence_id(request_id, i) for i in range(n)]

    def _set_sequences(self, request_id: str, num_sequences: int | None) -> None:
        if num_sequences is not None and num_sequences > 1:
            self._num_sequences[request_id] = num_sequences

    def set_limits(self, max_batch_size: int | None, max_context_tokens: int | None) -> None:
        if (max_batch_size, max_context_tokens) != self._limits:
            self._limits = (max_batch_size, max_context_tokens)
            self._stale()

    def set_tail(self, tail: float) -> None:
        """What the owner's online correction learned of this decode's TBT over its mean gap."""
        if tail != self.tail:
            self.tail = tail
            self._stale()

    @property
    def cost(self) -> DecodeCostModel | None:
        """The model its states carry (what :meth:`set_cost` was last told)."""
        return self._cost

    def set_cost(self, cost: DecodeCostModel | None) -> None:
        """A (re-)registration's cost model: the batch is shown afresh and its TBT re-read."""
        self._cost = cost
        self._running = self._incoming_shown = None
        self._stale()

    def commit(self, request_id: str, context_tokens: int, max_output_tokens: int | None = None,
               num_sequences: int = 1) -> None:
        """Dispatched here; its KV (``context_tokens`` of it) is still to come, for ``num_sequences``."""
        self._set_sequences(request_id, num_sequences)
        for sid in self._ids(request_id):
            self._commit(sid, context_tokens, max_output_tokens)

    def _commit(self, request_id: str, context_tokens: int, max_output_tokens: int | None) -> None:
        record = IncomingRequest(request_id, context_tokens, max_output_tokens)
        replaced = self._incoming.get(request_id)
        if max_output_tokens is not None and max_output_tokens < self._shortest:
            self._shortest = float(max_output_tokens)
        self._incoming[request_id] = record
        self._incoming_context += context_tokens if replaced is None else context_tokens - replaced.context_tokens
        if self._incoming_shown is not None:
            self._incoming_shown = (*self._incoming_shown, record) if replaced is None else None
        self._stale()

    def uncommit(self, request_id: str) -> bool:
        """No longer incoming (its KV arrived, or it ended first); False if it was not."""
        record = self._incoming.pop(request_id, None)
        if record is None:
            return False
        self._incoming_context -= record.context_tokens
        if not self._incoming:
            self._shortest = inf
        shown = self._incoming_shown
        if shown is not None:
            i = _position(shown, record)
            self._incoming_shown = shown[:i] + shown[i + 1:] if i is not None else shown
        self._stale()
        return True

    def join(self, request_id: str, context_tokens: int, joined_at: float,
             max_output_tokens: int | None = None, num_sequences: int | None = None) -> None:
        """Its KV arrived: it runs in the batch from ``joined_at`` (and is no longer incoming);
        ``num_sequences``: as committed when None."""
        self._set_sequences(request_id, num_sequences)
        for sid in self._ids(request_id):
            self._join(sid, context_tokens, joined_at, max_output_tokens)

    def _join(self, request_id: str, context_tokens: int, joined_at: float, max_output_tokens: int | None) -> None:
        if request_id in self._incoming:   # (the simulator uncommits first: no call per request)
            self.uncommit(request_id)
        old = self._jobs.get(request_id)
        if old is not None:
            self._unshow(old)
            self._leave_group(old)
        job = self._jobs[request_id] = _Running(request_id, context_tokens, joined_at, max_output_tokens)
        if old is None and self._running is not None:
            shown = job.show(False)
            self._shown_context += shown.context_tokens
            self._running = (*self._running, shown)
        else:
            self._running = None
        self._stale()

    def progress(self, request_id: str, num_tokens: int = 1) -> bool:
        """It generated ``num_tokens`` more; True when that makes the next state differ (the
        batch ran further ahead of the one shown than the lag bound allows)."""
        job = self._jobs.get(request_id)
        if job is None:
            return False
        job.context_tokens += num_tokens
        if job.shown is None:          # its record, still to be built, will show it all
            return False
        self._context_lag += num_tokens
        return self._check_lag()

    def progress_each(self, request_ids: Iterable[str], num_tokens: int) -> bool:
        """Each of them generated ``num_tokens`` more (the batch ran that many steps): as
        :meth:`progress` for each, the lag checked once."""
        jobs, shown = self._jobs, 0
        for request_id in request_ids:
            job = jobs[request_id]
            job.context_tokens += num_tokens
            if job.shown is not None:
                shown += 1
        self._context_lag += shown * num_tokens
        return self._check_lag()

    def enter_group(self, request_id: str) -> None:
        """It steps with the group from now on (a simulator's engine batch: it joined at a step
        boundary), until it leaves."""
        job = self._jobs[request_id]
        if job.mark is None:
            job.mark = self._group_tokens
            self._group_shown += job.shown is not None

    def progress_group(self, num_tokens: int) -> bool:
        """Every member of the group generated ``num_tokens`` more: :meth:`progress_each` of the
        members, in O(1) — each member's context catches up when it is next read."""
        self._group_tokens += num_tokens
        self._context_lag += self._group_shown * num_tokens
        return self._check_lag()

    def _settle(self, job: _Running) -> None:
        """Add the group's tokens since its mark to a member's context (before it is read)."""
        if job.mark is not None:
            job.context_tokens += self._group_tokens - job.mark
            job.mark = self._group_tokens

    def _leave_group(self, job: _Running) -> None:
        if job.mark is not None:
            job.mark = None
            self._group_shown -= job.shown is not None

    def leave(self, request_id: str) -> bool:
        """It ended (finished, failed, aborted), running or incoming; False if it was neither."""
        ids = self._ids(request_id)
        self._num_sequences.pop(request_id, None)
        return any([self._leave(sid) for sid in ids])

    def _leave(self, request_id: str) -> bool:
        was_incoming = request_id in self._incoming and self.uncommit(request_id)
        job = self._jobs.pop(request_id, None)
        if job is None:
            return was_incoming
        self._unshow(job)
        self._leave_group(job)
        self._check_lag()              # a smaller batch allows less lag
        running = self._running
        if running is not None:
            # a shown batch holds each job's own record once: cut it out by position
            i = _position(running, job.shown)
            self._running = running[:i] + running[i + 1:] if i is not None else \
                tuple(r for r in running if r.request_id != request_id)
        self._stale()
        return True

    def clear(self) -> None:
        """Nothing runs or comes here any more (the instance died)."""
        self._jobs.clear()
        self._incoming.clear()
        self._num_sequences.clear()
        self._shown_context = self._context_lag = self._group_shown = self._incoming_context = 0
        self._is_context_stale = False
        self._running = self._incoming_shown = None
        self._shortest = inf
        self._stale()

    def state(self) -> DecodeInstanceState:
        if self._state is None:
            self._state = state = self._build()
            self.load = _new(ShownLoad, (state, len(state.running) + len(state.incoming),
                                         self._shown_context + self._incoming_context))
        return self._state

    def _build(self) -> DecodeInstanceState:
        refresh, self._is_context_stale = self._is_context_stale, False
        afresh = self._running is None or refresh
        if afresh:
            self._show_batch(refresh)
            if self._context_lag > context_lag_bound(self._shown_context):
                self._show_batch(True)     # e.g. lag carried over a re-registration
        running = self._running
        assert running is not None, "a batch not shown is shown afresh above"
        if self._incoming_shown is None:
            self._incoming_shown = tuple(self._incoming.values())
        max_batch, max_context = self._limits
        return DecodeInstanceState(self.instance_id, running, max_batch, max_context, self._cost,
                                   self._incoming_shown, self._shown_tbt(running, afresh), self.spread, self.tail,
                                   self._shortest)

    def _show_batch(self, refresh: bool) -> None:
        jobs = self._jobs.values()
        group_tokens = self._group_tokens
        for job in jobs:               # _settle, written out
            if job.mark is not None:
                job.context_tokens += group_tokens - job.mark
                job.mark = group_tokens
        self._running = tuple(job.show(refresh) for job in jobs)
        # every job is shown now: the group's shown members are all its members
        self._group_shown = sum(job.mark is not None for job in jobs)
        self._shown_context = sum(map(CONTEXT_TOKENS, self._running))
        self._context_lag = sum(job.context_tokens for job in jobs) - self._shown_context

    def _shown_tbt(self, running: tuple[DecodingRequest, ...], afresh: bool) -> float | None:
        """The batch's predicted TBT when shown afresh or once it drifted past MAX_TBT_DRIFT;
        else the one shown before. None without a cost model (the scheduler then uses the
        cluster default's prediction for the batch as it is)."""
        if self._cost is None:
            return None
        if afresh or self._tbt_s is None or self._tbt_of is not running:
            tbt = self._cost.predict(len(running), self._shown_context)
            if afresh or self._tbt_s is None or abs(tbt - self._tbt_s) > self._tbt_s * MAX_TBT_DRIFT:
                self._tbt_s = tbt
            self._tbt_of = running
        return self._tbt_s

    def _unshow(self, job: _Running) -> None:
        """Take a leaving job's shown context and lag out of the totals."""
        if job.shown is not None:
            self._settle(job)
            self._shown_context -= job.shown.context_tokens
            self._context_lag -= job.context_tokens - job.shown.context_tokens

    def _check_lag(self) -> bool:
        bound = self._shown_context >> 6       # context_lag_bound, written out (twice a request)
        if not self._is_context_stale and self._context_lag > (bound if bound > MAX_CONTEXT_LAG else MAX_CONTEXT_LAG):
            self._is_context_stale = True
            self._stale()
            return True
        return False
