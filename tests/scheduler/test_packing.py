"""Prefill batching in the conductor's estimate (scheduler/packing.py): a queue priced as the
instance packs it, a new request priced packed with that queue, the estimate cache equal to its
definition on packing instances, and the conductor's bookkeeping starting a pack together."""

from __future__ import annotations


import orjson
import pytest
from hypothesis import given, settings, strategies as st

from mooncake_lite.common.protocol import Register
from mooncake_lite.conductor.cluster.membership import Membership, PrefillJob
from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel, DecodeInstanceState,
                                     FromScratch, PrefillCostModel, PrefillInstanceState, QueuedPrefill,
                                     ScheduleRequest, Scheduler, SchedulerConfig, prefill_queue_time)
from mooncake_lite.scheduler.costs import pack_sizes, packed_seconds
from mooncake_lite.scheduler.estimate import backlog_of, durations_of, queues_at
from mooncake_lite.scheduler import wide
from mooncake_lite.scheduler.packing import NO_TAIL, first_pack, joins_tail, packed_queue
from tests.scheduler.test_estimate_cache import OPS, run_history

MODEL = PrefillCostModel(c0=0.05, c1=1e-3, c2=1e-7, c3=1e-5)
COSTS = CostModels(MODEL, DecodeCostModel(c0=0.01, c1=1e-3), kv_bytes_per_token=64)
BS = 16


def job(rid: str, n: int, prefix: int = 0, started: float | None = None) -> QueuedPrefill:
    return QueuedPrefill(rid, n, prefix, started)


def test_a_burst_is_priced_as_forwards_each_paying_the_fixed_cost_once():
    # a 100-token job running since t=0, then six of 100 tokens waiting: packs of 5 and 1 at 512
    queue = (job("a", 100, started=0.0), *(job(f"w{i}", 100) for i in range(6)))
    alone = MODEL.predict(100)
    got = packed_queue(queue, MODEL, 512)
    pack = 5 * alone - 4 * MODEL.c0
    assert got.durations_s == pytest.approx([alone, pack, 0, 0, 0, 0, alone])
    assert (got.tail_tokens, got.tail_s) == (100, pytest.approx(alone))
    # every job's running sum is the end of its forward: the four behind w0 end with it
    cum = backlog_of(PrefillInstanceState("p", "s", queue, pack_tokens=512), MODEL).cumulative_s
    assert cum[1:6] == pytest.approx([alone + pack] * 5)
    # one at a time, the same queue costs one more c0 per job packed away
    one_by_one = prefill_queue_time(PrefillInstanceState("p", "s", queue), COSTS, 0.0)
    packed = prefill_queue_time(PrefillInstanceState("p", "s", queue, pack_tokens=512), COSTS, 0.0)
    assert one_by_one - packed == pytest.approx(4 * MODEL.c0)


def test_started_jobs_are_the_running_forward_and_count_done_for_their_elapsed_time():
    queue = (job("a", 200, started=1.0), job("b", 100, started=1.0), job("c", 300))
    p = PrefillInstanceState("p", "s", queue, pack_tokens=512)
    running = packed_seconds([MODEL.predict(200), MODEL.predict(100)], MODEL.c0)
    assert packed_queue(queue, MODEL, 512).durations_s == pytest.approx([running, 0.0, MODEL.predict(300)])
    assert prefill_queue_time(p, COSTS, 1.0 + running / 2) == pytest.approx(running / 2 + MODEL.predict(300))
    assert prefill_queue_time(p, COSTS, 99.0) == pytest.approx(MODEL.predict(300))
    # nothing waiting: no pack for a new request to join
    assert packed_queue(queue[:2], MODEL, 512).tail_tokens == NO_TAIL


def test_an_oversize_job_takes_nobody_and_a_cached_prefix_does_not_count():
    queue = (job("a", 10, started=0.0), job("big", 700), job("c", 30))
    assert packed_queue(queue, MODEL, 512).tail_tokens == 30
    assert packed_queue(queue[:2], MODEL, 512).tail_tokens == 513       # oversize: limit + 1
    assert not joins_tail(513, 1, 512) and joins_tail(30, 482, 512) and not joins_tail(30, 483, 512)
    cached = (job("a", 10, started=0.0), job("b", 600, prefix=400), job("c", 300))
    assert packed_queue(cached, MODEL, 512).tail_tokens == 200 + 300       # 200 uncached + 300


