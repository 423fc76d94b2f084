"""Shortest-first prefill queue order (scheduler/queue_order.py): the rule's bound, FIFO at bound
0, a new request's price equal to where the rule lands it on the view the conductor keeps, and
the scheduler's TTFT carrying the overtakes the bound allows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     PrefillCostModel, PrefillInstanceState, QueuedPrefill, ScheduleRequest,
                                     Scheduler, SchedulerConfig)
from mooncake_lite.scheduler.estimate import backlog_of
from mooncake_lite.scheduler.queue_order import (bound_of, enqueue, join_allowance, landing, overtake_allowance, priced,
                                                 queue_landing, worst_cases)
from mooncake_lite.scheduler.view import PrefillView

MODEL = PrefillCostModel(c0=0.05, c1=1e-3, c2=1e-7, c3=1e-5)
COSTS = CostModels(MODEL, DecodeCostModel(c0=0.01, c1=1e-3), kv_bytes_per_token=64)

# a history: each step either a new job of that many tokens arrives, or (None) the head is served
HISTORY = st.lists(st.one_of(st.integers(1, 600), st.none()), max_size=30)


def _replay(history, bound: int) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """The order jobs are served in under the rule (a server taking the head whenever told),
    with each job's arrival number and its uncached tokens."""
    view, arrival, tokens, served = PrefillView("p", "s"), {}, {}, []
    for step in history:
        if step is None:
            queue = view.state().queue
            if queue:
                served.append(queue[0].request_id)
                view.remove(queue[0].request_id)
            continue
        rid = f"r{len(arrival)}"
        arrival[rid], tokens[rid] = len(arrival), step
        enqueue(view, rid, step, 0, bound)
    served += [j.request_id for j in view.state().queue]
    return served, arrival, tokens


@settings(max_examples=80, deadline=None)
@given(HISTORY, st.integers(0, 5))
def test_no_job_is_passed_more_than_the_bound_and_only_by_shorter_later_jobs(history, bound):
    served, arrival, tokens = _replay(history, bound)
    position = {rid: i for i, rid in enumerate(served)}
    for rid in served:
        overtakers = [o for o in served if arrival[o] > arrival[rid] and position[o] < position[rid]]
        assert len(overtakers) <= bound
        assert all(tokens[o] < tokens[rid] for o in overtakers)


@settings(max_examples=40, deadline=None)
@given(HISTORY)
def test_bound_zero_is_fifo(history):
    served, arrival, _ = _replay(history, 0)
    assert served == sorted(served, key=arrival.__getitem__)


def test_a_burst_is_served_shortest_first_within_the_bound():
    served, _, _ = _replay([500, 400, 300, 200, 100], 4)
    assert served == ["r4", "r3", "r2", "r1", "r0"]
    # bound 2: r0 has been passed twice when r3 comes, so r3 and r4 (which passes r3) stay behind it
    served, _, _ = _replay([500, 400, 300, 200, 100], 2)
    assert served == ["r2", "r1", "r0", "r4", "r3"]
    assert landing([500, 400], [2, 2], 0, 100, 2) == 2 and landing([500, 400], [2, 1], 0, 100, 2) == 1


def test_started_jobs_are_never_passed_nor_equal_ones():
    queue = (QueuedPrefill("a", 500, 0, 0.0), QueuedPrefill("b", 300), QueuedPrefill("c", 300))
    assert queue_landing(queue, 100, 4) == 1
    assert queue_landing(queue, 300, 4) == 3      # ties keep arrival order
    assert queue_landing(queue, 100, 0) == 3


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(0, 3)), max_size=8), st.integers(1, 600),
       st.integers(0, 3), st.booleans(), st.sampled_from([0, 256, 512]))
def test_a_new_requests_price_is_its_finish_where_the_rule_lands_it(jobs, n, bound, started, pack):
    """priced() before the arrival == the finish time the queue's own pricing gives the job once
    the rule has queued it (no later arrival): the conductor prices what the instance will do."""
    view = PrefillView("p", "s", pack_tokens=pack, overtakes=bound)
    for i, (tokens, _) in enumerate(jobs):
        enqueue(view, f"j{i}", tokens, 0, bound, 0.0 if started and i == 0 else None)
    before = view.state()
    start, own = priced(before.queue, MODEL, pack, bound, n, 0)
    enqueue(view, "new", n, 0, bound)
    after = view.state()
    finish = backlog_of(after, MODEL).cumulative_s[[j.request_id for j in after.queue].index("new")]
    assert start + own == pytest.approx(finish)


