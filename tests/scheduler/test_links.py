"""Measured link speed per store pair (scheduler/links.py) and Algorithm 1 pricing fetches with it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mooncake_lite.scheduler import (CostModels, FromScratch, Migration, ScheduleRequest, Scheduler,
                                     SchedulerConfig, schedule)
from mooncake_lite.scheduler import wide
from mooncake_lite.scheduler.links import LinkSpeeds, observe_migration
from tests.scheduler.clusters import COSTS, cfg, cluster, index, prefill, queued, request
from tests.scheduler.test_estimate_cache import BS
from tests.scheduler.test_wide import _Wide, _wide_cluster


def test_first_measurement_replaces_the_prior_then_an_ewma_smooths():
    links = LinkSpeeds(alpha=0.5, min_bytes=1000)
    assert links.bandwidth("a", "b") is None and not links.from_source("a")
    assert links.observe("a", "b", 4000, 2.0)            # 2000 B/s
    assert links.bandwidth("a", "b") == 2000
    assert links.observe("a", "b", 6000, 1.0)            # 6000 B/s: halfway there
    assert links.bandwidth("a", "b") == 4000
    assert links.bandwidth("b", "a") is None             # a pair is directed
    assert list(links.items()) == [("a", "b", 4000)]


def test_transfers_too_small_to_time_or_not_between_two_stores_are_ignored():
    links = LinkSpeeds(min_bytes=1000)
    assert not links.observe("a", "b", 999, 0.001)
    assert not links.observe("a", "a", 10**6, 1.0)
    assert not links.observe("a", "b", 10**6, 0.0)
    assert links.num_observed == 0 and links.bandwidth("a", "b") is None
    # a prefill's timings: absent (nothing moved), malformed, then one real migration
    assert not observe_migration(links, "a", "b", {"queue_s": 0.1})
    assert not observe_migration(links, "a", "b", {"migrate_bytes": "lots", "migrate_s": 1.0})
    assert not observe_migration(links, "a", "b", {"migrate_bytes": True, "migrate_s": 1.0})
    assert observe_migration(links, "a", "b", {"migrate_bytes": 5000, "migrate_s": 0.5})
    assert links.bandwidth("a", "b") == 10_000


def _with_link(speed: float | None) -> CostModels:
    links = LinkSpeeds(min_bytes=1)
    if speed is not None:
        links.observe("s-p0", "s-p1", speed, 1.0)
    return dataclasses.replace(COSTS, links=links)


def _decide(costs: CostModels):
    # p0 holds the 8-block prefix but has 150 ms queued; p1 is idle with nothing cached; p2 is
    # idle and holds 4 blocks, few enough against the threshold (8/4 < 3) to keep them and
    # recompute the rest itself. Prefill: 1 ms per new token; 8 blocks are 80 bytes.
    clus = cluster([prefill("p0", queued(150)), prefill("p1"), prefill("p2")])
    return schedule(request(), clus, index=index(p0=8, p2=4), config=cfg(kvcache_balancing_threshold=3.0),
                    costs=costs, now=0.0)


def test_algorithm_1_migrates_over_a_fast_link_and_recomputes_over_a_slow_one():
    fast = _decide(_with_link(1e6))          # 80 B in 0.08 ms, then 20 new tokens: 20.08 ms
    assert (fast.prefill_id, fast.route) == ("p1", "transfer")
    assert fast.migration == Migration("s-p0", "s-p1", tuple(range(8)))
    assert fast.predicted_transfer_s == pytest.approx(80 / 1e6)
    slow = _decide(_with_link(400))          # 200 ms to fetch: p2 recomputing 60 tokens (60 ms) wins
    assert (slow.prefill_id, slow.route, slow.migration) == ("p2", "local-hit", None)
    assert (slow.reused_prefix_blocks, slow.local_prefix_blocks) == (4, 4)
    assert slow.predicted_ttft_s == pytest.approx(0.060)
    # before any measurement the prior (10 kB/s: 8 ms) prices the fetch
    prior = _decide(_with_link(None))
    assert (prior.prefill_id, prior.predicted_transfer_s) == ("p1", pytest.approx(0.008))


def test_a_measured_pair_wins_over_the_instance_bandwidth_and_only_for_that_pair():
    costs = _with_link(400)
    clus = cluster([prefill("p0", queued(150)), prefill("p1", bandwidth_bytes_per_s=1e6)])
    d = schedule(request(), clus, index=index(p0=8), config=cfg(), costs=costs, now=0.0)
    assert d.prefill_id == "p0"                           # 80 B at 400 B/s: 220 ms > 170 ms
    costs.links.observe("s-p0", "s-p1", 10**6, 1.0)       # the link got faster: EWMA moves
    assert costs.links.bandwidth("s-p0", "s-p1") > 400
    other = LinkSpeeds(min_bytes=1)
    other.observe("s-p9", "s-p1", 1, 1.0)                 # a slow link from another store
    d = schedule(request(), clus, index=index(p0=8), config=cfg(),
                 costs=dataclasses.replace(COSTS, links=other), now=0.0)
    assert (d.prefill_id, d.predicted_transfer_s) == ("p1", pytest.approx(80 / 1e6))


def test_wide_cluster_arrays_price_measured_links_as_the_loop_does():
    rng = random.Random(7)
    idx, clus = _wide_cluster(rng, 60, False)
    links = LinkSpeeds(min_bytes=1)
    for src in range(20):
        for dst in rng.sample(range(20), 10):
            links.observe(f"s{src}", f"s{dst}", rng.choice([1e1, 1e9]), 1.0)
    base = CostModels(COSTS.prefill, COSTS.decode, kv_bytes_per_token=2, bandwidth_bytes_per_s=1e3)
    config = SchedulerConfig(block_size=BS, ttft_slo_s=None, tbt_slo_s=None)
    changed = 0
    with _Wide(1):
        for costs in (base, dataclasses.replace(base, links=links)):
            cached, scratch = Scheduler(config, costs, idx), Scheduler(config, costs, idx, cache=FromScratch())
            for k in range(40):
                blocks = rng.randint(1, 40)
                req = ScheduleRequest(f"r{k}", tuple(range(blocks)), blocks * BS + 5, 100)
                d = cached.schedule(req, clus, 0.0)
                assert d == scratch.schedule(req, clus, 0.0)
                if costs.links is not None:
                    changed += d != Scheduler(config, base, idx).schedule(req, clus, 0.0)
    assert changed      # the measured links moved some decisions
