"""The scheduler's view of one prefill instance, kept current at its owner's events (the live
conductor's ``conductor/membership.py`` and the simulator's ``sim/nodes.py``): its FIFO queue as
the frozen state the scheduler reads, built once and handed out again until something it shows
changes (scheduler/view.py says the same of decode instances). No IO and no clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import NamedTuple

from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.scheduler.snapshot import Shown
from mooncake_lite.scheduler.state import PrefillInstanceState, QueuedPrefill

RECENT_ARRIVALS = 64   # the arrivals a job's chance of being passed is judged on (state.recent_uncached)
_new = tuple.__new__   # a NamedTuple without its constructor's Python frame (estimate.py)


class Reported(NamedTuple):
    """What a prefill instance reports about itself (registration, heartbeats)."""

    store_id: Hashable
    bandwidth_bytes_per_s: float | None
    cost: PrefillCostModel | None
    pack_tokens: int
    overtakes: int


class PricedRow(NamedTuple):
    """What the wide prefill table writes for ``state`` (``PrefillView.row``): the model its
    jobs are priced with, their total predicted work and the started head's (duration, start),
    None when no job has started."""

    state: PrefillInstanceState
    model: PrefillCostModel
    total_s: float
    started_head: tuple[float, float] | None


class PrefillView(Shown[PrefillInstanceState]):
    """A prefill instance's FIFO queue as the scheduler sees it. The owner says when a job
    starts (the conductor: when the one before it ends; the simulator: when it really does).

    Once a reader names the model it prices the queue with (:meth:`price_with`: the wide
    prefill table, with the cluster default for an instance without a model of its own), the
    view prices its jobs as they come, one job a forward: each job's predicted duration, and
    their running sum in execution order. Each state it builds is then published with its total
    and started head (``row``), so a snapshot's changed row costs no re-derivation."""

    def __init__(self, instance_id: str, store_id: Hashable, bandwidth_bytes_per_s: float | None = None,
                 cost: PrefillCostModel | None = None, pack_tokens: int = 0, overtakes: int = 0) -> None:
        self.instance_id = instance_id
        self._about = Reported(store_id, bandwidth_bytes_per_s, cost, pack_tokens, overtakes)
        self._jobs: dict[str, QueuedPrefill] = {}            # execution order
        self._queue: tuple[QueuedPrefill, ...] | None = ()   # _jobs as shown (None: show afresh)
        self._state = None
        self._default: PrefillCostModel | None = None   # the model a reader prices with, without one of its own
        self._model: PrefillCostModel | None = None     # what the jobs are priced with (None: not priced)
        self._durations: dict[str, float] = {}
        self._total: float | None = 0.0     # the durations' running sum (None: add them up again)
        self.row: PricedRow | None = None
        self.overtake_share = 1.0     # what the online correction learned (state.py; 1: the worst case)
        self.join_share = 0.0         # likewise (0: the forward as the queue stands)
        self.queue_scale = 1.0        # likewise (state.py; 1: the queue as its forwards price it)
        self._arrivals: deque[int] = deque(maxlen=RECENT_ARRIVALS)   # uncached tokens, as they came
        self._recent: tuple[int, ...] | None = ()     # the state's recent_uncached (None: sort afresh)
        self._learning = False                        # shown once a correction is: until then, the worst case
        self._reprice()

    def set_instance(self, store_id: Hashable, bandwidth_bytes_per_s: float | None,
                     cost: PrefillCostModel | None, pack_tokens: int = 0, overtakes: int = 0) -> None:
        """What the instance reports about itself (registration, heartbeats)."""
        about = Reported(store_id, bandwidth_bytes_per_s, cost, pack_tokens, overtakes)
        if about != self._about:
            self._about = about
            self._reprice()
            self._stale()

    def set_overtake_share(self, share: float, join_share: float | None = None) -> None:
        """The share of the overtake bound's worst case its jobs are predicted to meet (the
        owner's online correction, ``scheduler/correction.py``), and of the join allowance's
        (None: unchanged); from now on the state shows the recent arrivals' uncached tokens too."""
        join = self.join_share if join_share is None else join_share
        if share != self.overtake_share or join != self.join_share or not self._learning:
            self.overtake_share, self.join_share, self._learning, self._recent = share, join, True, None
            self._stale()

    def set_queue_scale(self, scale: float) -> None:
        """What the wait for the work queued ahead is multiplied by (the owner's online correction).
        The state shows a new queue tuple with it: the estimate cache keeps a backlog while its
        queue is the same object, and this is rare (a move past the tolerance)."""
        if scale != self.queue_scale:
            self.queue_scale, self._queue = scale, None
            self._stale()

    def note_arrival(self, uncached: int) -> None:
        """A new job with ``uncached`` tokens to compute was queued (``queue_order.enqueue``)."""
        self._arrivals.append(uncached)
        if self._learning:
            self._recent = None
            self._stale()

    def price_with(self, default: PrefillCostModel) -> None:
        """Price the queue with the instance's own model, else ``default``, from now on; the
        state shown keeps its place, its ``row`` made again."""
        if default is not self._default:
            self._default = default
            self._reprice()
            state = self._state
            self.row = self._row(state) if state is not None and self._model is not None else None

    def _reprice(self) -> None:
        """The model the jobs are priced with, after the instance's own or the default changed:
        one job a forward only (a packing instance's queue is priced by the estimate cache)."""
        about = self._about
        model = (about.cost or self._default) if about.pack_tokens == 0 else None
        if model is not self._model:
            self._model = model
            self._durations = {} if model is None else {rid: _priced(model, job) for rid, job in self._jobs.items()}
            self._total = None

    def add(self, request_id: str, num_tokens: int, num_prefix_tokens: int = 0,
            started_at: float | None = None, passed: int = 0, pack_cap: int = 0, ends_at: float | None = None) -> None:
        """Queue a job behind the others (or replace the job of that id where it stands);
        ``passed``: its overtakes so far (shortest-first order, ``scheduler/queue_order.py``);
        ``pack_cap``: the cap its decision set on its pack; ``ends_at``: a started job's end as
        priced when it started (``QueuedPrefill``)."""
        job = QueuedPrefill(request_id, num_tokens, num_prefix_tokens, started_at, passed, pack_cap, ends_at)
        replaced = self._jobs.get(request_id)
        self._jobs[request_id] = job
        if self._queue is not None:
            self._queue = (*self._queue, job) if replaced is None else None
        model = self._model
        if model is not None:
            self._durations[request_id] = duration = _priced(model, job)
            total = self._total    # as itertools.accumulate adds: the first job's, then last + next
            self._total = None if replaced is not None or total is None else \
                (total + duration if len(self._jobs) > 1 else duration)
        self._stale()

    def start(self, request_id: str, now: float) -> None:
        """The job started executing at ``now``."""
        job = self._jobs[request_id]
        if job.started_at != now:     # its constructor: dataclasses.replace takes twice as long, per request
            self._swap(job, QueuedPrefill(job.request_id, job.num_tokens, job.num_prefix_tokens, now, 0, job.pack_cap))

    def report_end(self, request_id: str, ends_at: float, now: float | None = None) -> bool:
        """The instance says the job it runs alone, ``request_id``, ends at ``ends_at`` (from the
        chunks it has run): priced to end then (``QueuedPrefill.reported_s``). Where this view
        has another job started or first, it is behind the instance (given ``now``: the live
        conductor): the instance's job is moved to the head, started ``now``, and the others wait
        (:meth:`_follow`). False, and nothing changes, for a job this view does not hold (another
        conductor's), or another than its started head without ``now``."""
        job = next(iter(self._jobs.values()), None)     # (execution order: the head first)
        if job is None or job.request_id != request_id or job.started_at is None:
            return now is not None and request_id in self._jobs and self._follow(request_id, ends_at, now)
        if job.ends_at != ends_at:
            self._swap(job, QueuedPrefill(job.request_id, job.num_tokens, job.num_prefix_tokens, job.started_at,
                                          job.passed, job.pack_cap, ends_at))
        return True

    def _follow(self, request_id: str, ends_at: float, now: float) -> bool:
        """The instance runs ``request_id`` alone where this view started another job (or none):
        the view had guessed its order from its own placements (the one after a job that ended
        starts), and the instance's differs where a burst reached it in another order than it was
        placed. Live on Zen 3 a view kept two 200-token prompts started for 28 s that the instance
        held behind four long jobs, and priced the requests after them 15 s where they waited
        1 s (docs/results/2026-12-01-zen3-admission.md §11)."""
        moved = self._jobs.pop(request_id)
        changed = {request_id: QueuedPrefill(moved.request_id, moved.num_tokens, moved.num_prefix_tokens, now,
                                             moved.passed, moved.pack_cap, ends_at)}
        for rid, job in self._jobs.items():      # the view's own started ones wait again
            if job.started_at is not None:
                changed[rid] = QueuedPrefill(rid, job.num_tokens, job.num_prefix_tokens, None, job.passed, job.pack_cap)
        self._jobs = {request_id: changed[request_id], **self._jobs}
        self._jobs.update(changed)               # (in place: the order stays the view's)
        self._queue = None
        if self._model is not None:              # only a report, given or dropped, moves a price
            self._durations.update((rid, _priced(self._model, job)) for rid, job in changed.items())
            self._total = None
        self._stale()
        return True

    def _swap(self, job: QueuedPrefill, new: QueuedPrefill) -> None:
        """``new`` in ``job``'s place (started, or its end reported); repriced only where a report
        comes or goes (a start alone leaves its duration as it was)."""
        self._jobs[job.request_id] = new
        queue = self._queue
        self._queue = (new, *queue[1:]) if queue and queue[0] is job else None
        if self._model is not None and (job.ends_at is not None or new.ends_at is not None):
            self._durations[job.request_id] = _priced(self._model, new)
            self._total = None
        self._stale()

    def remove(self, request_id: str) -> bool:
        """The job ended (or was aborted): False if there was none of that id."""
        job = self._jobs.pop(request_id, None)
        if job is None:
            return False
        queue = self._queue
        if queue is not None:
            self._queue = queue[1:] if queue[0] is job else tuple(q for q in queue if q is not job)
        if self._model is not None:
            del self._durations[request_id]
            self._total = None     # the sum from the new head: added up again at the next state
        self._stale()
        return True

    def clear(self) -> None:
        self._jobs.clear()
        self._queue = ()
        self._durations.clear()
        self._total = 0.0
        self._stale()

    def state(self) -> PrefillInstanceState:
        if self._state is None:
            if self._queue is None:
                self._queue = tuple(self._jobs.values())
            about = self._about
            self._state = state = PrefillInstanceState(self.instance_id, about.store_id, self._queue,
                                                       about.bandwidth_bytes_per_s, about.cost, about.pack_tokens,
                                                       about.overtakes, self.overtake_share, self._recent_uncached(),
                                                       self.spread, self.join_share, self.queue_scale)
            self.row = self._row(state) if self._model is not None else None
        return self._state

    def _recent_uncached(self) -> tuple[int, ...]:
        if not self._learning:
            return ()
        if self._recent is None:
            self._recent = tuple(sorted(self._arrivals))
        return self._recent

    def _row(self, state: PrefillInstanceState) -> PricedRow | None:
        """What the wide prefill table writes for ``state``; None with more than one job started
        (the table then derives the backlog)."""
        queue, durations, model = state.queue, self._durations, self._model
        assert model is not None, "called only while the jobs are priced"
        total = self._total
        if total is None:          # itertools.accumulate's order: the first job's, then + each next
            total = 0.0
            for i, job in enumerate(queue):
                total = total + durations[job.request_id] if i else durations[job.request_id]
            self._total = total
        if not queue or queue[0].started_at is None:
            return _new(PricedRow, (state, model, total, None))
        head = queue[0]
        if len(queue) > 1 and queue[1].started_at is not None:
            return None
        return _new(PricedRow, (state, model, total, (durations[head.request_id], head.started_at)))


def _priced(model: PrefillCostModel, job: QueuedPrefill) -> float:
    """A job's duration as the view prices it: what its instance reported of it, else ``model``'s."""
    reported = job.reported_s()
    return model.predict(job.num_tokens, job.num_prefix_tokens) if reported is None else reported
