"""The wide-cluster arrays (scheduler/wide.py) against the per-instance loops, and the views'
StateTuple against building every state.

The arrays must give the very decisions the loops give: the random histories of
test_estimate_cache run with the arrays used from one instance up, and a wide cluster of many
instances, some sharing a cost model and some with their own, is decided both ways."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     DecodeView, DecodingRequest, FromScratch, IncomingRequest,
                                     PrefillCostModel, PrefillInstanceState, PrefillView, QueuedPrefill,
                                     ScheduleRequest, Scheduler, SchedulerConfig)
from mooncake_lite.scheduler import wide
from mooncake_lite.scheduler.estimate import queues_at
from mooncake_lite.scheduler.snapshot import StateTuple

from tests.scheduler.test_estimate_cache import BS, COSTS, OPS, World, _index


class _Wide:
    """The arrays used from ``threshold`` instances up, inside the block."""

    def __init__(self, threshold: int) -> None:
        self.threshold, self.saved = threshold, wide.WIDE_MIN_INSTANCES

    def __enter__(self) -> None:
        wide.WIDE_MIN_INSTANCES = self.threshold

    def __exit__(self, *_) -> None:
        wide.WIDE_MIN_INSTANCES = self.saved


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.sampled_from(OPS), min_size=30, max_size=150),
       st.sampled_from(["none", "early", "predictive"]), st.sampled_from(["kvcache-centric", "cache-aware"]),
       st.sampled_from([(None, None), (5.0, 0.05)]))
def test_decisions_by_the_arrays_equal_the_loops_through_any_history(seed, ops, admission, strategy, slos):
    rng = random.Random(seed)
    config = SchedulerConfig(strategy=strategy, admission=admission, block_size=BS,
                             ttft_slo_s=slos[0], tbt_slo_s=slos[1])
    _decide_cached_and_from_scratch(rng, World(rng), config, ops)


def _decide_cached_and_from_scratch(rng: random.Random, world: World, config: SchedulerConfig, ops) -> None:
    """Play ``ops`` on ``world``; at each "decide" (and at the end) the cached scheduler (wide
    arrays at any width) decides as one from scratch, and its prefill table's rows are the queues
    computed from scratch."""
    idx = _index(rng)
    cached = Scheduler(config, COSTS, idx)
    scratch = Scheduler(config, COSTS, idx, cache=FromScratch())
    with _Wide(1):
        for op in ops + ["decide"]:
            world.step(op)
            if op != "decide":
                continue
            cluster, blocks = world.cluster(), rng.randint(1, 12)
            req = ScheduleRequest(f"x{world.n}", tuple(range(blocks)), blocks * BS + rng.randrange(BS),
                                  rng.randint(1, 400))
            now = world.now
            assert cached.schedule(req, cluster, now) == scratch.schedule(req, cluster, now)
            if cluster.prefills:
                rows = cached.cache.prefill_table(cluster.prefills, COSTS).queues_at(now)  # lists made when read
                assert (rows.backlogs, rows.done_s, rows.queue_s, rows.scaled) == \
                    tuple(queues_at(FromScratch.backlogs(cluster.prefills, COSTS), now))


class _SnapshotWorld(World):
    """The same histories, the decisions taken on the views' own snapshots (``StateTuple``, as
    the simulator takes them) while every instance is live: the wide tables then read the rows
    the views kept at their events (a decode's load, a prefill's total and started head)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.tuples = (StateTuple(self.prefills.values()), StateTuple(self.decodes.values()))

    def cluster(self) -> ClusterState:
        if len(self.live) < len(self.prefills) + len(self.decodes):
            return super().cluster()
        return ClusterState(self.tuples[0].states(), self.tuples[1].states())


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.sampled_from(OPS + ["decide"] * 3), min_size=30, max_size=150),
       st.sampled_from(["none", "early", "predictive"]))
def test_decisions_on_the_views_snapshots_equal_those_from_scratch(seed, ops, admission):
    rng = random.Random(seed)
    config = SchedulerConfig(admission=admission, block_size=BS, ttft_slo_s=5.0, tbt_slo_s=0.05)
    _decide_cached_and_from_scratch(rng, _SnapshotWorld(rng), config, ops)


PREFILL_MODELS = [None, PrefillCostModel(c0=0.02, c1=2e-3), PrefillCostModel(c1=5e-4, c2=1e-6, c3=1e-5)]


