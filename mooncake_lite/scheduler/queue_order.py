"""The order a prefill instance serves its queue in: FIFO, or shortest uncached prompt first
with a bound on overtakes. One rule for the instance (``prefill/service.py``), the conductor's
view of its queue (``conductor/membership.py``), the queue's pricing (``scheduler/prefill_select``)
and the simulator (``sim/nodes.py``). Pure, no IO.

The rule: a new job lands in the waiting part of the queue (behind the started jobs) by passing,
from the tail, each job whose uncached tokens are *strictly more* than its own and that has been
passed fewer than ``bound`` times; it stops at the first job it may not pass, and every job it
passed counts one overtake more. The waiting jobs are then served head first, in that order, and
packing (``costs.pack_sizes``) cuts its packs from the queue in that order. ``bound`` 0 never
passes anyone: FIFO exactly.

Why a count of overtakes and not a time slack: the queue is then a plain list whose order is
fixed at each arrival (later arrivals only ever insert; nobody is re-sorted at serve time), so
whoever knows the arrivals and their uncached tokens (the conductor does: it dispatched them)
rebuilds the instance's order with no clock. Up to two windows: concurrent requests may reach
the instance in another order than they were dispatched in, and the conductor starts the next
job at the first-token answer while the instance holds its turn until the KV stream ends. What
a job can still lose to overtakes is known when it arrives: at most ``bound`` later arrivals,
each shorter than it, so about ``bound`` times its own prefill (:func:`overtake_allowance`),
which the TTFT SLO admission adds to its price. With packing on that is no bound: later longer
arrivals that pass nobody still join the job's pack, cut when its leader starts, and an
overtaker can push it out of its pack (docs/prefill_decode.md §2b). A time slack would make the
order depend on when the server looks, which the conductor only knows to within a network delay.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from mooncake_lite.scheduler.costs import PrefillCostModel, pack_sizes, packed_seconds, uncached_tokens
from mooncake_lite.scheduler.packing import num_started, queue_caps
from mooncake_lite.scheduler.state import QueuedPrefill

FIFO = "fifo"
SHORTEST = "shortest"
ORDERS = (FIFO, SHORTEST)
# Overtakes a job allows in shortest-first order (--queue-overtakes). Its price grows by K times
# its own prefill (overtake_allowance), so under the default relative TTFT SLO (10x a prompt
# alone) it leaves (9 - K)x for the queue ahead: 4 keeps half of that, and the simulator puts the
# replay's p50 TTFT at 1.61 s against FIFO's 3.79 s (docs/operations.md §1, the queue order).
DEFAULT_OVERTAKES = 4


def landing(uncached: Sequence[int], passed: Sequence[int], first_waiting: int, new_uncached: int,
            bound: int) -> int:
    """Where a new job with ``new_uncached`` tokens to compute lands in a queue whose jobs (in
    serving order) have these uncached tokens and overtake counts, the first ``first_waiting``
    of them started (module doc); ``len(uncached)`` is the tail."""
    i = len(uncached)
    if bound <= 0:
        return i
    while i > first_waiting and uncached[i - 1] > new_uncached and passed[i - 1] < bound:
        i -= 1
    return i


def job_uncached(job: QueuedPrefill) -> int:
    return uncached_tokens(job.num_tokens, job.num_prefix_tokens)


def queue_landing(queue: Sequence[QueuedPrefill], new_uncached: int, bound: int) -> int:
    """:func:`landing` in a scheduler state's queue (started jobs first)."""
    return landing([job_uncached(j) for j in queue], [j.passed for j in queue], num_started(queue), new_uncached,
                   bound)


