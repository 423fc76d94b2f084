"""A refused request's wait taken apart (scheduler/explain.py): the parts add up to the queue the
decision priced it at, whatever the queue, its started head (reported or not), the scale and the
shares, in shortest-first and in FIFO order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     PrefillCostModel, PrefillInstanceState, QueuedPrefill, ScheduleRequest,
                                     Scheduler, SchedulerConfig)
from mooncake_lite.scheduler.explain import wait_parts

MODEL = PrefillCostModel(c0=0.05, c1=1e-3, c2=1e-7, c3=1e-5)
COSTS = CostModels(MODEL, DecodeCostModel(c0=0.01, c1=1e-3), kv_bytes_per_token=64)


@settings(max_examples=150, deadline=None)
@given(jobs=st.lists(st.integers(1, 3000), min_size=0, max_size=8), started=st.booleans(),
       reported=st.sampled_from([None, 0.3, 5.0]), elapsed=st.floats(0.0, 3.0), bound=st.sampled_from([0, 4]),
       share=st.sampled_from([0.0, 0.3, 1.0]), scale=st.sampled_from([1.0, 0.7, 1.5]),
       recent=st.sampled_from([(), (50, 400, 900)]), n=st.integers(1, 2000))
def test_the_parts_add_up_to_the_decision_s_queue(jobs, started, reported, elapsed, bound, share, scale, recent, n):
    now = 10.0
    queue = tuple(QueuedPrefill(f"j{i}", t, 0, now - elapsed if started and i == 0 else None,
                                ends_at=(now - elapsed + reported) if started and i == 0 and reported else None)
                  for i, t in enumerate(jobs))
    p = PrefillInstanceState("p", "s", queue, overtakes=bound, overtake_share=share, recent_uncached=recent,
                             queue_scale=scale, queue_spread=1.3)
    cluster = ClusterState((p,), (DecodeInstanceState("d"),))
    decision = Scheduler(SchedulerConfig(block_size=16), COSTS, BlockIndex()).schedule(
        ScheduleRequest("x", (), n, 8), cluster, now)
    parts = wait_parts(p, COSTS, n, 0, now)
    assert parts.wait_s == pytest.approx(decision.predicted_queue_s, rel=1e-9, abs=1e-9)
    assert parts.head_reported == bool(started and reported and jobs)
    assert parts.spread == 1.3 and str(parts.ahead_jobs) in parts.describe()


def test_a_short_job_lands_ahead_of_the_long_ones_it_may_pass():
    queue = (QueuedPrefill("run", 800, 0, 9.5), QueuedPrefill("short", 50, 0), QueuedPrefill("long", 3000, 0))
    p = PrefillInstanceState("p", "s", queue, overtakes=4, overtake_share=0.0)
    parts = wait_parts(p, COSTS, 100, 0, 10.0)
    assert parts.ahead_jobs == 1 and parts.ahead_s == pytest.approx(MODEL.predict(50))
    assert parts.head_left_s == pytest.approx(MODEL.predict(800) - 0.5) and not parts.head_reported
    assert parts.describe().startswith(f"waits {parts.wait_s:.3g}s = (")
