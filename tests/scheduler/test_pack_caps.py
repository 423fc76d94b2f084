"""A request's cap on the packed forwards it may be in (issue #36 item 3): the decision sets it
from the TTFT SLO (``packing.slo_pack_cap``), the one pack rule (``costs.pack_sizes``) honours it
for the instance, the conductor's view and the simulator, and a short prompt is no longer held
past its SLO by the long prompts queued behind it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from mooncake_lite.conductor.cluster.membership import Membership, PrefillJob
from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     FromScratch, PrefillCostModel, PrefillInstanceState, QueuedPrefill,
                                     ScheduleRequest, Scheduler, SchedulerConfig)
from mooncake_lite.scheduler.costs import pack_sizes, packed_seconds
from mooncake_lite.scheduler.estimate import backlog_of, queues_at
from mooncake_lite.scheduler.packing import first_pack, joins_tail, packed_queue, slo_pack_cap
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from tests.scheduler.test_packing import _reg
from tests.sim.helpers import req, toy_hardware

MODEL = PrefillCostModel(c0=0.005, c1=2e-3, c2=1e-7, c3=1e-5)
COSTS = CostModels(MODEL, DecodeCostModel(c0=0.01, c1=1e-3), kv_bytes_per_token=64)


def test_a_cap_lowers_the_bound_of_every_pack_its_prompt_is_in():
    assert pack_sizes([30, 200, 200], 512) == [3]
    assert pack_sizes([30, 200, 200], 512, [100, 0, 0]) == [1, 2]      # the head's cap: nobody fits beside it
    assert pack_sizes([30, 60, 200], 512, [100, 0, 0]) == [2, 1]       # 90 fit under 100, 290 do not
    assert pack_sizes([200, 100], 512, [0, 250]) == [1, 1]             # a joiner's own cap keeps it out
    assert pack_sizes([200, 50], 512, [0, 250]) == [2]
    assert pack_sizes([30, 600, 10], 512, [0, 0, 0]) == [1, 1, 1]      # oversize still runs alone
    assert pack_sizes([30, 20], 512, [10, 0]) == [1, 1]                # a cap under its own prompt: alone


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 700), st.integers(0, 600)), max_size=12), st.integers(0, 600))
def test_caps_only_ever_cut_packs_smaller(jobs, limit):
    uncached, caps = [n for n, _ in jobs], [c for _, c in jobs]
    assert pack_sizes(uncached, limit, [0] * len(jobs)) == pack_sizes(uncached, limit)
    sizes = pack_sizes(uncached, limit, caps)
    assert sum(sizes) == len(jobs)
    assert first_pack(iter(uncached), limit, iter(caps)) == (sizes[0] if sizes else 0)
    i = 0
    for size in sizes:                     # no pack holds more than any member's cap (but a lone prompt)
        members = range(i, i + size)
        if size > 1:
            tokens = sum(uncached[k] for k in members)
            assert tokens <= limit and all(caps[k] == 0 or tokens <= caps[k] for k in members)
        i += size


def _joined_s(own_tokens: int, others: int) -> float:
    return MODEL.predict(own_tokens) + MODEL.predict(others) - MODEL.c0 if others else MODEL.predict(own_tokens)


def test_the_cap_is_the_largest_forward_that_still_ends_within_the_budget():
    own, budget = 40, 0.6
    cap = slo_pack_cap(MODEL, 512, budget, own, 0)
    assert 40 < cap < 512
    assert _joined_s(own, cap - own) <= budget < _joined_s(own, cap - own + 1)
    assert slo_pack_cap(MODEL, 512, 5.0, own, 0) == 0                  # a full forward fits: no cap
    assert slo_pack_cap(MODEL, 512, 0.05, own, 0) == own               # nothing more fits: alone
    assert slo_pack_cap(MODEL, 512, math.inf, own, 0) == 0             # no SLO
    assert slo_pack_cap(MODEL, 512, 0.6, 600, 0) == 0                  # oversize: it runs alone anyway
    assert slo_pack_cap(MODEL, 0, 0.6, own, 0) == 0                    # the instance does not pack


def test_a_capped_pack_is_not_joined_and_a_new_request_is_priced_behind_it():
    running = QueuedPrefill("a", 100, 0, 0.0)
    short = QueuedPrefill("s", 40, 0, None, 0, 150)
    got = packed_queue((running, short), MODEL, 512)
    assert (got.tail_tokens, got.tail_bound) == (40, 150)
    assert joins_tail(got.tail_tokens, 100, got.tail_bound) and not joins_tail(got.tail_tokens, 120, got.tail_bound)
    p = PrefillInstanceState("p", "s", (running, short), pack_tokens=512)
    d = Scheduler(SchedulerConfig(block_size=16, admission="none"), COSTS, BlockIndex(), cache=FromScratch()).schedule(
        ScheduleRequest("x", (), 200, 8), ClusterState((p,), (DecodeInstanceState("d"),)), 0.0)
    assert d.predicted_queue_s == pytest.approx(MODEL.predict(100) + MODEL.predict(40))   # the short one's forward first
    assert d.predicted_prefill_s == pytest.approx(MODEL.predict(200))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 300)), max_size=8), st.integers(1, 400),
       st.sampled_from([0.0, 0.5]), st.sampled_from([3.0, 10.0]))
def test_a_new_request_ends_where_the_queue_with_it_and_its_cap_does(jobs, n, now, factor):
    """Its prediction holds once its own cap is in the queue: the cap never cuts it out of the
    pack it was priced in (relative SLO, nothing refused: every decision sets a cap)."""
    queue = tuple(QueuedPrefill(f"q{i}", t, 0, 0.0 if i == 0 else None, 0, c) for i, (t, c) in enumerate(jobs))
    p = PrefillInstanceState("p", "s", queue, pack_tokens=512)
    cfg = SchedulerConfig(block_size=16, admission="none", ttft_slo_s=None, ttft_slo_factor=factor)
    d = Scheduler(cfg, COSTS, BlockIndex(), cache=FromScratch()).schedule(
        ScheduleRequest("new", (), n, 8), ClusterState((p,), (DecodeInstanceState("d"),)), now)
    new = QueuedPrefill("new", n, 0, now if not queue else None, 0, d.pack_cap)
    q = queues_at([backlog_of(PrefillInstanceState("p", "s", (*queue, new), pack_tokens=512), MODEL)], now)
    assert d.predicted_queue_s + d.predicted_prefill_s == pytest.approx(
        q.backlogs[0].cumulative_s[-1] - q.done_s[0], abs=1e-12)


def test_the_conductor_starts_only_the_jobs_a_capped_head_takes_along():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("p", 512), now=0)
    for i, (n, cap) in enumerate([(100, 0), (40, 150), (100, 0), (100, 0)]):
        m.add_prefill("p", PrefillJob(f"r{i}", n, 0, "d", pack_cap=cap), now=0.5)
    started = lambda: [j.started_at for j in m.snapshot().prefills[0].queue]   # noqa: E731
    m.prefill_done("p", "r0", now=1.0)               # r1 (cap 150) takes r2 along: 140 tokens, not r3
    assert started() == [1.0, 1.0, None]


def test_in_the_simulator_a_short_prompt_meets_its_slo_beside_the_long_ones_behind_it():
    """A burst behind a running prompt: a short one, then three of 150 tokens. Unbounded, all four
    would share one forward of 490 tokens and the short one miss its 10x SLO; capped, it shares
    its forward with one of them, and the other two follow in the next."""
    hw = toy_hardware(prefill=PrefillCostModel(c0=0.005, c1=2e-3))
    trace = [req(0, 0.0, 100, 2), req(1, 0.001, 40, 2), *(req(i, 0.001, 150, 2) for i in (2, 3, 4))]
    cfg = SimConfig(num_prefill=1, num_decode=1, prefill_batch_tokens=512,
                    scheduler=SchedulerConfig(admission="none", ttft_slo_s=None, ttft_slo_factor=10.0))
    sim = MooncakeSim(cfg, hardware=hw)
    sim.decisions = decisions = []
    ttft = {r.request_id: r.ttft for r in sim.run(trace).requests}
    first = hw.prefill.predict(100)
    assert 40 < decisions[1].pack_cap < 340
    assert ttft[1] <= 10 * hw.prefill.predict(40)
    pair = packed_seconds([hw.prefill.predict(40), hw.prefill.predict(150)], 0.005)
    assert ttft[1] == pytest.approx(first + pair - 0.001)
    assert ttft[2] == pytest.approx(ttft[1])                     # the one that fitted beside it
    assert ttft[4] == pytest.approx(first + pair + packed_seconds([hw.prefill.predict(150)] * 2, 0.005) - 0.001)
