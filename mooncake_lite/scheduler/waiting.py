"""A prefill instance's waiting list, and the record that rebuilds it. Pure, no IO.

The instance (``prefill/turns.py``) lands each job with :func:`land` — the queue order's rule
(``queue_order.landing``) behind the started jobs, a continuation ahead of every new request
(issue #37) — and notes every change of the list in a :class:`TurnRecord` on the host's monotonic
clock (``GET /v1/timeline``'s ``turns``). :func:`replay` rebuilds the list from that record by the
same rule, so an offline reader knows the queue the instance really had at any moment, each job's
overtakes included, and can land one more job in it: ``bench fidelity`` judges a refused request
so (``bench/fidelity/recorded.py``). Without the record that order had to be guessed from the
client's send times, and a burst's order on the instance was not on the client's clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mooncake_lite.scheduler.queue_order import landing

# The record's events: (monotonic time, kind, request id, uncached tokens, continuation, where its
# conductor placed it: [conductor, number] or None; a record from before that field has five).
LAND = "land"        # a job joined the list where ``land`` put it
HOLD = "hold"        # a placeholder took the tail (``TurnTaking.hold``: tests)
START = "start"      # a pack's leader chose a waiting job: it stays, started, at the head
UNSTART = "unstart"  # ... and gave it back (the leader failed before serving it)
GRANT = "grant"      # the job left the list holding the instance
LEAVE = "leave"      # the job left the list without its turn (aborted, cancelled)
FREE = "free"        # the instance was given back
RECORD_LEN = 8192    # events kept, newest: about 2,000 requests


def land(waiting: list, job, bound: int, started: Callable[[object], bool]) -> int:
    """Insert ``job`` (``expected_uncached``, ``passed``, ``is_continuation``, ``placed``,
    ``overtook``, ``counted``) into ``waiting`` (its serving order) behind every ``started`` one and
    the continuations after them: a continuation there (its client is mid-answer: a priority, not
    an overtake), a new job where ``queue_order.landing`` puts it, each job it passed counting one
    overtake more, as its conductor placed them (:func:`placed_after`). Returns its index.

    The waiting jobs its conductor placed after it, which reached the instance first, step back
    and land again behind it, in their placed order. Counting overtakes in the placed order was
    not enough: a later-placed job that arrived first took the last pass over a long job that
    the conductor had given an earlier-placed one. Live on Zen 3 a 64-token prompt priced 2.2 s,
    placed third of its burst, reached the instance after a 300-token one placed fifth, which
    took the last pass over three waiting jobs; the 64-token one waited 10.9 s behind them, and a
    198-token one 27 s where priced 5.7 s (docs/results/2026-12-01-zen3-admission.md §12)."""
    first = 0
    for i, other in enumerate(waiting):
        if started(other):
            first = i + 1
    while first < len(waiting) and waiting[first].is_continuation:
        first += 1
    if job.is_continuation:
        waiting.insert(first, job)
        return first
    early = [o for o in waiting[first:] if not o.is_continuation and placed_after(o, job)]
    for other in early:
        _unland(waiting, other)
    _land_one(waiting, job, first, bound)
    for other in sorted(early, key=_placed_number):
        _land_one(waiting, other, first, bound)
    return next(i for i, other in enumerate(waiting) if other is job)


def _land_one(waiting: list, job, first: int, bound: int) -> None:
    at = landing([j.expected_uncached for j in waiting], [j.passed for j in waiting], first,
                 job.expected_uncached, bound)
    job.overtook = tuple(other for other in waiting[at:] if not placed_after(other, job))
    for other in job.overtook:
        other.passed += 1
    # and the reverse: shorter jobs placed after it that stand ahead of it (started, or landed
    # where it could not pass them), each an overtake in its conductor's order
    job.counted = sum(placed_after(other, job) and other.expected_uncached < job.expected_uncached
                      for other in waiting[first:at])
    job.passed += job.counted
    waiting.insert(at, job)


def _unland(waiting: list, job) -> None:
    """Take ``job`` out as if it had not landed: the overtakes its landing counted, undone."""
    waiting.remove(job)
    for other in job.overtook:
        other.passed -= 1
    job.passed -= job.counted
    job.overtook, job.counted = (), 0


def _placed_number(job) -> int:
    return job.placed[1]


def placed_after(a, b) -> bool:
    """Whether the same conductor placed ``a`` after ``b`` (``PrefillRequest.placed``). A burst's
    requests travel side by side and reach the instance in another order than placed; the
    conductor's view lands them in its own order. So ``b`` passing ``a`` here is no overtake (the
    conductor counted none), and a shorter ``a`` already ahead when ``b`` lands is one (the
    conductor counted it). Counted by arrival alone, live on Zen 3 a 2,724-token job's passes ran
    out at the instance while the conductor still let shorter prompts pass it (two waited 30 s
    where priced 3 s), and in another run a job the conductor saw passed four times had been
    passed twice, and ten prompts were refused on a queue of 28-48 s that the instance served in
    1-3 s (docs/results/2026-12-01-zen3-admission.md §11)."""
    pa, pb = a.placed, b.placed
    return pa is not None and pb is not None and pa[0] == pb[0] and pa[1] > pb[1]


class TurnRecord:
    """The newest changes of a waiting list (module doc), bounded."""

    def __init__(self, maxlen: int = RECORD_LEN, clock: Callable[[], float] = time.monotonic) -> None:
        self.events: deque[tuple[float, str, str, int, bool, tuple[str, int] | None]] = deque(maxlen=maxlen)
        self._clock = clock

    def note(self, kind: str, request_id: str = "", uncached: int = 0, continuation: bool = False,
             placed: tuple[str, int] | None = None) -> None:
        self.events.append((self._clock(), kind, request_id, uncached, continuation, placed))


@dataclass(eq=False)
class Entry:
    """A job of a replayed list."""
    request_id: str
    expected_uncached: int
    is_continuation: bool = False
    passed: int = 0
    started: bool = False
    placed: tuple[str, float] | None = None
    overtook: tuple = ()       # what its landing counted (land)
    counted: int = 0


@dataclass(frozen=True)
class Replayed:
    """What :func:`replay` found: grants whose job was the replayed list's head, of all grants of a
    job it knew (a record that lost its start knows fewer); when the added job got its turn (None:
    not within the record, or none added)."""
    agreed: int
    grants: int
    turn_s: float | None


@dataclass(frozen=True)
class Added:
    """A job landed in a record that did not have it: ``uncached`` tokens at ``at_s``, before the
    record's event ``index`` (None: after every event up to ``at_s``); ``placed``: where its
    conductor placed it (:func:`placed_after` orders it among the record's jobs as :func:`land`
    orders theirs; a number between two of theirs: it fell between them)."""
    at_s: float
    uncached: int
    index: int | None = None
    placed: tuple[str, float] | None = None

    def position(self, events: Sequence[Sequence]) -> int:
        if self.index is not None:
            return self.index
        return next((i for i, e in enumerate(events) if e[0] > self.at_s), len(events))


def replay(events: Iterable[Sequence], bound: int, added: Added | None = None) -> Replayed:
    """Rebuild the waiting list from ``events`` (a :class:`TurnRecord`'s, oldest first); with
    ``added``, one more job landed in it, its turn the first moment it heads the list with the
    instance free. The jobs behind it keep the turns they had (what it would have delayed is not
    its own TTFT)."""
    events = list(events)
    waiting: list[Entry] = []
    busy, agreed, grants, turn_s = False, 0, 0, None
    extra = Entry("", added.uncached, placed=added.placed) if added is not None else None
    at = added.position(events) if added is not None else -1
    for i, event in enumerate([*events, None]):
        if i == at:
            land(waiting, extra, bound, _started)
            turn_s = _turn(waiting, extra, busy, added.at_s, turn_s)
        if event is None:
            break
        t, kind, rid, uncached, continuation = event[:5]
        if kind == LAND:
            placed = tuple(event[5]) if len(event) > 5 and event[5] else None
            land(waiting, Entry(rid, uncached, bool(continuation), placed=placed), bound, _started)
        elif kind == HOLD:
            waiting.append(Entry(rid, 0))
        elif kind in (START, UNSTART):
            for e in _find(waiting, rid):
                e.started = kind == START
        elif kind in (GRANT, LEAVE):
            found = _find(waiting, rid)
            if kind == GRANT:
                busy = True
                if found:
                    grants += 1
                    agreed += _head(waiting) is found[0]
            for e in found:
                waiting.remove(e)
        elif kind == FREE:
            busy = False
            turn_s = _turn(waiting, extra, busy, t, turn_s)
    return Replayed(agreed, grants, turn_s)


def _started(e: Entry) -> bool:
    return e.started


def _find(waiting: Sequence[Entry], rid: str) -> list[Entry]:
    return [e for e in waiting if e.request_id == rid and e.request_id]


def _head(waiting: Sequence[Entry]) -> Entry | None:
    """The job a grant goes to: the first one (the added job skipped: the instance did not see it)."""
    return next((e for e in waiting if e.request_id), None)


def _turn(waiting: list[Entry], added: Entry | None, busy: bool, t: float, turn_s: float | None) -> float | None:
    """The added job's turn: at ``t`` if it heads the list and the instance is free (it then
    leaves the list: the instance is its own from then on, in this counterfactual)."""
    if turn_s is not None or added is None or busy or not waiting or waiting[0] is not added:
        return turn_s
    waiting.remove(added)
    return t
