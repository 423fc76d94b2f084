"""The conductor follows a prefill instance's registered queue order (scheduler/queue_order.py):
its view of the queue is the instance's serving order, the next job started is the one the
instance serves next, and a new request is priced where it lands plus the overtakes allowed."""

import orjson
import pytest

from mooncake_lite.common.protocol import Register, dumps, loads
from mooncake_lite.conductor.cluster.membership import Membership, PrefillJob
from mooncake_lite.instance.refine import cost_report
from mooncake_lite.scheduler import (BlockIndex, CostModels, DecodeCostModel, PrefillCostModel, ScheduleRequest,
                                     Scheduler, SchedulerConfig)

MODEL = PrefillCostModel(c0=0.05, c1=1e-3, c2=1e-7, c3=1e-5)


def _reg(iid: str, overtakes: int, pack_tokens: int = 0) -> Register:
    return Register(role="prefill", instance_id=iid, http=f"h-{iid}:1", data=None, store="s:1", model="tiny",
                    block_size=16, hash_seed=0, kv_bytes_per_token=64, max_context=4000,
                    cost=cost_report(MODEL), pack_tokens=pack_tokens, queue_overtakes=overtakes)


def _order(m):
    return [j.request_id for j in m.snapshot().prefills[0].queue]


@pytest.mark.parametrize("overtakes, order", [(0, ["r0", "r1", "r2", "r3", "r4"]),
                                              (4, ["r0", "r4", "r3", "r2", "r1"])])
def test_the_view_is_the_instances_serving_order_and_the_next_started_its_head(overtakes, order):
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("p", overtakes), now=0)
    assert m.snapshot().prefills[0].overtakes == overtakes
    for i, n in enumerate([500, 400, 300, 200, 100]):       # r0 starts at once: it is never passed
        m.add_prefill("p", PrefillJob(f"r{i}", n, 0, "d"), now=0.0)
    assert _order(m) == order
    m.prefill_done("p", "r0", now=1.0)
    queue = m.snapshot().prefills[0].queue
    assert queue[0].request_id == order[1] and queue[0].started_at == 1.0
    assert [j.started_at for j in queue[1:]] == [None] * 3
    # a cached prefix counts: 1000 tokens of which 960 cached is shorter than every one waiting
    m.add_prefill("p", PrefillJob("cached", 1000, 960, "d"), now=1.5)
    assert _order(m)[1] == ("cached" if overtakes else order[2])


def test_a_new_request_is_priced_where_it_lands_with_the_overtakes_it_allows():
    """Priced where it lands, plus the learned share of the overtakes its bound allows: 0 at
    first (``correction.show_start``: the queue as it stands); at share 1 a long request meets
    the worst case, 4 shorter later arrivals, and a short one none (no recent arrival was shorter)."""
    costs = CostModels(MODEL, DecodeCostModel(c0=0.01, c1=1e-3), kv_bytes_per_token=64)
    decisions = {}
    for overtakes, share in ((0, 0.0), (4, 0.0), (4, 1.0)):
        m = Membership("tiny", 16, 0, dead_after_s=5)
        m.register(_reg("p", overtakes), now=0)
        m.register(Register(role="decode", instance_id="d", http="h-d:1", data="h-d:2", store="s:1", model="tiny",
                            block_size=16, hash_seed=0, kv_bytes_per_token=64, max_context=100000), now=0)
        for i, n in enumerate([500, 400, 300]):
            m.add_prefill("p", PrefillJob(f"r{i}", n, 0, "d"), now=0.0)
        m.get("p").view.set_overtake_share(share)
        sched = Scheduler(SchedulerConfig(block_size=16), costs, BlockIndex())
        decisions[overtakes, share] = {n: sched.schedule(ScheduleRequest("x", (), n, 8), m.snapshot(), now=0.0)
                                       for n in (100, 600)}
    ahead = MODEL.predict(500)      # r0 runs; a 100-token request passes r1 and r2
    fifo, start, learned = decisions[0, 0.0], decisions[4, 0.0], decisions[4, 1.0]
    assert fifo[100].predicted_queue_s == pytest.approx(ahead + MODEL.predict(400) + MODEL.predict(300))
    assert start[100].predicted_queue_s == learned[100].predicted_queue_s == pytest.approx(ahead)
    assert start[600].predicted_queue_s == pytest.approx(fifo[600].predicted_queue_s)
    # a long one waits for all of them, and for the 4 shorter ones that may still pass it
    assert learned[600].predicted_queue_s == pytest.approx(fifo[600].predicted_queue_s + 4 * MODEL.predict(600))


