"""One request's path: 429s (admission, decode refusal), upstream failures, client disconnect."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.conductor.fakes import expected_tokens
from tests.conductor.test_api import TOK, client


async def _wait_for(cond, timeout: float = 5.0) -> None:
    async def loop():
        while not cond():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(loop(), timeout)


async def test_overload_answers_429_with_retry_after(make_cluster):
    cluster = await make_cluster(prefill=0, decode=1, admission="early", ttft_slo=2.5)
    p0 = await cluster.add("prefill", "p0", store="s0:1", cost={"prefill": {"c0": 1.0}})
    p0.behaviour.hang = True          # prefills pile up in p0's queue
    c = client(cluster)
    pending = [asyncio.create_task(c.completions.create(model="tiny", prompt=f"q{i}", max_tokens=2))
               for i in range(2)]
    await _wait_for(lambda: len(p0.requests) == 2)
    with pytest.raises(openai.RateLimitError) as info:
        await c.completions.create(model="tiny", prompt="one too many", max_tokens=2)
    err = info.value
    assert err.status_code == 429 and "predicted TTFT 2.9" in err.message and "> SLO 2.5s" in err.message
    assert err.code == "rate_limit_exceeded"
    assert int(err.response.headers["Retry-After"]) >= 1
    assert len(cluster.instances["d0"].requests) == 2     # the rejected one touched nothing
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    async with cluster.session.get(cluster.url + "/metrics") as r:
        assert 'mooncake_conductor_rejections_total{cause="ttft"} 1.0' in await r.text()
    await c.close()


async def test_the_decode_is_told_when_the_kv_is_due(make_cluster):
    # the decision's predicted TTFT: 1 s of prefill for the first, its queue and 1 s for the second
    cluster = await make_cluster(prefill=0, decode=1, admission="early", ttft_slo=10)
    p0 = await cluster.add("prefill", "p0", store="s0:1", cost={"prefill": {"c0": 1.0}})
    p0.behaviour.hang = True
    c = client(cluster)
    pending = [asyncio.create_task(c.completions.create(model="tiny", prompt=f"q{i}", max_tokens=2))
               for i in range(2)]
    await _wait_for(lambda: len(p0.requests) == 2)
    first, second = (r.kv_in_s for r in cluster.instances["d0"].requests)
    assert 1.0 <= first < 1.5 and second - first == pytest.approx(1.0, abs=0.1)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await c.close()


def test_what_the_decode_is_told_is_what_it_takes():
    from mooncake_lite.common.protocol import MAX_KV_IN_S
    from mooncake_lite.conductor.flight.attempt import kv_in
    from mooncake_lite.scheduler import Decision
    told = [kv_in(Decision(True, "", predicted_ttft_s=t)) for t in (None, float("nan"), -0.1, 2.5, 1e9)]
    assert told == [None, None, 0.0, 2.5, MAX_KV_IN_S]


async def test_tbt_slo_rejects_before_prefill(make_cluster):
    cluster = await make_cluster(prefill=1, decode=0, admission="predictive", tbt_slo=0.2)
    await cluster.add("decode", "d0", cost={"decode": {"c0": 0.5}})
    c = client(cluster)
    with pytest.raises(openai.RateLimitError) as info:
        await c.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert "predicted TBT 0.5s > SLO 0.2s" in info.value.message
    assert not cluster.instances["p0"].requests
    await c.close()


async def test_decode_refusal_is_a_429(make_cluster):
    cluster = await make_cluster()
    cluster.instances["d0"].behaviour.refuse = True
    c = client(cluster)
    with pytest.raises(openai.RateLimitError) as info:
        await c.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert "decode instance d0 refused the request: TBT SLO would break" in info.value.message
    assert not cluster.instances["p0"].requests          # no prefill work wasted
    await c.close()


@pytest.mark.parametrize("status, exc, needle", [
    (500, openai.APIStatusError, "prefill instance p0 answered 500: prefill exploded"),
    (None, openai.RateLimitError, "prefill instance p0 refused the request: prefill queue full"),
])
async def test_prefill_failure_aborts_decode(make_cluster, status, exc, needle):
    cluster = await make_cluster()
    if status is None:
        cluster.instances["p0"].behaviour.refuse = True
    else:
        cluster.instances["p0"].behaviour.fail_status = status
    c = client(cluster)
    with pytest.raises(exc) as info:
        await c.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True)
    assert needle in info.value.message
    d0 = cluster.instances["d0"]
    await _wait_for(lambda: d0.aborts == [d0.requests[0].request_id])
    assert not cluster.svc.membership.instances["d0"].decode_jobs
    await c.close()


async def test_client_disconnect_aborts_decode(make_cluster):
    cluster = await make_cluster()
    d0 = cluster.instances["d0"]
    d0.behaviour.token_delay_s = 0.05
    async with aiohttp.ClientSession() as s:
        async with s.post(cluster.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "abc", "max_tokens": 1000, "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()          # the first token arrived; now walk away
    await _wait_for(lambda: d0.aborts == [d0.requests[0].request_id])
    await _wait_for(lambda: not cluster.svc.membership.instances["d0"].decode_jobs)


async def test_client_disconnect_during_prefill_aborts_both(make_cluster):
    cluster = await make_cluster()
    p0, d0 = cluster.instances["p0"], cluster.instances["d0"]
    p0.behaviour.hang = True
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(cluster.url + "/v1/completions",
                                          json={"model": "tiny", "prompt": "abc", "max_tokens": 5}))
        await _wait_for(lambda: p0.requests)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    rid = p0.requests[0].request_id
    await _wait_for(lambda: p0.aborts == [rid] and d0.aborts == [rid])
    await _wait_for(lambda: not cluster.svc.membership.instances["p0"].prefill_jobs)


@pytest.mark.parametrize("admission", ["none", "early", "predictive"])
async def test_a_burst_spreads_over_decode_instances_before_any_kv_arrives(make_cluster, admission):
    # The prefill instance holds every request, so no KV ever reaches a decode: decode selection
    # must count the requests already dispatched to each decode (incoming), not only running ones.
    cluster = await make_cluster(prefill=1, decode=2, admission=admission)
    p0, d0, d1 = (cluster.instances[i] for i in ("p0", "d0", "d1"))
    p0.behaviour.hang = True
    c = client(cluster)
    pending = [asyncio.create_task(c.completions.create(model="tiny", prompt=f"burst {i}", max_tokens=4))
               for i in range(6)]
    await _wait_for(lambda: len(p0.requests) == 6)
    assert (len(d0.requests), len(d1.requests)) == (3, 3)
    decodes = cluster.svc.membership.snapshot().decodes
    assert sorted(len(d.incoming) for d in decodes) == [3, 3] and all(not d.running for d in decodes)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await c.close()
    await _wait_for(lambda: all(not d.incoming for d in cluster.svc.membership.snapshot().decodes))


async def test_many_concurrent_requests_all_correct(make_cluster):
    # decode selection counts the requests already dispatched to each decode instance, so a
    # burst spreads over both (absolute SLOs loose enough to admit all 24: relative ones would
    # refuse the ones queued more than 10 prompts deep)
    cluster = await make_cluster(prefill=2, decode=2, strategy="load-balance", admission="predictive",
                                 ttft_slo=30.0, tbt_slo=0.2)
    for inst in cluster.instances.values():
        inst.behaviour.token_delay_s = 0.002
    c = client(cluster)
    prompts = [f"prompt number {i}" for i in range(24)]
    outs = await asyncio.gather(*[c.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
                                  for p in prompts])
    for p, out in zip(prompts, outs):
        assert out.choices[0].text == TOK.decode(expected_tokens(TOK.encode(p), 6))
    used = {inst.instance_id for inst in cluster.instances.values() if inst.requests}
    assert used == {"p0", "p1", "d0", "d1"}
    m = cluster.svc.membership
    assert all(not i.prefill_jobs and not i.decode_jobs for i in m.instances.values())
    await c.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_tokens_racing_ahead_of_the_prefill_result_keep_their_order(make_cluster, stream):
    cluster = await make_cluster()
    cluster.instances["p0"].behaviour.result_delay_s = 0.2   # decode finishes before prefill answers
    c = client(cluster)
    want = TOK.decode(expected_tokens(TOK.encode("race"), 6))
    if stream:
        chunks = await c.completions.create(model="tiny", prompt="race", max_tokens=6, stream=True)
        text = "".join([ch.choices[0].text async for ch in chunks if ch.choices])
    else:
        text = (await c.completions.create(model="tiny", prompt="race", max_tokens=6)).choices[0].text
    assert text == want
    assert cluster.instances["d0"].aborts == []    # decode had ended on its own
    await c.close()