def test_the_scheduler_prices_a_long_request_with_the_overtakes_its_bound_allows():
    queue = (QueuedPrefill("a", 400, 0, 0.0), QueuedPrefill("b", 300))
    cfg = SchedulerConfig(block_size=16)
    decode = DecodeInstanceState("d")

    def ttft(num_tokens: int, overtakes: int):
        state = ClusterState((PrefillInstanceState("p", "s", queue, overtakes=overtakes),), (decode,))
        req = ScheduleRequest("x", (), num_tokens, 8)
        return Scheduler(cfg, COSTS, BlockIndex()).schedule(req, state, now=0.0).predicted_queue_s

    fifo = MODEL.predict(400) + MODEL.predict(300)
    assert ttft(100, 0) == pytest.approx(fifo)
    # shortest first: the short one passes b, and allows 4 shorter ones after it
    assert ttft(100, 4) == pytest.approx(MODEL.predict(400) + 4 * MODEL.predict(100))
    # a long one lands last and is priced with 4 overtakes of at most its own size
    assert ttft(500, 4) == pytest.approx(fifo + overtake_allowance(MODEL, 4, 500, 0))
    assert overtake_allowance(MODEL, 4, 500, 0) == pytest.approx(4 * MODEL.predict(500))


def test_a_job_that_starts_at_once_is_priced_for_no_overtakes_and_learns_none():
    """Nobody can pass a job an idle instance starts at once: its price holds no allowance, and
    the worst cases the correction sets its wait against say so (queue_order.worst_cases); a job
    that waits behind a running one is priced for them."""
    cfg, decode = SchedulerConfig(block_size=16), DecodeInstanceState("d")

    def queue_s(queue):
        state = ClusterState((PrefillInstanceState("p", "s", queue, overtakes=4),), (decode,))
        return Scheduler(cfg, COSTS, BlockIndex()).schedule(ScheduleRequest("x", (), 500, 8), state, 0.0) \
            .predicted_queue_s
    assert queue_s(()) == 0.0
    running = (QueuedPrefill("a", 400, 0, 0.0),)
    assert queue_s(running) == pytest.approx(MODEL.predict(400) + overtake_allowance(MODEL, 4, 500, 0))
    full = overtake_allowance(MODEL, 4, 500, 0)
    assert worst_cases(MODEL, 4, 0, 500, 0, (), 0.0, 0.0) == (0.0, 0.0)
    assert worst_cases(MODEL, 4, 0, 500, 0, (), 1.0, 0.0) == (pytest.approx(full), 0.0)
    assert worst_cases(MODEL, 0, 512, 500, 0, (), 1.0, 0.0) == (0.0, 0.0)      # FIFO: none
    join = join_allowance(MODEL, 512, 100, 0, 1.0)
    assert join > 0 and worst_cases(MODEL, 4, 512, 100, 0, (), 0.5 * join, 0.5) == (0.0, pytest.approx(join))


def test_bound_of_an_order():
    assert bound_of("fifo", 4) == 0 and bound_of("shortest", 4) == 4
    with pytest.raises(ValueError):
        bound_of("longest", 1)


def test_the_overtake_share_scales_the_allowance_in_the_price_and_the_view_shows_it():
    queue = (QueuedPrefill("a", 400, 0, 0.0), QueuedPrefill("b", 300))
    view = PrefillView("p", "s", None, None, 0, 4)
    for job in queue:
        view.add(job.request_id, job.num_tokens, job.num_prefix_tokens, job.started_at)
    worst = view.state()
    view.set_overtake_share(0.25)
    learned = view.state()
    assert worst.overtake_share == 1.0 and learned.overtake_share == 0.25 and learned is not worst
    req = ScheduleRequest("x", (), 500, 8)

    def queue_s(state):
        cluster = ClusterState((state,), (DecodeInstanceState("d"),))
        scheduler = Scheduler(SchedulerConfig(block_size=16), COSTS, BlockIndex())
        return scheduler.schedule(req, cluster, 0.0).predicted_queue_s

    full = overtake_allowance(MODEL, 4, 500, 0)
    assert overtake_allowance(MODEL, 4, 500, 0, 0.25) == pytest.approx(full / 4)
    assert queue_s(worst) - queue_s(learned) == pytest.approx(0.75 * full)


