"""Prefill batching in the simulator: its prefill instances pack by the live rule and its
conductor (the scheduler, unchanged) prices their queues packed, so a burst's predicted TTFTs
follow the packed forwards instead of one prompt at a time."""

from __future__ import annotations

import pytest

from mooncake_lite.scheduler import PrefillCostModel, SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from tests.sim.helpers import req, toy_hardware

HW = toy_hardware(prefill=PrefillCostModel(c0=0.05, c1=1e-3))


def _predicted(budget: int, n: int = 12, blind: bool = False):
    cfg = SimConfig(num_prefill=1, num_decode=1, prefill_batch_tokens=budget,
                    scheduler=SchedulerConfig(admission="none"))
    sim = MooncakeSim(cfg, hardware=HW)
    if blind:
        for p in sim.prefills:
            p.view.set_instance(p.store_id, None, p.cost, 0)
    seen = []
    decide = sim._decide

    def record(now, r, sreq):
        d = decide(now, r, sreq)
        seen.append(d.predicted_ttft_s)
        return d

    sim._decide = record
    ttfts = [r.ttft for r in sim.run([req(i, 0.0, 100, 2) for i in range(n)]).requests]
    return ttfts, seen


def test_the_conductor_predicts_a_burst_as_the_instance_packs_it():
    """The first prompt starts alone; the rest wait for it and then go in packs of 5 (500 of 512
    tokens). A prediction is the end of the pack the request joins as the queue stands at its
    arrival: each member arriving after it in that pack adds its token terms (0.1 s) to the
    forward, and nothing else is off. Told nothing of the packing, the conductor prices one
    prompt at a time: c0 too much per prompt packed away ahead."""
    ttfts, predicted = _predicted(512)
    alone, c0 = 0.15, 0.05
    packs = [[0], [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11]]
    assert ttfts[:6] == pytest.approx([alone] + [alone + 5 * alone - 4 * c0] * 5)
    for pack in packs:
        for k, i in enumerate(pack):
            later = len(pack) - 1 - k
            assert predicted[i] == pytest.approx(ttfts[i] - later * (alone - c0))
    blind_ttfts, blind = _predicted(512, blind=True)
    assert blind_ttfts == pytest.approx(ttfts)                     # the instance packs all the same
    assert blind == pytest.approx([alone * (i + 1) for i in range(12)])
    assert blind[-1] - ttfts[-1] == pytest.approx(c0 * (12 - len(packs)))


def test_without_a_budget_the_burst_runs_and_is_predicted_one_at_a_time():
    ttfts, predicted = _predicted(0)
    assert ttfts == pytest.approx([0.15 * (i + 1) for i in range(12)])
    assert predicted == pytest.approx(ttfts)


def test_a_cpp_group_never_packs():
    cfg = SimConfig(num_prefill=1, num_decode=1, prefill_batch_tokens=512, cpp_group_size=2,
                    scheduler=SchedulerConfig(admission="none"))
    sim = MooncakeSim(cfg, hardware=HW)
    assert [p.pack_tokens for p in sim.prefills] == [0]
    assert sim.prefills[0].state().pack_tokens == 0
    one = SimConfig(num_prefill=1, num_decode=1, prefill_batch_tokens=5000, prefill_chunk=256,
                    scheduler=SchedulerConfig(admission="none"))
    assert MooncakeSim(one, hardware=HW).prefills[0].state().pack_tokens == 256   # capped at the chunk


def test_bench_pd_predicts_a_burst_as_the_simulated_conductor_does():
    """``mooncake bench pd`` (e) reports the conductor's predictions for its live burst by the same
    scheduler: on the toy instance they are the simulated conductor's, packed and not."""
    from mooncake_lite.bench.pd.burst import predicted_burst_ttfts
    for budget in (512, 0):
        _, predicted = _predicted(budget)
        assert predicted_burst_ttfts(HW.prefill, 12, 100, budget) == pytest.approx(predicted)
