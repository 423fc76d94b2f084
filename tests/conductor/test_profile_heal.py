"""A bad start-up profile heals (issue #15 item 4): heartbeats carry an instance's refined cost
model, the conductor applies it, and admission and Algorithm 1 use it at once — no estimate
the scheduler keeps between decisions goes stale."""

from __future__ import annotations

import openai
import pytest

from mooncake_lite.common.protocol import Heartbeat
from mooncake_lite.conductor.cluster.membership import DecodeJob, PrefillJob
from mooncake_lite.scheduler import FromScratch, ScheduleRequest
from mooncake_lite.scheduler.scheduler import schedule
from tests.conductor import fakes
from tests.conductor.fakes import expected_tokens
from tests.conductor.test_api import TOK, client


async def beat(cluster, instance_id: str, cost: dict | None):
    return await fakes.post(cluster.session, cluster.url + "/internal/v1/heartbeat",
                            Heartbeat(instance_id, {}, cost))


async def complete(c, prompt: str):
    return await c.completions.create(model="tiny", prompt=prompt, max_tokens=3)


@pytest.mark.parametrize("role, flags, bad, good, needle", [
    # the case: a decode step measured at 0.197 s on a busy CPU, a TBT SLO of 100 ms
    ("decode", {"admission": "predictive", "tbt_slo": 0.1}, {"c0": 0.197}, {"c0": 0.004, "c1": 1e-4},
     "predicted TBT 0.197s > SLO 0.1s"),
    ("prefill", {"admission": "early", "ttft_slo": 0.5}, {"c0": 2.0}, {"c0": 0.01, "c1": 1e-4},
     "predicted TTFT 2s > SLO 0.5s"),
])
async def test_a_pessimistic_start_up_profile_heals_through_heartbeats(make_cluster, role, flags, bad, good,
                                                                       needle):
    cluster = await make_cluster(prefill=int(role == "decode"), decode=int(role == "prefill"), **flags)
    await cluster.add(role, "x0", store="s0:1", cost={role: bad})
    c = client(cluster)
    for _ in range(2):      # the idle cluster refuses every request, and keeps doing so ...
        with pytest.raises(openai.RateLimitError) as info:
            await complete(c, "hello")
        assert needle in info.value.message
    # ... through heartbeats without a cost (the fixture's own beats, an old instance's) ...
    assert await beat(cluster, "x0", None) == (200, {"ok": True})
    with pytest.raises(openai.RateLimitError):
        await complete(c, "hello")
    # ... and through a malformed one, refused whole
    status, body = await beat(cluster, "x0", {role: {"c0": "fast"}})
    assert status == 400 and "must be a finite number" in body["error"]["message"]
    with pytest.raises(openai.RateLimitError):
        await complete(c, "hello")
    # the refined model (the flat form instances send) arrives with a heartbeat: admitted at once
    assert await beat(cluster, "x0", good) == (200, {"ok": True})
    for prompt in ("hello", "again"):
        out = await complete(c, prompt)
        assert out.choices[0].text == TOK.decode(expected_tokens(TOK.encode(prompt), 3))
    inst = cluster.svc.membership.instances["x0"]
    assert getattr(inst.costs, role).to_dict()["c0"] == good["c0"]
    await c.close()


async def test_changed_costs_reach_every_estimate_the_scheduler_keeps(make_cluster):
    """With work queued and running, a heartbeat's new model changes the next decision's
    predictions exactly as deriving everything from scratch does (the estimate cache keys on the
    model object; the decode view shows its batch afresh and re-reads its TBT)."""
    cluster = await make_cluster(prefill=0, decode=0, admission="predictive")
    await cluster.add("prefill", "p0", store="s0:1", cost={"prefill": {"c0": 0.1, "c1": 1e-4}})
    await cluster.add("prefill", "p1", store="s1:1", cost={"prefill": {"c0": 0.05, "c1": 1e-3}})
    await cluster.add("decode", "d1", cost={"decode": {"c0": 0.02, "c1": 1e-3, "c2": 1e-6}})
    m, sched = cluster.svc.membership, cluster.svc.scheduler
    for i, pid in enumerate(("p0", "p1", "p1")):
        m.add_prefill(pid, PrefillJob(f"q{i}", 400, 0, "d1", max_output_tokens=50), now=0.0)
    for i in range(6):
        m.add_decode("d1", DecodeJob(f"r{i}", 300, joined_at=0.0, max_output_tokens=100))
    req = ScheduleRequest("new", (), 200, 20)

    def both():
        snap = m.snapshot()
        cached = sched.schedule(req, snap, 0.1)
        fresh = schedule(req, snap, index=sched.index, config=sched.config, costs=sched.costs, now=0.1,
                         rng=sched.rng, cache=FromScratch())
        return cached, fresh

    before, fresh = both()
    assert before == fresh
    assert await beat(cluster, "p1", {"c0": 0.01, "c1": 1e-4}) == (200, {"ok": True})
    assert await beat(cluster, "d1", {"c0": 0.5, "c1": 1e-3, "c2": 1e-6}) == (200, {"ok": True})
    after, fresh = both()
    assert after == fresh
    # the new models moved the predictions: p1's queue got 10x faster, d1's step 25x slower
    assert (after.prefill_id, before.prefill_id) == ("p1", "p0")
    assert after.predicted_ttft_s < before.predicted_ttft_s
    snap = m.snapshot()
    d1 = next(d for d in snap.decodes if d.instance_id == "d1")
    assert d1.cost.c0 == 0.5 and d1.tbt_s == pytest.approx(d1.cost.predict(6, 1800))
    # a heartbeat repeating the same model changes nothing the scheduler sees
    assert await beat(cluster, "d1", {"c0": 0.5, "c1": 1e-3, "c2": 1e-6}) == (200, {"ok": True})
    assert m.snapshot() is snap
