"""A burst placed together (scheduler/arrivals.py): when a request is held, and in which order a
burst is placed. The simulator's use: tests/sim/test_fidelity_bench.py; the conductor's:
tests/conductor/test_arrivals.py."""

from __future__ import annotations

from mooncake_lite.scheduler import (BlockEvent, BlockIndex, ClusterState, PrefillInstanceState, QueuedPrefill,
                                     ScheduleRequest)
from mooncake_lite.scheduler.arrivals import decision_order, holds, uncached_now

JOB = (QueuedPrefill("running", 100, 0, started_at=0.0),)


def prefill(iid: str, queue=JOB, overtakes: int = 4) -> PrefillInstanceState:
    return PrefillInstanceState(iid, iid, queue=queue, overtakes=overtakes)


def test_a_request_is_held_only_where_every_prefill_is_busy_and_some_serves_shortest_first():
    busy = ClusterState((prefill("p0"), prefill("p1", overtakes=0)), ())
    assert holds(busy, 0.02)
    assert not holds(busy, 0.0)                                                    # no window
    assert not holds(ClusterState((prefill("p0"), prefill("p1", queue=())), ()), 0.02)   # p1 idle: starts at once
    assert not holds(ClusterState((prefill("p0", overtakes=0),), ()), 0.02)      # FIFO: arrival order is priced
    assert not holds(ClusterState((), ()), 0.02)                                  # no prefill: refused at once


def test_a_burst_is_placed_fewest_uncached_tokens_first_ties_in_arrival_order():
    assert decision_order([300, 10, 200, 10, 50]) == [1, 3, 4, 2, 0]
    assert decision_order([]) == []


def test_the_ordering_key_is_what_the_store_with_the_longest_prefix_leaves_to_compute():
    index = BlockIndex()
    index.apply(BlockEvent("s0", "stored", ("a", "b")))
    index.apply(BlockEvent("s1", "stored", ("a", "b", "c")))
    assert uncached_now(index, ScheduleRequest("r", ("a", "b", "c", "d"), 70, 1), 16) == 70 - 48
    assert uncached_now(index, ScheduleRequest("r", ("x",), 70, 1), 16) == 70
    assert uncached_now(index, ScheduleRequest("r", ("a", "b"), 32, 1), 16) == 1   # never less than the last token