def priced(queue: Sequence[QueuedPrefill], model: PrefillCostModel, pack_tokens: int, bound: int,
           num_tokens: int, prefix_tokens: int, running_s: float | None = None) -> tuple[float, float]:
    """A new job in an instance's queue (execution order, started jobs first): (the seconds of
    the forwards before its own, from the queue's start, started ones counted whole; its own
    forward's seconds), with the packs cut in the new order (``pack_tokens`` > 0: the running
    jobs are one forward, the waiting ones cut by ``pack_sizes``; else one job a forward, as
    ``packing.packed_queue`` prices them). Overtakes after it are not in it:
    :func:`overtake_allowance`. ``running_s``: the started jobs' seconds as the backlog holds
    them, which what is done of them is counted against (a backlog keeps a started job's
    duration while the model moves on: priced anew, a job past its price still made the jobs
    landing behind it wait the difference, 0.55 s in a burst of short prompts on Zen 5)."""
    new = QueuedPrefill("", num_tokens, prefix_tokens)
    at = queue_landing(queue, job_uncached(new), bound)
    jobs = (*queue[:at], new, *queue[at:])
    running = num_started(queue)      # (the new job lands behind them)
    # Given the running jobs' seconds, they are not priced again: the count starts after them.
    skip = running if running_s is not None else 0
    predict = model.predict
    own = [predict(j.num_tokens, j.num_prefix_tokens) for j in jobs[skip:]]
    if pack_tokens > 0:
        waiting = jobs[running:]
        sizes = ([running] if running > skip else []) + pack_sizes([job_uncached(j) for j in waiting], pack_tokens,
                                                                   queue_caps(waiting))
    else:
        sizes = [1] * len(own)
    start = running_s if running_s is not None and skip else 0.0
    i, at = 0, at - skip
    for size in sizes:
        seconds = packed_seconds(own[i:i + size], model.shared_c0)
        if i <= at < i + size:
            return start, seconds
        start += seconds
        i += size
    raise AssertionError("the new job is in no pack")   # unreachable: the sizes cover every job


def landed_pack_tokens(queue: Sequence[QueuedPrefill], num_tokens: int, prefix_tokens: int, pack_tokens: int,
                       bound: int) -> int:
    """The uncached tokens of the pack a new job joins where it lands in ``queue`` (as
    :func:`priced` cuts it: the job with no cap of its own): what its own cap must let it keep."""
    new = QueuedPrefill("", num_tokens, prefix_tokens)
    at = queue_landing(queue, job_uncached(new), bound)
    running = num_started(queue)
    waiting = (*queue[running:at], new, *queue[at:])
    uncached = [job_uncached(j) for j in waiting]
    i = 0
    for size in pack_sizes(uncached, pack_tokens, queue_caps(waiting)):
        if i + size > at - running:
            return sum(uncached[i:i + size])
        i += size
    raise AssertionError("the new job is in no pack")   # unreachable: the sizes cover every job


def overtake_allowance(model: PrefillCostModel, bound: int, num_tokens: int, prefix_tokens: int,
                       share: float = 1.0, recent: Sequence[int] = ()) -> float:
    """What the later arrivals are predicted to add to a new job's wait: the most they may is
    ``bound`` of them, each with fewer uncached tokens, each counted at the job's own prefill
    (the cost model grows with the tokens computed; a shorter job behind a long cached prefix may
    cost a little more, through its attention over that prefix, and one packed beside it less).
    0 in FIFO order, and for a job nobody can be shorter than (1 token). Learned online
    (``scheduler/correction.py``), it is a share of that: ``recent`` (sorted uncached tokens of
    the last jobs queued) says how likely a later arrival is shorter than this job (a burst's
    shortest is passed by none, its longest by all it allows), and ``share`` how much of the rest
    its jobs met lately (a pass by a job that joins the same pack costs only that job's tokens).
    ``share`` 1 and no ``recent``: the worst case."""
    n = uncached_tokens(num_tokens, prefix_tokens)
    if bound <= 0 or n <= 1:
        return 0.0
    rank = bisect_left(recent, n) / len(recent) if recent else 1.0
    return share * rank * bound * model.predict(num_tokens, prefix_tokens)