def test_the_queue_scale_scales_the_wait_ahead_not_the_allowance_nor_the_forward():
    """``queue_scale`` (the correction's queue factor, shown by the view) prices the work queued
    ahead of a job; the overtake allowance is its share's, and the job's own forward its model's."""
    queue = (QueuedPrefill("a", 400, 0, 0.0), QueuedPrefill("b", 300))
    view = PrefillView("p", "s", None, None, 0, 4)
    for job in queue:
        view.add(job.request_id, job.num_tokens, job.num_prefix_tokens, job.started_at)
    view.set_overtake_share(0.5)
    plain = view.state()
    view.set_queue_scale(0.6)
    scaled_state = view.state()
    assert scaled_state.queue_scale == 0.6 and scaled_state is not plain
    req = ScheduleRequest("x", (), 500, 8)

    def decision(state):
        cluster = ClusterState((state,), (DecodeInstanceState("d"),))
        return Scheduler(SchedulerConfig(block_size=16), COSTS, BlockIndex()).schedule(req, cluster, 0.0)

    before, after = decision(plain), decision(scaled_state)
    wait = MODEL.predict(400) + MODEL.predict(300)
    allowance = overtake_allowance(MODEL, 4, 500, 0, 0.5)
    assert before.predicted_queue_s == pytest.approx(wait + allowance)
    assert after.predicted_queue_s == pytest.approx(0.6 * wait + allowance)
    assert after.predicted_prefill_s == pytest.approx(before.predicted_prefill_s)


def test_once_learning_a_job_is_priced_by_how_likely_later_arrivals_are_shorter():
    full = overtake_allowance(MODEL, 4, 500, 0)
    recent = (100, 200, 300, 600)       # a quarter of the recent arrivals were longer than 500
    assert overtake_allowance(MODEL, 4, 500, 0, 0.5, recent) == pytest.approx(0.5 * 0.75 * full)
    assert overtake_allowance(MODEL, 4, 50, 0, 1.0, recent) == 0.0     # the shortest: nobody passes it
    view = PrefillView("p", "s", None, None, 0, 4)
    for i, n in enumerate(recent):
        enqueue(view, f"r{i}", n, 0, 4)
    assert view.state().recent_uncached == ()          # not learning: the worst case, as before
    view.set_overtake_share(1.0)
    assert view.state().recent_uncached == recent and view.state().overtake_share == 1.0
    enqueue(view, "r4", 150, 0, 4)
    assert view.state().recent_uncached == (100, 150, 200, 300, 600)


@pytest.mark.parametrize("pack_tokens", [0, 512])
def test_a_started_job_past_its_price_makes_nobody_wait_whatever_the_model_says_now(pack_tokens):
    """What is done of a started job is counted against the duration its backlog holds; where it
    lands behind that job a new job is priced against the same duration, not the job priced anew
    by the model of the moment (a 3,770-token prompt past its price, re-priced dearer, made a
    burst of short prompts behind it wait the difference: 0.55 s, on Zen 5)."""
    from mooncake_lite.scheduler.costs import packed_seconds
    from mooncake_lite.scheduler.estimate import queues_at
    from mooncake_lite.scheduler.prefill_select import _packed
    dearer = PrefillCostModel(c0=0.06, c1=1.2e-3, c2=1.2e-7, c3=1e-5)
    state = PrefillInstanceState("p", "s", queue=(QueuedPrefill("long", 3000, 0, 0.0), QueuedPrefill("b", 300)),
                                 cost=MODEL, pack_tokens=pack_tokens, overtakes=4)
    backlog = backlog_of(state, MODEL)
    queue_s = queues_at([backlog], now=100.0).queue_s[0]           # the long job is long overdue
    assert queue_s == pytest.approx(MODEL.predict(300))
    wait, own = _packed(ScheduleRequest("x", (), 40, 8), dearer, queue_s, 0, backlog, state)
    first = [dearer.predict(40)] + ([dearer.predict(300)] if pack_tokens else [])   # packed with "b" if it packs
    assert wait == 0.0 and own == pytest.approx(packed_seconds(first, dearer.c0))   # lands first: starts now
    wait, _ = _packed(ScheduleRequest("y", (), 500, 8), dearer, queue_s, 0, backlog, state)
    behind_b = dearer.predict(300)        # lands behind "b": waits for b's forward, as priced now
    assert wait == pytest.approx(behind_b + overtake_allowance(dearer, 4, 500, 0, 1.0))