def test_without_a_budget_the_queue_is_priced_one_job_at_a_time():
    queue = (job("a", 100, started=0.0), job("b", 50, 16), job("c", 5))
    assert packed_queue(queue, MODEL, 0).durations_s == durations_of(queue, MODEL)
    assert backlog_of(PrefillInstanceState("p", "s", queue), MODEL).pack_tokens == 0


uncached_lists = st.lists(st.integers(1, 700), max_size=12)


@settings(max_examples=200, deadline=None)
@given(uncached_lists, st.integers(0, 600))
def test_first_pack_is_the_rules_first_cut(uncached, limit):
    assert first_pack(iter(uncached), limit) == (pack_sizes(uncached, limit)[0] if uncached else 0)


queues = st.lists(st.tuples(st.integers(1, 900), st.integers(0, 600)), max_size=10)


@settings(max_examples=200, deadline=None)
@given(queues, st.integers(0, 4), st.integers(0, 600), st.tuples(st.integers(1, 900), st.integers(0, 600)),
       st.floats(0.0, 3.0))
def test_a_new_request_is_predicted_to_end_where_the_queue_with_it_appended_does(jobs, started, limit, new, now):
    """Its predicted TTFT on an instance (queue + own execution) is the finish time of the same
    request as the last job of that instance's queue: priced packed with what is queued."""
    started = min(started, len(jobs))
    queue = tuple(job(f"q{i}", n, p, 0.0 if i < started else None) for i, (n, p) in enumerate(jobs))
    p = PrefillInstanceState("p", "s", queue, pack_tokens=limit)
    n, _ = new
    req = ScheduleRequest("new", (), n, 8)
    d = Scheduler(SchedulerConfig(block_size=BS), COSTS, BlockIndex(), cache=FromScratch()).schedule(
        req, _cluster(p), now)
    with_it = PrefillInstanceState("p", "s", (*queue, job("new", n, 0, now if not queue else None)),
                                   pack_tokens=limit)
    q = queues_at([backlog_of(with_it, MODEL)], now)
    assert d.predicted_queue_s + d.predicted_prefill_s == pytest.approx(
        q.backlogs[0].cumulative_s[-1] - q.done_s[0], abs=1e-12)
    if started > 1:
        return               # more than one job running is a pack: one at a time has no such queue
    # packing never predicts a longer wait than one job at a time
    alone = Scheduler(SchedulerConfig(block_size=BS), COSTS, BlockIndex(), cache=FromScratch()).schedule(
        req, _cluster(PrefillInstanceState("p", "s", queue)), now)
    assert d.predicted_ttft_s <= alone.predicted_ttft_s + 1e-12


@settings(max_examples=100, deadline=None)
@given(queues, st.integers(0, 4), st.integers(0, 600), st.integers(1, 900), st.floats(0.0, 3.0),
       st.sampled_from([0.5, 1.7]))
def test_the_queue_scale_scales_the_forwards_ahead_not_the_pack_a_request_joins(jobs, started, limit, n, now, scale):
    """A correction's ``queue_scale`` multiplies the wait for the work ahead; a request joining the
    last waiting pack runs in that pack's forward, priced as it is: its execution is unchanged."""
    started = min(started, len(jobs))
    queue = tuple(job(f"q{i}", k, p, 0.0 if i < started else None) for i, (k, p) in enumerate(jobs))
    req = ScheduleRequest("new", (), n, 8)

    def decide(q: float):
        p = PrefillInstanceState("p", "s", queue, pack_tokens=limit, queue_scale=q)
        return Scheduler(SchedulerConfig(block_size=BS), COSTS, BlockIndex(), cache=FromScratch()).schedule(
            req, _cluster(p), now)
    plain, scaled = decide(1.0), decide(scale)
    assert scaled.predicted_queue_s == pytest.approx(scale * plain.predicted_queue_s, abs=1e-12)
    assert scaled.predicted_prefill_s == pytest.approx(plain.predicted_prefill_s, abs=1e-12)


