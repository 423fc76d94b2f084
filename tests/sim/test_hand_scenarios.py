"""Scenarios small enough to compute by hand: exact TTFT, join timing, reuse, interference."""

from __future__ import annotations

import pytest

from mooncake_lite.scheduler import DecodeCostModel, SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.colocated import ColocatedSim
from mooncake_lite.sim.config import ColocatedConfig, SimConfig
from tests.sim.helpers import req, toy_hardware


def by_id(result):
    return {r.request_id: r for r in result.requests}


def run(trace, num_prefill=1, num_decode=1, **sched):
    cfg = SimConfig(num_prefill=num_prefill, num_decode=num_decode,
                    scheduler=SchedulerConfig(admission="none", **sched))
    return by_id(MooncakeSim(cfg, hardware=toy_hardware()).run(trace))


def test_fifo_queue_gives_exact_ttft_and_prefix_reuse():
    shared = [1, 2]
    r = run([req(0, 0.0, 1000, 3, ids=[1, 2]),                 # 1.0 s prefill
             req(1, 0.5, 1000, 3),                             # waits for r0: starts 1.0, ends 2.0
             req(2, 2.5, 1100, 3, ids=shared + [77, 78, 79][:1])])  # reuses block 1 only (1 full block of r0)
    assert r[0].ttft == pytest.approx(1.0)
    assert r[1].ttft == pytest.approx(1.5)
    # r0 had one full block (1000 // 512) -> key 1 cached; r2's first full block is key 1 -> 512 reused.
    assert r[2].reused_tokens == 512
    assert r[2].ttft == pytest.approx((1100 - 512) * 1e-3)
    # decode: 2 more tokens at 10 ms each, right after the first token.
    assert r[0].finish == pytest.approx(1.02) and r[0].tbt == pytest.approx(0.01)
    assert all(x.status == "completed" for x in r.values())


def test_kv_arrival_mid_step_joins_at_the_next_boundary():
    # X (1000 tok) on P0 and Y (1055 tok) on P1 both start at 0; one decode instance.
    r = run([req(0, 0.0, 1000, 101), req(1, 0.0, 1055, 4)], num_prefill=2)
    x, y = r[0], r[1]
    assert x.prefill_id != y.prefill_id
    assert x.ttft == pytest.approx(1.0) and y.ttft == pytest.approx(1.055)
    # X steps end at 1.01, 1.02, ...; Y's KV lands at 1.055 and joins at 1.06.
    assert y.finish == pytest.approx(1.06 + 3 * 0.01)
    assert y.tbt == pytest.approx(0.015)               # slowest gap: 5 ms wait + a 10 ms step
    assert x.finish == pytest.approx(1.0 + 100 * 0.01)
    assert x.tbt == pytest.approx(0.01)


def test_early_admission_rejects_over_ttft_slo_and_conserves_requests():
    trace = [req(i, 0.0, 2000, 5) for i in range(10)]   # 2 s each on one instance
    cfg = SimConfig(num_prefill=1, num_decode=1,
                    scheduler=SchedulerConfig(admission="early", ttft_slo_s=7.0))
    res = MooncakeSim(cfg, hardware=toy_hardware()).run(trace)
    r = by_id(res)
    # predicted TTFTs 2, 4, 6 are admitted; 8 and beyond are not (the queue stops growing).
    assert [r[i].status for i in range(10)] == ["completed"] * 3 + ["rejected"] * 7
    assert {r[i].reject_cause for i in range(3, 10)} == {"ttft"}
    assert res.counters["completed"] + res.counters["rejected"] == 10


