"""The estimate cache (scheduler/cache.py) against its from-scratch definition.

Random histories of instances joining and leaving the cluster, jobs queued, started and
finished, requests committed to decodes, joining their batches, generating tokens and leaving —
told to the same instance views the conductor and the simulator use — with decisions taken at
random points: every decision and every estimate made through the cache must equal the one
computed from scratch on the same snapshot."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import example, given, settings, strategies as st

from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     DecodeView, DecodingRequest, EstimateCache, FromScratch, PrefillCostModel,
                                     PrefillInstanceState, PrefillView, QueuedPrefill, ScheduleRequest, Scheduler,
                                     SchedulerConfig, prefill_queue_time)
from mooncake_lite.scheduler.cache import MAX_EDITED_LEAVES, batch_change
from mooncake_lite.scheduler.estimate import decode_load_at, loads_at, queues_at

BS = 16
# Decode steps that one request moves by a few percent (within MAX_TBT_DRIFT: leave profiles
# get edited) or by more (re-priced), per instance.
COSTS = CostModels(prefill=PrefillCostModel(c0=0.01, c1=1e-3, c2=1e-7),
                   decode=DecodeCostModel(c0=0.05, c1=1e-3, c2=1e-7), kv_bytes_per_token=1,
                   bandwidth_bytes_per_s=1e5)
OWN_PREFILL = (None, PrefillCostModel(c0=0.02, c1=2e-3), PrefillCostModel(c1=5e-4, c2=1e-6))
OWN_DECODE = (None, DecodeCostModel(c0=0.1, c1=1e-3, c2=1e-7), DecodeCostModel(c0=0.005, c1=1e-2))
times = st.floats(-50, 50, allow_nan=False)


class World:
    """Three prefill and three decode instances, each behind its instance view, driven by
    ``rng`` the way the conductor drives them (Membership), with instances dying and coming back
    (a view emptied and shown again) and re-registering with another cost model."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.now, self.n = rng, 0.0, 0
        self.prefills = {f"p{i}": PrefillView(f"p{i}", f"s{i}", rng.choice([None, 1e4]), rng.choice(OWN_PREFILL))
                         for i in range(3)}
        self.decodes = {f"d{i}": DecodeView(f"d{i}", rng.choice(OWN_DECODE)) for i in range(3)}
        self.live = set(self.prefills) | set(self.decodes)
        self.jobs: dict[str, tuple[str, str, int, int]] = {}      # rid -> (prefill, decode, tokens, max_out)
        self.queues: dict[str, list[str]] = {p: [] for p in self.prefills}
        self.running: dict[str, list[str]] = {d: [] for d in self.decodes}

    def cluster(self) -> ClusterState:
        return ClusterState(tuple(v.state() for i, v in self.prefills.items() if i in self.live),
                            tuple(v.state() for i, v in self.decodes.items() if i in self.live))

    def step(self, op: str) -> None:
        if op == "burst":
            for _ in range(6):
                self.step("dispatch")
            return
        rng = self.rng
        self.now += rng.uniform(0, 2)
        live_p = [p for p in self.prefills if p in self.live]
        live_d = [d for d in self.decodes if d in self.live]
        if op == "dispatch" and live_p and live_d:
            self.n += 1
            rid, p, d = f"r{self.n}", rng.choice(live_p), rng.choice(live_d)
            tokens, max_out = rng.choice([1, 10, 100]) * rng.randint(1, 300), rng.choice([None, 5, 50, 500])
            queue = self.queues[p]
            self.prefills[p].add(rid, tokens, rng.randint(0, tokens - 1), None if queue else self.now)
            queue.append(rid)
            self.decodes[d].commit(rid, tokens + 1, max_out)
            self.jobs[rid] = (p, d, tokens, max_out)
        elif op == "prefill_end":
            busy = [p for p in live_p if self.queues[p]]
            if busy:
                p = rng.choice(busy)
                rid = self.queues[p].pop(0)
                self.prefills[p].remove(rid)
                if self.queues[p]:
                    self.prefills[p].start(self.queues[p][0], self.now)
                _, d, tokens, max_out = self.jobs[rid]
                if d in self.live:
                    self.decodes[d].join(rid, tokens + 1, self.now, max_out)
                    self.running[d].append(rid)
        elif op == "report":           # a heartbeat: the running head's end, as its chunks say
            busy = [p for p in live_p if self.queues[p]]
            if busy:
                p = rng.choice(busy)
                self.prefills[p].report_end(self.queues[p][0], self.now + rng.uniform(-0.5, 3.0))
        elif op == "tokens":
            for d in live_d:
                for rid in self.running[d]:
                    self.decodes[d].progress(rid, rng.choice([0, 1, 2, 5, 40]))
        elif op == "finish":
            busy = [d for d in live_d if self.running[d]]
            if busy:
                d = rng.choice(busy)
                rid = self.running[d].pop(rng.randrange(len(self.running[d])))
                self.decodes[d].leave(rid)
        elif op == "abort":
            waiting = [(p, rid) for p in live_p for rid in self.queues[p]]
            if waiting:
                p, rid = rng.choice(waiting)
                self.queues[p].remove(rid)
                self.prefills[p].remove(rid)
                self.decodes[self.jobs[rid][1]].leave(rid)
        elif op == "limits" and live_d:
            self.decodes[rng.choice(live_d)].set_limits(rng.choice([None, 4, 30]), rng.choice([None, 5000, 10**6]))
        elif op == "reregister":
            if rng.random() < 0.5 and live_d:
                self.decodes[rng.choice(live_d)].set_cost(rng.choice(OWN_DECODE))
            elif live_p:
                i = rng.choice(live_p)
                self.prefills[i].set_instance(f"s{rng.randrange(3)}", rng.choice([None, 1e4]), rng.choice(OWN_PREFILL))
                self.prefills[i].set_queue_scale(rng.choice([1.0, 0.5, 1.7]))    # the correction's
        elif op == "die":
            iid = rng.choice(sorted(self.live)) if self.live else None
            if iid is not None:
                self.live.discard(iid)
                {**self.prefills, **self.decodes}[iid].clear()
                for rid in self.queues.get(iid, []):
                    self.decodes[self.jobs[rid][1]].leave(rid)
                self.queues.get(iid, []).clear()
                self.running.get(iid, []).clear()
        elif op == "revive":
            self.live |= set(self.prefills) | set(self.decodes)


