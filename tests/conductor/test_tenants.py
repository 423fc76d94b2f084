"""Tenants at the conductor: API keys name tenants (401 otherwise), each tenant's rate and
concurrency limits answer 429 + Retry-After naming the limit, a low-priority tenant over its
fair share is shed first, and /metrics counts per tenant. In process, with fake instances."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest

from mooncake_lite.conductor.tenants import TenantGate
from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.scheduler.tenants import parse_tenants

TENANTS = {
    "anonymous": "free",
    "gold": {"api_keys": ["k-gold"], "priority": "high"},
    # an SLO no prediction meets: every decision is far above low's shed_at
    "bulk": {"api_keys": ["k-bulk"], "priority": "low", "ttft_slo": "1us"},
    "free": {"api_keys": ["k-free"], "rate": 1, "burst": 1},
    "solo": {"api_keys": ["k-solo"], "max_concurrency": 1},
}


def client(cluster, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0, timeout=10)


async def post(cluster, key: str | None, **body):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with cluster.session.post(cluster.url + "/v1/completions", headers=headers,
                                    json={"model": "tiny", "prompt": "hello", "max_tokens": 3, **body}) as r:
        return r.status, dict(r.headers), await r.json()


async def metrics(cluster) -> str:
    async with cluster.session.get(cluster.url + "/metrics") as r:
        return await r.text()


async def wait_in_flight(cluster, tenant: str) -> None:
    for _ in range(200):
        if cluster.svc.tenants.ledger.in_flight.get(tenant):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no request of {tenant} went in flight")


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_keys_name_tenants_and_unknown_keys_are_refused(make_cluster):
    cluster = await make_cluster(tenants=parse_tenants(TENANTS), api_key="k-ops")
    assert (await post(cluster, "k-gold"))[0] == 200
    assert (await post(cluster, "k-ops"))[0] == 200                 # --api-key: tenant "default"
    status, headers, body = await post(cluster, "k-nope")
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
    assert (await post(cluster, None))[0] == 200                    # no key: the anonymous tenant
    text = await metrics(cluster)
    for tenant in ("gold", "default", "free"):
        assert sample(text, "mooncake_conductor_tenant_requests_total", tenant=tenant, outcome="ok") == 1
        assert sample(text, "mooncake_conductor_tenant_ttft_seconds_count", tenant=tenant) == 1


async def test_no_anonymous_tenant_means_a_key_is_required(make_cluster):
    cluster = await make_cluster(tenants=parse_tenants({"a": {"api_keys": ["k-a"]}}))
    status, _, body = await post(cluster, None)
    assert status == 401 and "didn't provide an API key" in body["error"]["message"]
    assert (await post(cluster, "k-a"))[0] == 200


async def test_rate_limit_answers_429_with_retry_after_naming_it(make_cluster):
    cluster = await make_cluster(tenants=parse_tenants(TENANTS))
    assert (await post(cluster, None))[0] == 200
    status, headers, body = await post(cluster, None)
    assert status == 429 and headers["Retry-After"] == "1"
    err = body["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert "'free'" in err["message"] and "1 requests/s" in err["message"]
    # the official client raises its RateLimitError on it
    with pytest.raises(openai.RateLimitError):
        await client(cluster, "k-free").completions.create(model="tiny", prompt="x", max_tokens=2)
    text = await metrics(cluster)
    assert sample(text, "mooncake_conductor_tenant_rejections_total", tenant="free", reason="rate") == 2
    assert sample(text, "mooncake_conductor_tenant_requests_total", tenant="free", outcome="rejected") == 2


async def test_concurrency_limit_counts_requests_in_flight(make_cluster):
    cluster = await make_cluster(tenants=parse_tenants(TENANTS))
    cluster.instances["d0"].behaviour.token_delay_s = 0.2     # the first request stays in flight
    first = asyncio.create_task(post(cluster, "k-solo", max_tokens=5))
    gate = cluster.svc.tenants
    await wait_in_flight(cluster, "solo")
    status, headers, body = await post(cluster, "k-solo")
    assert status == 429 and body["error"]["code"] == "concurrency_limit_exceeded"
    assert "max_concurrency 1" in body["error"]["message"] and headers["Retry-After"] == "1"
    assert (await first)[0] == 200
    assert gate.ledger.in_flight == {}                           # every admitted request ended
    assert (await post(cluster, "k-solo"))[0] == 200


async def test_low_priority_over_its_share_is_shed_and_high_is_not(make_cluster):
    cluster = await make_cluster(tenants=parse_tenants(TENANTS))
    assert (await post(cluster, "k-bulk"))[0] == 200             # alone: nobody to protect
    assert (await post(cluster, "k-gold"))[0] == 200
    assert (await post(cluster, "k-bulk"))[0] == 200             # one in flight: never starved
    cluster.instances["d0"].behaviour.token_delay_s = 0.2        # now one stays in flight...
    held = asyncio.create_task(post(cluster, "k-bulk", max_tokens=4))
    await wait_in_flight(cluster, "bulk")
    status, headers, body = await post(cluster, "k-bulk")        # ...so a second is over its share
    assert status == 429 and body["error"]["code"] == "priority_shed"
    assert "low priority" in body["error"]["message"] and "Retry-After" in headers
    assert (await post(cluster, "k-gold"))[0] == 200             # high: only its own SLO refuses it
    assert (await held)[0] == 200
    text = await metrics(cluster)
    assert sample(text, "mooncake_conductor_tenant_rejections_total", tenant="bulk", reason="priority") == 1
    assert sample(text, "mooncake_conductor_rejections_total", cause="priority") == 1


def test_gate_gives_each_tenant_its_own_slos():
    base = SchedulerConfig(ttft_slo_s=None, tbt_slo_s=None)
    gate = TenantGate(parse_tenants(TENANTS), base)
    assert gate.configs["bulk"].ttft_slo_s == 1e-6 and gate.configs["gold"] is base
    assert gate.by_key("k-gold").name == "gold" and gate.by_key(None).name == "free"
    assert gate.by_key("k-gol") is None
    open_gate = TenantGate(parse_tenants({}), base)             # no tenants: everyone is "default"
    assert open_gate.is_open and open_gate.by_key(None).name == "default"
