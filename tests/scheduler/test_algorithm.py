"""Algorithm 1 and the comparison strategies on hand-built clusters: which instance, and why."""

import random

import pytest

from mooncake_lite.scheduler import (BlockIndex, Migration, PrefillCostModel, QueuedPrefill,
                                     schedule)
from tests.scheduler.clusters import COSTS, cfg, cluster, decode, index, prefill, queued, request


def run(clus, idx, strategy="kvcache-centric", now=0.0, rng=None, **kw):
    return schedule(request(), clus, index=idx, config=cfg(strategy=strategy, **kw), costs=COSTS,
                    now=now, rng=rng)


def test_local_hit_wins_when_the_holder_is_idle():
    d = run(cluster([prefill("p0"), prefill("p1")]), index(p1=8))
    assert d.accepted and d.prefill_id == "p1" and d.route == "local-hit"
    assert (d.reused_prefix_blocks, d.local_prefix_blocks, d.migration) == (8, 8, None)
    assert d.predicted_ttft_s == pytest.approx(0.020)   # 20 new tokens
    assert d.reason.startswith("local hit: 8/10 blocks on p1")


def test_busy_holder_makes_kvcache_centric_fetch_and_migrate():
    # p0 holds 8 blocks but has 150 ms queued; p1 is idle and empty.
    # p0 local: 150 + 20 = 170 ms.  p1 fetch: 80 tokens * 0.1 ms + 20 ms = 28 ms.
    clus = cluster([prefill("p0", queued(150)), prefill("p1")])
    d = run(clus, index(p0=8))
    assert d.accepted and d.prefill_id == "p1" and d.route == "transfer"
    assert d.predicted_transfer_s == pytest.approx(0.008)
    assert d.predicted_ttft_s == pytest.approx(0.028)
    assert d.transfer_source == "s-p0"
    assert d.migration == Migration("s-p0", "s-p1", tuple(range(8)))
    assert d.reason.startswith("transfer from s-p0: 8 blocks to p1")


def test_cache_aware_never_transfers_and_load_balance_ignores_the_cache():
    clus = cluster([prefill("p0", queued(150)), prefill("p1")])
    ca = run(clus, index(p0=8), strategy="cache-aware")
    # p0 local 170 ms vs p1 recompute 100 ms: p1 by balance, no fetch
    assert (ca.prefill_id, ca.route, ca.migration, ca.reused_prefix_blocks) == ("p1", "balance", None, 0)
    assert ca.reason.startswith("balance: p1")
    # With only 50 ms queued, cache-aware stays on the holder (70 ms < 100 ms)...
    clus = cluster([prefill("p0", queued(50)), prefill("p1")])
    assert run(clus, index(p0=8), strategy="cache-aware").route == "local-hit"
    # ...while load-balance picks the emptiest queue regardless of the cache.
    lb = run(clus, index(p0=8), strategy="load-balance")
    assert (lb.prefill_id, lb.route) == ("p1", "balance")
    assert lb.predicted_ttft_s == pytest.approx(0.100)


def test_threshold_decides_between_partial_local_prefix_and_fetching_the_rest():
    # p1 holds 4 blocks, p0 holds 8 but is busy. best/local = 2.
    clus = cluster([prefill("p0", queued(500)), prefill("p1")])
    fetch = run(clus, index(p0=8, p1=4), kvcache_balancing_threshold=1.5)
    assert fetch.route == "transfer" and fetch.prefill_id == "p1"
    assert fetch.migration.keys == (4, 5, 6, 7) and fetch.local_prefix_blocks == 4
    assert fetch.predicted_ttft_s == pytest.approx(0.004 + 0.020)
    keep = run(clus, index(p0=8, p1=4), kvcache_balancing_threshold=3.0)
    assert keep.route == "local-hit" and keep.prefill_id == "p1" and keep.migration is None
    assert keep.predicted_ttft_s == pytest.approx(0.060)


def test_fetch_source_may_be_a_store_without_prefill_instance():
    idx = index(p0=2)
    idx.add("standalone", range(9))
    d = run(cluster([prefill("p0")]), idx)
    assert d.route == "transfer" and d.transfer_source == "standalone"
    assert d.migration == Migration("standalone", "s-p0", tuple(range(2, 9)))


def test_slow_link_makes_fetching_lose():
    clus = cluster([prefill("p0", queued(150)), prefill("p1", bandwidth_bytes_per_s=100)])
    d = run(clus, index(p0=8))  # fetching 80 tokens at 100 B/s = 0.8 s
    assert d.prefill_id == "p0" and d.route == "local-hit"


def test_balance_when_nothing_is_cached():
    clus = cluster([prefill("p0", queued(50)), prefill("p1", queued(10)), prefill("p2", queued(30))])
    d = run(clus, BlockIndex())
    assert (d.prefill_id, d.route) == ("p1", "balance")
    assert d.predicted_queue_s == pytest.approx(0.010)