@pytest.mark.parametrize("check, refused_at, cause", [("arrival", 1.0, "tbt"), ("reserve", 0.0, "reserve-tbt")])
def test_decode_double_check_at_arrival_wastes_the_prefill(check, refused_at, cause):
    # TBT SLO below one step: admission 'none' lets it through, the decode refuses it — after
    # the prefill when it checks at KV arrival (the paper's), before it when it checks at
    # reservation (the live decode's).
    cfg = SimConfig(num_prefill=1, num_decode=1, decode_check=check,
                    scheduler=SchedulerConfig(admission="none", tbt_slo_s=0.005))
    r = by_id(MooncakeSim(cfg, hardware=toy_hardware()).run([req(0, 0.0, 1000, 5)]))
    assert r[0].status == "rejected" and (r[0].reject_stage, r[0].reject_cause) == ("decode", cause)
    assert r[0].finish == pytest.approx(refused_at)


def test_colocated_prefill_stalls_the_running_batch():
    trace = [req(0, 0.0, 1000, 11), req(1, 1.055, 1000, 3)]
    res = ColocatedSim(ColocatedConfig(num_instances=1), hardware=toy_hardware()).run(trace)
    a, b = by_id(res)[0], by_id(res)[1]
    assert a.ttft == pytest.approx(1.0)
    # B queues at 1.055, the engine reaches a step boundary at 1.06 and prefills B for 1 s.
    assert b.ttft == pytest.approx(2.06 - 1.055)
    # A: 6 steps, then a gap of 1 s stall + 10 ms, then 3 steps: 10 gaps, slowest 10% = 1 gap.
    assert a.tbt == pytest.approx(1.01)
    assert a.finish == pytest.approx(2.06 + 4 * 0.01)


def test_colocated_chunked_prefill_lengthens_every_gap_by_a_chunk():
    trace = [req(0, 0.0, 1000, 3), req(1, 1.005, 500, 2)]
    cfg = ColocatedConfig(num_instances=1, chunked_prefill_tokens=250)
    res = by_id(ColocatedSim(cfg, hardware=toy_hardware()).run(trace))
    a, b = res[0], res[1]
    assert a.ttft == pytest.approx(1.0)                      # 4 chunks of 250 tokens, nothing running
    # B joins at the 1.01 boundary: a mixed step of 249 prompt tokens + A's decode = 0.259 s.
    assert a.finish == pytest.approx(1.269) and a.tbt == pytest.approx(0.259)
    # then 250 tokens alone (0.25 s) and the last token (1 ms).
    assert b.ttft == pytest.approx(1.520 - 1.005)


def test_ssd_tier_hit_is_slower_than_dram_but_beats_recompute():
    from mooncake_lite.sim.store import NodeStore
    s = NodeStore(dram_blocks=2, ssd_blocks=10, policy="lru")
    assert s.insert([1, 2]) == ([1, 2], [])
    held, dropped = s.insert([5, 6])            # 1, 2 spill to SSD: still held, nothing dropped
    assert held == [5, 6] and dropped == []
    assert s.prefix([1, 2, 9]) == (2, 2) and s.prefix([5, 1]) == (2, 1) and s.prefix([7]) == (0, 0)

    hw = toy_hardware(ssd_load_bytes_per_s=512 / 0.3)       # 0.3 s per block from SSD
    trace = [req(0, 0.0, 1024, 2, ids=[1, 2]), req(1, 2.0, 1024, 2, ids=[5, 6]),
             req(2, 4.0, 1100, 2, ids=[1, 2, 7])]
    cfg = SimConfig(num_prefill=1, num_decode=1, store_blocks_per_node=2, ssd_blocks_per_node=10,
                    scheduler=SchedulerConfig(admission="none"))
    r = by_id(MooncakeSim(cfg, hardware=hw).run(trace))
    assert r[2].reused_tokens == 1024
    assert r[2].ttft == pytest.approx(0.6)                   # 2 SSD blocks; compute would be 0.076
    no_ssd = by_id(MooncakeSim(SimConfig(num_prefill=1, num_decode=1, store_blocks_per_node=2,
                                         scheduler=SchedulerConfig(admission="none")), hardware=hw).run(trace))
    assert no_ssd[2].reused_tokens == 0 and no_ssd[2].ttft == pytest.approx(1.1)