def _cluster(p: PrefillInstanceState) -> ClusterState:
    return ClusterState((p,), (DecodeInstanceState("d"),))


def test_the_request_goes_where_packing_makes_it_first():
    """Two instances with the same queued work: the one that packs would serve a short prompt in
    its waiting forward; without the budget the two tie and the first is taken."""
    queue = (job("a", 100, started=0.0), *(job(f"w{i}", 60) for i in range(4)))
    plain = PrefillInstanceState("p0", "s0", queue)
    packs = PrefillInstanceState("p1", "s1", tuple(job(j.request_id + "'", j.num_tokens, 0, j.started_at)
                                                   for j in queue), pack_tokens=512)
    clus = ClusterState((plain, packs), (DecodeInstanceState("d"),))
    d = Scheduler(SchedulerConfig(block_size=BS), COSTS, BlockIndex()).schedule(ScheduleRequest("x", (), 40, 8), clus, 0.0)
    assert d.prefill_id == "p1"
    pack = packed_seconds([MODEL.predict(60)] * 4 + [MODEL.predict(40)], MODEL.c0)
    assert d.predicted_queue_s == pytest.approx(MODEL.predict(100))       # the forward ahead of its own
    assert d.predicted_prefill_s == pytest.approx(pack)                   # its own: the pack it joins
    assert d.route == "balance"


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.sampled_from(OPS), min_size=30, max_size=120),
       st.sampled_from(["early", "predictive"]), st.sampled_from([64, 512]), st.booleans())
def test_decisions_through_the_cache_equal_from_scratch_on_packing_instances(seed, ops, admission, budget, arrays):
    saved = wide.WIDE_MIN_INSTANCES
    wide.WIDE_MIN_INSTANCES = 1 if arrays else saved     # the cache's array rows give the queue times
    try:
        _packing_history(seed, ops, admission, budget)
    finally:
        wide.WIDE_MIN_INSTANCES = saved


def _packing_history(seed, ops, admission, budget):
    def packing(world):                           # these instances pack (a re-registration may stop it)
        for view in world.prefills.values():
            view.set_instance(*view._about[:3], budget)
    config = SchedulerConfig(admission=admission, block_size=16, ttft_slo_s=5.0, tbt_slo_s=0.05)
    run_history(seed, ops, config, None, prepare=packing)


# ---- the conductor's bookkeeping -----------------------------------------------------------------
def _reg(iid: str, pack_tokens: int) -> Register:
    return Register(role="prefill", instance_id=iid, http=f"h-{iid}:1", data=None, store="s:1", model="tiny",
                    block_size=16, hash_seed=0, kv_bytes_per_token=64, max_context=4000, pack_tokens=pack_tokens)


def test_the_conductor_starts_the_jobs_the_head_takes_along():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("p", 256), now=0)
    assert m.snapshot().prefills[0].pack_tokens == 256
    for i, n in enumerate([50, 100, 100, 50, 100, 300]):
        m.add_prefill("p", PrefillJob(f"r{i}", n, 0, "d"), now=0.5)
    started = lambda: [j.started_at for j in m.snapshot().prefills[0].queue]   # noqa: E731
    assert started() == [0.5] + [None] * 5          # r0 began alone: the others came after it
    m.prefill_done("p", "r0", now=1.0)               # r1 takes r2 and r3 along (250 of 256 tokens)
    assert started() == [1.0, 1.0, 1.0, None, None]
    # A pack's results arrive together, one by one: the first says the instance has moved on to
    # the next forward, r4's (r5's 300 tokens do not fit beside it), which starts now.
    m.prefill_done("p", "r1", now=2.0)
    assert started() == [1.0, 1.0, 2.0, None]
    m.prefill_done("p", "r2", now=2.01)
    m.prefill_done("p", "r3", now=2.02)
    assert started() == [2.0, None]