OPS = ["dispatch"] * 4 + ["prefill_end"] * 3 + ["tokens"] * 2 + ["finish"] * 2 + \
    ["burst", "abort", "limits", "reregister", "die", "revive", "decide", "decide", "report"]


def _index(rng: random.Random) -> BlockIndex:
    idx = BlockIndex()
    for i in range(3):
        idx.add(f"s{i}", range(rng.randint(0, 12)))
    return idx


def _check_estimates(cluster: ClusterState, cache: EstimateCache, now: float, uniform: float | None) -> None:
    scratch = FromScratch()
    queues = queues_at(cache.backlogs(cluster.prefills, COSTS), now)
    assert queues == queues_at(scratch.backlogs(cluster.prefills, COSTS), now)
    assert cache.loads_now(cluster.decodes) == scratch.loads_now(cluster.decodes)
    cached = cache.leave_profiles(cluster.decodes, COSTS, uniform)
    fresh = scratch.leave_profiles(cluster.decodes, COSTS, uniform)
    unknown = tuple(replace(d, incoming_shortest=0.0) for d in cluster.decodes)   # every request checked
    for t in (now, now + 0.5, now + 5.0, now + 50.0):
        loads = loads_at(cluster.decodes, cached, now, t, queues, uniform, COSTS.decode)
        assert loads == loads_at(cluster.decodes, fresh, now, t, queues, uniform, COSTS.decode)
        # The views' bound on the shortest incoming output skips the look-up where every incoming
        # request outlasts t at the step now; at the joining step (shorter once running requests
        # have left) one may not: then it is counted all the same. Never a lighter load.
        for (batch, context), (exact_batch, exact_context) in \
                zip(loads, loads_at(unknown, fresh, now, t, queues, uniform, COSTS.decode)):
            assert batch >= exact_batch and context >= exact_context


_FOUND = dict(D="dispatch", P="prefill_end", T="tokens", R="reregister", V="revive", F="finish", L="limits", X="die")


@settings(max_examples=60, deadline=None)
# the history where the shortcut counted a request the joining step let leave: (6, 6044) against (5, 5683)
@example(39811, [_FOUND[op] for op in "DDDPPDPTRVDPFPLPDXXD" + "D" * 25 + "PPPPDPDDP"], "early", None, (None, None))
@given(st.integers(0, 2**32), st.lists(st.sampled_from(OPS), min_size=30, max_size=150),
       st.sampled_from(["early", "predictive"]), st.sampled_from([None, 3.0, 40.0]),
       st.sampled_from([(None, None), (5.0, 0.05)]))
def test_decisions_and_estimates_through_the_cache_equal_those_from_scratch(seed, ops, admission, uniform, slos):
    config = SchedulerConfig(admission=admission, uniform_decode_s=uniform, block_size=BS,
                             ttft_slo_s=slos[0], tbt_slo_s=slos[1])
    run_history(seed, ops, config, uniform)


