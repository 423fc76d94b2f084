"""A burst placed together (scheduler/arrivals.py): when a request is held, and in which order a
burst is placed. The simulator's use: tests/sim/test_fidelity_bench.py; the conductor's:
tests/conductor/test_arrivals.py."""

from __future__ import annotations

import pytest

from mooncake_lite.scheduler import (BlockEvent, BlockIndex, ClusterState, PrefillCostModel, PrefillInstanceState,
                                     QueuedPrefill, ScheduleRequest)
from mooncake_lite.scheduler.arrivals import burst_shifts, decision_order, holds, uncached_now

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


MODEL = PrefillCostModel(c0=0.0, c1=1e-3, c2=0.0, c3=0.0)    # 1 ms a token


def _queue(*jobs: tuple[str, int], started: int = 1) -> tuple[QueuedPrefill, ...]:
    return tuple(QueuedPrefill(rid, n, 0, started_at=0.0 if i < started else None) for i, (rid, n) in enumerate(jobs))


def test_a_burst_s_members_in_one_pack_end_with_the_pack_its_later_members_joined():
    """Decided shortest first, each member was priced with its pack as the queue stood (without
    the members decided after it); the later ones joined its pack: it ends with that pack."""
    q = _queue(("run", 400), ("a", 30), ("b", 50), ("c", 200), ("d", 300))   # packs: [a b c] [d] at 512
    shifts = burst_shifts([("a", "p0"), ("b", "p0"), ("c", "p0"), ("d", "p0")], lambda pid: (q, 512, MODEL))
    assert shifts == {"a": pytest.approx(0.25), "b": pytest.approx(0.2)}   # c priced [a b c]; d its own
    assert burst_shifts([("a", "p0"), ("b", "p0")], lambda pid: (q, 0, MODEL)) == {}   # no packing


def test_a_member_s_pack_can_end_sooner_and_members_on_other_prefills_are_apart():
    # a joined the long job "old" queued before the burst; b, later, passed "old": a's pack is now [a b]
    q = _queue(("run", 10), ("a", 30), ("b", 100), ("old", 450))
    shifts = burst_shifts([("a", "p0"), ("b", "p0"), ("x", "p1")],
                          lambda pid: (q, 512, MODEL) if pid == "p0" else (_queue(("x", 20), started=0), 512, MODEL))
    assert shifts == {"a": pytest.approx(-0.35)}      # [a old] 480 ms -> [a b] 130 ms
    # members already running (their forward started) are in no pack that can grow
    running = _queue(("a", 30), ("b", 40), started=2)
    assert burst_shifts([("a", "p0"), ("b", "p0")], lambda pid: (running, 512, MODEL)) == {}
