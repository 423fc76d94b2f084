"""Event queue ordering and the aggregate-step batch bookkeeping."""

from __future__ import annotations

import pytest

from mooncake_lite.sim.events import EventQueue
from mooncake_lite.sim.request import fold_gaps, slowest_share_mean


@pytest.mark.parametrize("checked", [False, True])
def test_events_run_in_time_order_fifo_on_ties(checked):
    q = EventQueue()
    seen, steps = [], []

    def h(t, tag):
        seen.append((t, tag))
        if tag == "a":
            q.push(t + 1.0, h, "c")   # pushed during the run
            q.push(t, h, "a-same-time")

    q.push(2.0, h, "b")
    q.push(1.0, h, "a")
    q.push(2.0, h, "b2")
    if checked:       # the loop with a callback (and a limit), vs the one run to the end
        q.run(until=10.0, on_step=steps.append)
    else:
        q.run()
    assert seen == [(1.0, "a"), (1.0, "a-same-time"), (2.0, "b"), (2.0, "b2"), (2.0, "c")]
    assert q.num_events == 5 and q.now == 2.0
    assert steps == ([1.0, 1.0, 2.0, 2.0, 2.0] if checked else [])
    with pytest.raises(ValueError, match="past"):
        q.push(1.5, h, "late")


@pytest.mark.parametrize("stop", [False, True])
def test_an_event_run_next_is_handled_as_if_pushed_for_now(stop):
    """``run_next`` (checked by ``is_next``) against ``push``: the same events, in the same order,
    counted the same; once the queue is stopped the event stays queued, as a pushed one would."""
    def trace(inline: bool) -> tuple[list, int, int]:
        q, seen = EventQueue(), []

        def h(t, tag):
            seen.append((t, tag))
            if tag == "a":
                q.push(t, h, "a-same-time")
                assert not q.is_next(t)              # due now too: 'landed' queues behind it
                q.push(t, h, "landed")
            if tag == "b":
                next_ = inline and q.is_next(t)
                if not next_:
                    q.push(t, h, "landed-b")
                q.push(t + 0.5, h, "later")          # pushed after: still after landed-b
                if stop:
                    q.stop()
                if next_:
                    q.run_next(h, "landed-b")

        q.push(1.0, h, "a")
        q.push(2.0, h, "b")
        q.run()
        return seen, q.num_events, len(q)

    assert trace(True) == trace(False)
    assert trace(True)[0][-1] == ((2.0, "b") if stop else (2.5, "later"))


def test_slowest_share_mean():
    assert slowest_share_mean([]) is None
    assert slowest_share_mean([(0.01, 9), (1.0, 1)]) == pytest.approx(1.0)        # 10 gaps -> slowest 1
    assert slowest_share_mean([(0.01, 10), (1.0, 1)]) == pytest.approx(1.0)        # 11 gaps -> slowest 1
    assert slowest_share_mean([(0.01, 18), (1.0, 2)]) == pytest.approx(1.0)        # 20 gaps -> slowest 2
    assert slowest_share_mean([(0.02, 3)]) == pytest.approx(0.02)


def test_fold_gaps_applies_stalls_and_wait_to_the_next_gap():
    log = [(0.5, 0), (0.01, 4), (1.0, 0), (0.02, 2), (0.03, 1)]
    assert fold_gaps(log, 1, 5, 0.005) == [(0.015, 1), (0.01, 3), (1.02, 1), (0.02, 1), (0.03, 1)]
    assert fold_gaps(log, 0, 2, 0.0) == [(0.51, 1), (0.01, 3)]