def run_history(seed, ops, config, uniform, prepare=lambda world: None):
    """Play ``ops`` on a random world (``prepare`` sets it up first); at every "decide", the
    cached scheduler decides as one from scratch does and its estimates equal fresh ones."""
    rng = random.Random(seed)
    world, idx = World(rng), _index(rng)
    prepare(world)
    cached = Scheduler(config, COSTS, idx)
    scratch = Scheduler(config, COSTS, idx, cache=FromScratch())
    for op in ops + ["decide"]:
        world.step(op)
        if op != "decide":
            continue
        cluster, blocks = world.cluster(), rng.randint(1, 12)
        req = ScheduleRequest(f"x{world.n}", tuple(range(blocks)), blocks * BS + rng.randrange(BS), rng.randint(1, 400))
        assert cached.schedule(req, cluster, world.now) == scratch.schedule(req, cluster, world.now)
        _check_estimates(cluster, cached.cache, world.now, uniform)


# ---- the definitions themselves --------------------------------------------------------------
@st.composite
def decode_states(draw):
    running = tuple(DecodingRequest(f"r{i}", draw(st.integers(1, 5000)), draw(times),
                                    draw(st.one_of(st.none(), st.integers(1, 2000))))
                    for i in range(draw(st.integers(0, 12))))
    return DecodeInstanceState("d", running, tbt_s=draw(st.one_of(st.none(), st.floats(0.001, 0.5))))


def staying_by_definition(d: DecodeInstanceState, t: float, uniform: float | None) -> tuple[int, int]:
    tbt = d.tbt_s if d.tbt_s is not None else \
        COSTS.decode.predict(len(d.running), sum(r.context_tokens for r in d.running))
    left = [r for r in d.running
            if (uniform is not None and r.joined_at + uniform > t)
            or (uniform is None and (r.max_output_tokens is None or r.joined_at + r.max_output_tokens * tbt > t))]
    return len(left), sum(r.context_tokens for r in left)


@settings(max_examples=150, deadline=None)
@given(decode_states(), st.lists(times, min_size=1, max_size=5), st.one_of(st.none(), st.floats(0.1, 30)))
def test_predicted_decode_load_matches_the_definition(d, ts, uniform):
    cache = EstimateCache()
    for t in ts:
        assert decode_load_at(d, COSTS, 0.0, t, None, uniform) == staying_by_definition(d, t, uniform)
        profiles = cache.leave_profiles((d,), COSTS, uniform)
        assert loads_at((d,), profiles, 0.0, t, None, uniform, COSTS.decode) == \
            [staying_by_definition(d, t, uniform)]


@st.composite
def prefill_states(draw):
    n = draw(st.integers(0, 6))
    started = draw(st.integers(0, n))
    queue = tuple(QueuedPrefill(f"q{i}", draw(st.integers(1, 4000)), draw(st.integers(0, 3000)),
                                draw(times) if i < started else None) for i in range(n))
    return PrefillInstanceState("p", "s", queue, queue_scale=draw(st.sampled_from([1.0, 0.5, 1.7])))


@settings(max_examples=150, deadline=None)
@given(prefill_states(), st.lists(times, min_size=1, max_size=5))
def test_queue_time_matches_the_definition_at_every_now(p, nows):
    """The work left (a started job done for its elapsed time), waited for ``queue_scale`` times."""
    for now in nows:
        total, done = 0.0, 0.0
        for i, job in enumerate(p.queue):
            cost = COSTS.prefill.predict(job.num_tokens, job.num_prefix_tokens)
            total += cost
            if job.started_at is not None and all(j.started_at is not None for j in p.queue[:i]):
                done += min(cost, max(0.0, now - job.started_at))
        assert abs(prefill_queue_time(p, COSTS, now) - (total - done) * p.queue_scale) < 1e-9


# ---- how the cache edits a leave profile -----------------------------------------------------
records = [DecodingRequest(f"r{i}", i + 1, float(i)) for i in range(20)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(records), max_size=15, unique=True),
       st.lists(st.sampled_from(records), max_size=15, unique=True))
def test_batch_change_accounts_for_every_record_of_any_two_batches(old, new):
    change = batch_change(tuple(old), tuple(new))
    if change is None:                   # too many leaving to be worth editing
        assert len(old) > MAX_EDITED_LEAVES
        return
    left, joined = change
    remaining = list(old)
    for r in left:
        remaining.remove(r)
    assert sorted(map(id, remaining + list(joined))) == sorted(map(id, new))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(records), max_size=15, unique=True), st.data())
def test_batch_change_of_a_view_edit_is_exactly_its_joins_and_leaves(old, data):
    """A view takes leaving records out (the rest stay in order) and appends joining ones."""
    kept = [r for r in old if data.draw(st.booleans())]
    appended = tuple(r for r in records if r not in old)[:data.draw(st.integers(0, 3))]
    change = batch_change(tuple(old), (*kept, *appended))
    if len(old) - len(kept) > MAX_EDITED_LEAVES:
        assert change is None
    else:
        assert change == ([r for r in old if r not in kept], appended)