def _wide_cluster(rng: random.Random, n: int, own_models: bool) -> tuple[BlockIndex, ClusterState]:
    """``n`` prefill and ``n`` decode instances; several share a store and a model; queues with
    one, two (started) or no started jobs; decodes with limits, some full."""
    idx = BlockIndex()
    for s in range(n // 3):
        idx.add(f"s{s}", range(rng.randint(0, 40)))
    prefills, decodes = [], []
    for i in range(n):
        model = PrefillCostModel(c0=rng.uniform(0, 0.05), c1=rng.uniform(1e-4, 1e-3), c2=rng.uniform(0, 1e-6)) \
            if own_models else rng.choice(PREFILL_MODELS)
        started = rng.choice([0, 1, 1, 2])
        queue = tuple(QueuedPrefill(f"q{i}-{j}", rng.randint(1, 3000), rng.randint(0, 1000),
                                    rng.uniform(-5, 1) if j < started else None)
                      for j in range(rng.choice([0, 0, 1, 3]) + started))
        prefills.append(PrefillInstanceState(f"p{i}", f"s{rng.randrange(n // 3)}", queue,
                                             rng.choice([None, 1e4, 1e6]), model,
                                             queue_scale=rng.choice([1.0, 1.0, 0.5, 1.7])))
        running = tuple(DecodingRequest(f"d{i}-{j}", rng.randint(1, 4000), -rng.uniform(0, 20), 100)
                        for j in range(rng.randint(0, 8)))
        incoming = tuple(IncomingRequest(f"i{i}-{j}", rng.randint(1, 4000), 50) for j in range(rng.randint(0, 2)))
        decodes.append(DecodeInstanceState(f"d{i}", running, rng.choice([None, 3, 20]),
                                           rng.choice([None, 5000, 10**6]),
                                           rng.choice([None, DecodeCostModel(c0=0.01, c1=1e-3, c2=1e-6)]),
                                           incoming))
    return idx, ClusterState(tuple(prefills), tuple(decodes))


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**32), st.booleans(), st.sampled_from(["none", "early", "predictive"]))
def test_a_wide_cluster_is_decided_as_the_loops_decide_it(seed, own_models, admission):
    rng = random.Random(seed)
    idx, cluster = _wide_cluster(rng, 60, own_models)
    costs = CostModels(COSTS.prefill, COSTS.decode, kv_bytes_per_token=2, bandwidth_bytes_per_s=1e5,
                       transfer_latency_s=rng.choice([0.0, 0.01]))
    config = SchedulerConfig(admission=admission, block_size=BS, ttft_slo_s=None, tbt_slo_s=None)
    cached, scratch = Scheduler(config, costs, idx), Scheduler(config, costs, idx, cache=FromScratch())
    assert len(cluster.prefills) >= wide.WIDE_MIN_INSTANCES
    for k in range(30):
        blocks = rng.randint(1, 40)
        req = ScheduleRequest(f"r{k}", tuple(range(blocks)), blocks * BS + rng.randrange(BS), rng.randint(1, 400))
        now = rng.uniform(-1, 10)
        assert cached.schedule(req, cluster, now) == scratch.schedule(req, cluster, now)
        if k % 3 == 0:   # a few instances change between decisions, as between two snapshots
            prefills, decodes = list(cluster.prefills), list(cluster.decodes)
            _, other = _wide_cluster(random.Random(rng.random()), 60, own_models)
            for i in rng.sample(range(60), 4):
                prefills[i], decodes[i] = other.prefills[i], other.decodes[i]
            cluster = ClusterState(tuple(prefills), tuple(decodes))


def test_state_tuple_rebuilds_only_what_changed_and_equals_every_state():
    rng = random.Random(7)
    prefills = [PrefillView(f"p{i}", f"s{i}") for i in range(5)]
    decodes = [DecodeView(f"d{i}", COSTS.decode) for i in range(5)]
    pt, dt = StateTuple(prefills), StateTuple(decodes)
    for step in range(300):
        before_p, before_d = pt.states(), dt.states()
        i, rid = rng.randrange(5), f"r{step}"
        op = rng.choice(["add", "remove", "commit", "join", "progress", "leave", "nothing"])
        if op == "add":
            prefills[i].add(rid, 100)
        elif op == "remove" and prefills[i]._jobs:
            prefills[i].remove(next(iter(prefills[i]._jobs)))
        elif op == "commit":
            decodes[i].commit(rid, 50, 10)
        elif op == "join":
            decodes[i].join(rid, 50, float(step), 10)
        elif op == "progress":
            for r in list(decodes[i]._jobs):
                decodes[i].progress(r, 40)
        elif op == "leave" and decodes[i]._jobs:
            decodes[i].leave(rng.choice(list(decodes[i]._jobs)))
        after_p, after_d = pt.states(), dt.states()
        assert after_p == tuple(v.state() for v in prefills) and after_d == tuple(v.state() for v in decodes)
        for before, after in ((before_p, after_p), (before_d, after_d)):
            for j, (old, new) in enumerate(zip(before, after)):
                assert old is new or j == i     # only the instance told something may change
            # what the tables read: the rows the snapshot names are exactly those an identity
            # scan finds, and a snapshot links only to the one before it
            scanned = [j for j, (old, new) in enumerate(zip(before, after)) if old is not new]
            assert sorted(wide.changed_rows(after, before)) == scanned
        for st, before, after in ((pt, before_p, after_p), (dt, before_d, after_d)):
            assert after is before or st.last.previous is before
            assert sorted(wide.changed_rows(after, before, st.last)) == sorted(wide.changed_rows(after, before))