def join_allowance(model: PrefillCostModel, pack_tokens: int, num_tokens: int, prefix_tokens: int,
                   share: float) -> float:
    """What later arrivals are predicted to add to a new job's forward by joining it: until its
    forward starts (the instance also takes along what reaches it while its head matches its
    prefix, so even a job on an idle instance) they join while the pack has room, each adding its
    own token terms. The most they may is the room left beside the job filled
    (``predict(room) - shared_c0``); ``share`` is how much of that its jobs met lately (learned online,
    ``scheduler/correction.py``; 0 until then: the forward as the queue stands)."""
    room = pack_tokens - uncached_tokens(num_tokens, prefix_tokens)
    if share <= 0.0 or room <= 0:
        return 0.0
    return share * max(model.predict(room) - model.shared_c0, 0.0)


def worst_cases(model: PrefillCostModel, bound: int, pack_tokens: int, num_tokens: int, prefix_tokens: int,
                recent: Sequence[int], queue_s: float, join_share: float) -> tuple[float, float]:
    """The worst cases (share 1) of the (overtake, join) allowances a job of this prompt was
    priced with, given the queue ``queue_s`` it was priced at and the join share then: what the
    correction sets the job's measured wait against (``scheduler/correction.py``; the live
    conductor and the simulator alike). A job priced with no queue but its join allowance
    started at once: it was priced for no overtakes (``prefill_select._packed``), so it has none
    to learn from. (0, 0) in FIFO order."""
    if bound <= 0:
        return 0.0, 0.0
    join = join_allowance(model, pack_tokens, num_tokens, prefix_tokens, 1.0)
    waited = queue_s > join_share * join * (1.0 + 1e-9) + 1e-12
    return (overtake_allowance(model, bound, num_tokens, prefix_tokens, 1.0, recent) if waited else 0.0), join


def bound_of(order: str, overtakes: int) -> int:
    """The overtake bound an instance serving in ``order`` registers (0: FIFO)."""
    if order not in ORDERS:
        raise ValueError(f"queue order must be one of {ORDERS}, got {order!r}")
    return overtakes if order == SHORTEST else 0


def enqueue(view, request_id: str, num_tokens: int, num_prefix_tokens: int, bound: int,
            started_at: float | None = None, pack_cap: int = 0, ends_at: float | None = None) -> tuple[str, ...]:
    """Queue a job on a :class:`~mooncake_lite.scheduler.view.PrefillView` where the rule lands
    it (the jobs it passes shown again behind it, one overtake more each); returns the request
    ids of the view's queue in the new order, or () where it simply went last (FIFO, or it
    passed nobody). The view's queue is the conductor's and the simulator's record of order.
    ``ends_at``: a job started now (``started_at``), when it is priced to end."""
    uncached = uncached_tokens(num_tokens, num_prefix_tokens)
    if bound <= 0 or started_at is not None:
        if bound > 0:
            view.note_arrival(uncached)
        view.add(request_id, num_tokens, num_prefix_tokens, started_at, 0, pack_cap,
                 ends_at if started_at is not None else None)
        return ()
    queue = view.state().queue
    at = queue_landing(queue, uncached, bound)
    view.note_arrival(uncached)   # after the state read: it makes the view's state stale
    behind = queue[at:]
    for job in behind:
        view.remove(job.request_id)
    view.add(request_id, num_tokens, num_prefix_tokens, None, 0, pack_cap)
    for job in behind:
        view.add(job.request_id, job.num_tokens, job.num_prefix_tokens, job.started_at, job.passed + 1, job.pack_cap)
    if not behind:
        return ()
    return tuple(job.request_id for job in view.state().queue)


def withdraw(view, request_id: str, passed_ids: Sequence[str]) -> None:
    """Take back a job the instance never heard of (its decode reservation failed): remove it
    from the view and give the overtake it took back to each job it passed (``passed_ids``:
    the ids behind it in :func:`enqueue`'s answer) that still waits, so a request the instance
    never saw does not use up its neighbours' allowance (nor twice, if it is dispatched again)."""
    view.remove(request_id)
    for job in view.state().queue:
        if job.request_id in passed_ids and job.started_at is None and job.passed > 0:
            view.add(job.request_id, job.num_tokens, job.num_prefix_tokens, None, job.passed - 1, job.pack_cap)