@pytest.mark.parametrize("admission", ["none", "early", "predictive"])
def test_in_flight_requests_do_not_herd_onto_one_decode(admission):
    # All four arrive during the first prefill, before any KV reached a decode: the conductor
    # counts the ones it already sent to a decode (incoming), so they alternate. Each prefill
    # takes 1 s and each decode 500 × 11 ms, so under ``predictive`` too each decodes beside all
    # the ones before it.
    trace = [req(i, 0.1 * i, 1000, 500) for i in range(4)]
    cfg = SimConfig(num_prefill=1, num_decode=2, scheduler=SchedulerConfig(admission=admission))
    hw = toy_hardware(decode=DecodeCostModel(c0=0.01, c1=0.001))   # TBT grows with the batch
    r = by_id(MooncakeSim(cfg, hardware=hw).run(trace))
    assert [r[i].decode_id for i in range(4)] == ["D0", "D1", "D0", "D1"]


def test_a_request_decoded_before_the_next_starts_is_not_in_its_batch():
    # The same arrivals, 50 tokens each: a decode (0.55 s) ends before the next prefill (1 s)
    # does. ``predictive`` sees both decodes empty at each one's first token and keeps the
    # first (its tie); ``early`` counts every request sent and not yet arrived, and alternates.
    trace = [req(i, 0.1 * i, 1000, 50) for i in range(4)]
    hw = toy_hardware(decode=DecodeCostModel(c0=0.01, c1=0.001))
    placed = {}
    for admission in ("early", "predictive"):
        cfg = SimConfig(num_prefill=1, num_decode=2, scheduler=SchedulerConfig(admission=admission))
        r = by_id(MooncakeSim(cfg, hardware=hw).run(trace))
        placed[admission] = [r[i].decode_id for i in range(4)]
    assert placed == {"early": ["D0", "D1", "D0", "D1"], "predictive": ["D0"] * 4}


def test_nothing_stays_incoming_after_the_run():
    # A one-token request ends at prefill and never reaches decode; a refused one leaves too.
    trace = [req(0, 0.0, 1000, 1), req(1, 0.1, 1000, 50), req(2, 0.2, 1000, 1), req(3, 0.3, 1000, 50)]
    # a TBT SLO below one decode step: the decode refuses the multi-token ones when their KV lands
    sim = MooncakeSim(SimConfig(num_prefill=1, num_decode=2, decode_check="arrival",
                                scheduler=SchedulerConfig(admission="none", tbt_slo_s=0.005)),
                      hardware=toy_hardware())
    r = by_id(sim.run(trace))
    assert [r[i].status for i in range(4)] == ["completed", "rejected", "completed", "rejected"]
    assert r[1].reject_stage == r[3].reject_stage == "decode"
    assert all(not d.committed for d in sim.decodes)
    assert all(d.incoming == () for d in sim.cluster_state().decodes)


def test_hot_prefix_migrates_to_the_idle_instance():
    hw = toy_hardware(network_bytes_per_s=10240.0)          # 4 blocks of 512 B (1 B/token) = 0.2 s
    trace = [req(0, 0.0, 2100, 2, ids=[1, 2, 3, 4, 5]),        # P0, 2.1 s; stores blocks 1-4
             req(1, 0.1, 5000, 2),                             # P1 until 5.1
             req(2, 2.2, 6000, 2),                             # P0 until 8.2
             req(3, 2.5, 2200, 2, ids=[1, 2, 3, 4, 9])]        # fetch 1-4 from P0 to P1
    cfg = SimConfig(num_prefill=2, num_decode=1, scheduler=SchedulerConfig(admission="none"))
    sim = MooncakeSim(cfg, hardware=hw)
    res = sim.run(trace)
    r = by_id(res)
    assert [r[i].prefill_id for i in range(4)] == ["P0", "P1", "P0", "P1"]
    assert r[3].reused_tokens == 2048 and res.counters["migrations"] == 1
    assert r[3].ttft == pytest.approx(5.1 + 0.152 - 2.5)      # waits for P1; the fetch (0.2 s) hides
    assert sim.scheduler.index.match([1, 2, 3, 4]).lengths == {"P0": 4, "P1": 4}   # replicated