def test_started_job_counts_only_its_remainder():
    busy = prefill("p0", (QueuedPrefill("x", 100, started_at=-0.095),))   # 5 ms left
    d = run(cluster([busy, prefill("p1", queued(8))]), BlockIndex())
    assert d.prefill_id == "p0" and d.predicted_queue_s == pytest.approx(0.005)


def test_instance_reported_cost_model_wins_over_the_default():
    slow = prefill("p0", cost=PrefillCostModel(c1=1e-2))
    d = run(cluster([slow, prefill("p1", queued(50))]), index(p0=5))
    # p0: 50 new tokens * 10 ms = 0.5 s; p1: 50 ms queue + 100 ms
    assert d.prefill_id == "p1"


def test_decode_chosen_by_predicted_tbt():
    clus = cluster([prefill("p0")], [decode("d0", batch=5), decode("d1", batch=2), decode("d2", batch=3)])
    d = run(clus, BlockIndex())
    assert d.decode_id == "d1" and d.predicted_tbt_s == pytest.approx(0.04)  # 10 + 3*10 ms
    assert d.reason.endswith("decode d1")


def test_full_decode_instances_are_skipped_and_all_full_rejects():
    clus = cluster([prefill("p0")], [decode("d0", batch=1, max_batch_size=1), decode("d1", batch=4)])
    assert run(clus, BlockIndex()).decode_id == "d1"
    clus = cluster([prefill("p0")], [decode("d0", batch=1, max_batch_size=1),
                                    decode("d1", batch=0, max_context_tokens=50)])
    d = run(clus, BlockIndex(), admission="none")
    assert not d.accepted and d.reject_cause == "no-decode" and d.prefill_id == "p0"


def test_a_decode_instance_fits_a_request_that_fills_it_exactly():
    # batch context 100 + prompt 100 + max_tokens 16 = 216 tokens of KV at the end
    for capacity, fits in ((216, True), (215, False)):
        clus = cluster([prefill("p0")], [decode("d0", batch=1, max_context_tokens=capacity)])
        assert run(clus, BlockIndex(), admission="none").accepted == fits
        clus = cluster([prefill("p0")], [decode("d0", batch=1, max_batch_size=2 if fits else 1)])
        assert run(clus, BlockIndex(), admission="none").accepted == fits


def test_reject_on_predicted_ttft():
    clus = cluster([prefill("p0", queued(2000)), prefill("p1", queued(1500))])
    d = run(clus, BlockIndex())
    assert not d.accepted and d.reject_cause == "ttft" and d.prefill_id == "p1"
    assert d.reason == "rejected: predicted TTFT 1.6s > SLO 1s"
    assert run(clus, BlockIndex(), admission="none").accepted


def test_reject_on_predicted_tbt():
    clus = cluster([prefill("p0")], [decode("d0", batch=9)])   # 10 + 10*10 ms = 0.11 s
    d = run(clus, BlockIndex())
    assert not d.accepted and d.reject_cause == "tbt" and d.decode_id == "d0"
    assert d.reason == "rejected: predicted TBT 0.11s > SLO 0.1s"
    assert run(clus, BlockIndex(), admission="none").accepted


def test_no_prefill_instance():
    d = run(cluster([]), BlockIndex())
    assert not d.accepted and d.reject_cause == "no-prefill" and d.prefill_id is None


def test_random_is_seeded_and_spreads():
    clus = cluster([prefill(f"p{i}") for i in range(4)], [decode(f"d{i}") for i in range(4)])
    picks = [run(clus, index(p0=8), strategy="random", rng=random.Random(7)) for _ in range(3)]
    assert len({(p.prefill_id, p.decode_id) for p in picks}) == 1   # same seed, same draw
    rng = random.Random(7)
    many = [run(clus, index(p0=8), strategy="random", rng=rng) for _ in range(60)]
    assert {m.prefill_id for m in many} == {"p0", "p1", "p2", "p3"}
    assert {m.decode_id for m in many} == {"d0", "d1", "d2", "d3"}
    assert all(m.route == "random" and m.migration is None for m in many)
    assert {m.reused_prefix_blocks for m in many if m.prefill_id == "p0"} == {8}
    with pytest.raises(ValueError, match="seeded random.Random"):
        run(clus, index(), strategy="random")


def test_transfer_latency_counts_against_fetching_the_prefix():
    # p0 holds 8 of 10 blocks behind a 0.2 s queue; idle p1 could fetch them (8 ms) instead.
    from dataclasses import replace
    clus = cluster([prefill("p0", queued(200)), prefill("p1")])
    d = schedule(request(), clus, index=index(p0=8), config=cfg(), costs=COSTS, now=0.0)
    assert (d.prefill_id, d.route) == ("p1", "transfer") and d.predicted_ttft_s == pytest.approx(0.028)
    slow_link = replace(COSTS, transfer_latency_s=0.5)      # every fetch pays 0.5 s first
    d = schedule(request(), clus, index=index(p0=8), config=cfg(), costs=slow_link, now=0.0)
    assert (d.prefill_id, d.route) == ("p0", "local-hit") and d.predicted_ttft_s == pytest.approx(0.22)