def test_the_bound_crosses_the_wire_and_an_instance_that_does_not_send_it_is_fifo():
    assert loads(Register, dumps(_reg("p", 3))).queue_overtakes == 3
    old = orjson.loads(dumps(_reg("p", 0)))
    del old["queue_overtakes"]                  # an instance from before the field
    assert loads(Register, orjson.dumps(old)).queue_overtakes == 0


async def test_a_request_the_decode_refused_gives_back_the_overtakes_it_took(make_cluster):
    """The conductor queues a job on its prefill's view before decode reserves room; if decode
    refuses, the prefill never heard of it, so the jobs it passed must not keep its overtake."""
    import asyncio

    import openai

    from tests.conductor import fakes
    from tests.conductor.test_api import client

    cluster = await make_cluster(prefill=0, decode=1, dead_after=30.0)   # a loaded box must not reap p0
    p0 = await cluster.add("prefill", "p0", store="s0:1", register=False)
    status, body = await fakes.register(cluster.session, cluster.url, p0, queue_overtakes=4)
    assert status == 200, body
    p0.behaviour.hang = True                     # r0 runs for ever; the long one waits behind it
    c = client(cluster)
    view = cluster.svc.membership.instances["p0"].view
    d0 = cluster.instances["d0"]
    pending = [asyncio.create_task(c.completions.create(model="tiny", prompt="long " * n, max_tokens=2))
               for n in (40, 60)]
    async with asyncio.timeout(5):
        # both long ones queued and holding decode room before decode turns to refusing
        while len(p0.requests) < 1 or len(view.state().queue) < 2 or len(d0.requests) < 2:
            await asyncio.sleep(0.01)
    d0.behaviour.refuse = True
    for _ in range(2):                           # short ones that would pass the waiting long one
        with pytest.raises(openai.RateLimitError):
            await c.completions.create(model="tiny", prompt="short", max_tokens=2)
    waiting = view.state().queue[1]
    assert waiting.started_at is None and waiting.passed == 0
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await c.close()


@pytest.mark.parametrize("overtakes, pack_tokens", [(0, 0), (4, 0), (4, 512)])
def test_a_head_started_on_an_empty_queue_keeps_the_price_it_started_with(overtakes, pack_tokens):
    """A job that starts at once is priced to end as its decision priced it (the node's state
    then: idle, its neighbour's CPUs borrowed), not as the model shown to the jobs behind it
    prices it (busy, its own presence): the wait of those behind is what is left of that price.
    A job queued behind it keeps the model's price; the instance's report of its chunks wins."""
    costs = CostModels(MODEL, DecodeCostModel(c0=0.01, c1=1e-3), kv_bytes_per_token=64)
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("p", overtakes, pack_tokens), now=0)
    m.register(Register(role="decode", instance_id="d", http="h-d:1", data="h-d:2", store="s:1", model="tiny",
                        block_size=16, hash_seed=0, kv_bytes_per_token=64, max_context=100000), now=0)
    assert MODEL.predict(300) > 0.3      # the model (the busy state's, say) prices the head longer
    m.add_prefill("p", PrefillJob("head", 300, 0, "d", priced_s=0.2), now=10.0)
    m.add_prefill("p", PrefillJob("next", 400, 0, "d", priced_s=9.0), now=10.0)   # queued: not started
    sched = Scheduler(SchedulerConfig(block_size=16, admission="none"), costs, BlockIndex())
    wait = sched.schedule(ScheduleRequest("x", (), 100, 8), m.snapshot(), now=10.05).predicted_queue_s
    # what is left of the head's 0.2 s; in FIFO order the 400-token job's forward too (by the model)
    assert wait == pytest.approx(0.15 + (MODEL.predict(400) if overtakes == 0 else 0.0))
    m.get("p").view.report_end("head", 10.5, now=10.05)      # its chunks say it ends at 10.5
    wait = sched.schedule(ScheduleRequest("y", (), 100, 8), m.snapshot(), now=10.05).predicted_queue_s
    assert wait == pytest.approx(0.45 + (MODEL.predict(400) if overtakes == 0 else 0.0))
    m.prefill_done("p", "head", now=10.5)                    # the next starts: the model prices it
    assert m.snapshot().prefills[0].queue[0].ends_at is None