def test_the_budget_crosses_the_wire_and_an_instance_that_does_not_send_it_packs_nothing():
    from mooncake_lite.common.protocol import dumps, loads
    assert loads(Register, dumps(_reg("p", 192))).pack_tokens == 192
    old = orjson.loads(dumps(_reg("p", 0)))
    del old["pack_tokens"]                      # an instance from before the field
    assert loads(Register, orjson.dumps(old)).pack_tokens == 0


def test_an_instance_that_does_not_pack_is_shown_one_job_at_a_time():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("p", 0), now=0)
    for i in range(3):
        m.add_prefill("p", PrefillJob(f"r{i}", 10, 0, "d"), now=0.0)
    m.prefill_done("p", "r0", now=1.0)
    p = m.snapshot().prefills[0]
    assert p.pack_tokens == 0 and [j.started_at for j in p.queue] == [1.0, None]


def test_a_prefill_instance_registers_its_budget_capped_at_its_chunk():
    """What the conductor reads: ``Register.pack_tokens`` is the instance's own pack limit (its
    budget capped at its chunk; 0 off, and in a CPP group, which never packs)."""
    from types import SimpleNamespace

    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.model.weights import build_model
    from mooncake_lite.prefill.app import registration
    from mooncake_lite.prefill.config import Config
    from mooncake_lite.prefill.service import PrefillService

    stage = SimpleNamespace(runner=ModelRunner(build_model("tiny", seed=3), num_blocks=8, block_size=8))

    def registered(budget, downstream=None):
        service = PrefillService(stage, None, block_size=8, hash_seed=0, chunk_size=64, batch_tokens=budget,
                                 downstream=downstream)
        return registration(Config(), service, {"http": "127.0.0.1:1"}, None).pack_tokens

    assert [registered(48), registered(500), registered(0), registered(48, downstream=object())] == [48, 64, 0, 0]
    # and its chunk, which long prompts are priced by (and which tells the conductor it reads pack caps)
    service = PrefillService(stage, None, block_size=8, hash_seed=0, chunk_size=64, batch_tokens=48)
    assert registration(Config(prefill_chunk=64), service, {"http": "127.0.0.1:1"}, None).prefill_chunk == 64


def test_each_member_of_a_pack_pays_its_own_part_of_the_fixed_cost():
    """``member_c0``: of ``c0``, what each job beyond a pack's first still pays (timed at start-up,
    ``prefill/profiling.with_member_cost``); the pack shares the rest once, in the queue as priced,
    a joining request's own share and the simulator's forward alike (one rule: ``shared_c0``)."""
    from dataclasses import replace

    from mooncake_lite.scheduler.costs import packed_durations, scaled
    from mooncake_lite.scheduler.packing import forward_seconds, own_seconds
    model = replace(MODEL, member_c0=0.02)
    assert model.shared_c0 == pytest.approx(0.03)
    alone = model.predict(100)
    queue = tuple(job(f"w{i}", 100) for i in range(3))
    assert packed_queue(queue, model, 512).durations_s == pytest.approx([3 * alone - 2 * 0.03, 0, 0])
    assert packed_durations(model, [(100, 0)] * 3, 512) == pytest.approx([0, 0, 3 * alone - 2 * 0.03])
    assert own_seconds(model, 100, 0, joins=True) == pytest.approx(alone - 0.03)
    assert forward_seconds(model, 100, 0, 200, 2) == pytest.approx(2 * alone - 0.03)
    # none said: the whole c0 shared, as before; all of it or more: nothing shared
    assert MODEL.shared_c0 == MODEL.c0 and replace(MODEL, member_c0=0.9).shared_c0 == 0.0
    # it travels, keeps with a chunk, and scales with the model's other coefficients
    assert PrefillCostModel.from_dict(model.to_dict()) == model
    assert model.with_chunk(512).member_c0 == 0.02 and model.with_chunk(512).shared_c0 == pytest.approx(0.03)
    assert scaled(model, 2.0).member_c0 == pytest.approx(0.04)
