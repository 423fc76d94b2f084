"""The one-model path of scheduler/wide.py (every row the same cost model and the default
bandwidth, the holders of a prefix costed a PrefixMatch run at a time) against the per-instance
loops: the same decisions, on random indexes where stores hold prefixes of every length, some
stores serving several instances and some no instance, and thresholds that send the holders both
ways (fetch the best prefix, or keep their own)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     DecodingRequest, FromScratch, PrefillCostModel, PrefillInstanceState, QueuedPrefill,
                                     ScheduleRequest, Scheduler, SchedulerConfig)
from mooncake_lite.scheduler import wide

BS = 16
MODEL = PrefillCostModel(c0=0.02, c1=5e-4, c2=1e-7, c3=2e-5)


def _cluster(rng: random.Random, n: int, shared_model: bool) -> tuple[BlockIndex, ClusterState]:
    idx = BlockIndex()
    stores = [f"s{i}" for i in range(n // 2 + 3)]
    for s in stores:                       # leading runs of every length, many stores equal
        idx.add(s, range(rng.choice([0, 0, 3, 8, 8, 8, 20, rng.randint(0, 30)])))
    prefills = []
    for i in range(n):
        started = rng.choice([0, 1, 1, 2])
        queue = tuple(QueuedPrefill(f"q{i}-{j}", rng.randint(1, 3000), rng.randint(0, 1000),
                                    rng.uniform(-5, 1) if j < started else None)
                      for j in range(rng.choice([0, 0, 1, 3]) + started))
        cost = MODEL if shared_model else None      # the instance's own, or the cluster default: one model
        prefills.append(PrefillInstanceState(f"p{i}", rng.choice(stores[:-3]), queue, None, cost))
    decodes = tuple(DecodeInstanceState(f"d{i}", (), None, None, DecodeCostModel(c0=0.01, c1=1e-3, c2=1e-6), ())
                    for i in range(4))
    return idx, ClusterState(tuple(prefills), decodes)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.booleans(), st.sampled_from([1.0, 1.5, 3.0, 100.0]),
       st.sampled_from([0.0, 0.01]))
def test_the_one_model_path_decides_as_the_loops_do(seed, shared_model, threshold, latency):
    rng = random.Random(seed)
    idx, cluster = _cluster(rng, 60, shared_model)
    costs = CostModels(MODEL, DecodeCostModel(c0=0.01, c1=1e-3, c2=1e-6), kv_bytes_per_token=2,
                       bandwidth_bytes_per_s=rng.choice([1e4, 1e5, 1e7]), transfer_latency_s=latency)
    config = SchedulerConfig(block_size=BS, kvcache_balancing_threshold=threshold,
                             ttft_slo_s=None, tbt_slo_s=None)
    cached, scratch = Scheduler(config, costs, idx), Scheduler(config, costs, idx, cache=FromScratch())
    assert len(cluster.prefills) >= wide.WIDE_MIN_INSTANCES
    taken = 0
    for k in range(30):
        blocks = rng.randint(1, 35)
        req = ScheduleRequest(f"r{k}", tuple(range(blocks)), blocks * BS + rng.randrange(BS), rng.randint(1, 400))
        now = rng.uniform(-1, 10)
        table = cached.cache.prefill_table(cluster.prefills, costs)
        match = idx.match(req.block_keys)
        taken += len(table.models) == 1 and not table.odd_bw and bool(match.runs)
        assert cached.schedule(req, cluster, now) == scratch.schedule(req, cluster, now)
        if k % 5 == 4:         # stores gain and lose blocks between decisions
            s = f"s{rng.randrange(len(cluster.prefills) // 2)}"
            if rng.random() < 0.5:
                idx.add(s, range(rng.randint(0, 30)))
            else:
                idx.remove(s, range(rng.randint(0, 30), 40))
    assert taken                 # the path under test was the one taken


def test_match_runs_group_the_lengths_and_share_the_index_lists():
    idx = BlockIndex()
    idx.add("a", range(5))
    idx.add("b", range(5))
    idx.add("c", range(2))
    m1, m2 = idx.match(list(range(8))), idx.match(list(range(6)))
    assert {length: sorted(stores) for length, stores in m1.runs} == {2: ["c"], 5: ["a", "b"]}
    assert {s: n for n, stores in m1.runs for s in stores} == m1.lengths
    assert [stores for _, stores in m1.runs][1] is [stores for _, stores in m2.runs][1]   # the same list
    assert idx.match([9]).runs == ()


@pytest.mark.parametrize("seed", range(4))
def test_the_decode_rows_clamp_a_tbt_at_zero_only_where_it_can_fall_there(seed):
    """Decode models with a negative intercept give TBTs that the clamp at 0 ties; the rows
    must then pick as the loop does (the first instance with room)."""
    rng = random.Random(seed)
    idx, cluster = _cluster(rng, 60, True)
    models = [DecodeCostModel(c0=0.01, c1=1e-3, c2=1e-6), DecodeCostModel(c0=-0.5, c1=1e-3, c2=1e-7)]
    decodes = tuple(DecodeInstanceState(f"d{i}", tuple(DecodingRequest(f"d{i}-{j}", rng.randint(1, 4000), 0.0, 100)
                                                         for j in range(rng.randint(0, 5))),
                                        None, None, rng.choice(models) if rng.random() < 0.3 else None, ())
                    for i in range(60))
    cluster = ClusterState(cluster.prefills, decodes)
    costs = CostModels(MODEL, models[0], kv_bytes_per_token=2, bandwidth_bytes_per_s=1e5)
    config = SchedulerConfig(block_size=BS, ttft_slo_s=None, tbt_slo_s=None)
    cached, scratch = Scheduler(config, costs, idx), Scheduler(config, costs, idx, cache=FromScratch())
    for k in range(20):
        req = ScheduleRequest(f"r{k}", (1, 2), 2 * BS, rng.randint(1, 400))
        assert cached.schedule(req, cluster, 1.0) == scratch.schedule(req, cluster, 1.0)
