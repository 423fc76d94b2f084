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
    status, headers, body = await post(cluster, "k-bulk")        # gold is active: bulk over its share
    assert status == 429 and body["error"]["code"] == "priority_shed"
    assert "low priority" in body["error"]["message"] and "Retry-After" in headers
    assert (await post(cluster, "k-gold"))[0] == 200             # high: only its own SLO refuses it
    cluster.svc.tenants.ledger.starve_after_s = 0.05             # shed, never starved: after this
    await asyncio.sleep(0.1)                                     # long without a pass, one goes through
    assert (await post(cluster, "k-bulk"))[0] == 200
    assert (await post(cluster, "k-bulk"))[0] == 429
    text = await metrics(cluster)
    assert sample(text, "mooncake_conductor_tenant_rejections_total", tenant="bulk", reason="priority") == 2
    assert sample(text, "mooncake_conductor_rejections_total", cause="priority") == 2


def test_gate_gives_each_tenant_its_own_slos():
    base = SchedulerConfig(ttft_slo_s=None, tbt_slo_s=None)
    gate = TenantGate(parse_tenants(TENANTS), base)
    assert gate.configs["bulk"].ttft_slo_s == 1e-6 and gate.configs["gold"] is base
    assert gate.by_key("k-gold").name == "gold" and gate.by_key(None).name == "free"
    assert gate.by_key("k-gol") is None
    open_gate = TenantGate(parse_tenants({}), base)             # no tenants: everyone is "default"
    assert open_gate.is_open and open_gate.by_key(None).name == "default"


# ---- live: real processes on 127.0.0.1 (tiny model) -----------------------------------------

LIVE_TENANTS = """
[tenants.gold]
api_keys = ["k-gold"]
priority = "high"

[tenants.flood]
api_keys = ["k-flood"]
priority = "low"
"""


def _gold_ttfts(url: str, n: int, min_s: float = 0.0) -> list[float]:
    """TTFT of sequential streamed gold requests (arrival to the first text chunk): ``n`` of them,
    and more until ``min_s`` seconds have passed."""
    import time
    c = openai.OpenAI(base_url=url + "/v1", api_key="k-gold", max_retries=0, timeout=30)
    out = []
    start, i = time.monotonic(), -1
    while (i := i + 1) < n or time.monotonic() - start < min_s:
        t0 = time.perf_counter()
        stream = c.completions.create(model="tiny", prompt=f"gold {i}: " + "the tide comes in. " * 10,
                                      max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True})
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
        out.append(first)
    return out


def _flood(url: str, on, stop, counts: dict) -> None:
    """A low-priority client that, while ``on``, always has a request outstanding: the next one
    as soon as the last is answered, or as its 429's Retry-After says (as the official client's
    retries do)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="k-flood", max_retries=0, timeout=30)
    i = 0
    while not stop.is_set():
        if not on.wait(0.05):
            continue
        i += 1
        try:
            c.completions.create(model="tiny", prompt=f"flood {i}: " + "more work, now. " * 12, max_tokens=16,
                                 temperature=0, extra_body={"ignore_eos": True})
            counts["ok"] = counts.get("ok", 0) + 1
        except openai.RateLimitError as exc:
            code = exc.body.get("code") if isinstance(exc.body, dict) else None
            counts[code] = counts.get(code, 0) + 1
            stop.wait(float(exc.response.headers.get("Retry-After", "1")))


@pytest.mark.slow
def test_live_low_priority_flood_is_shed_and_gold_is_served(role_procs, tmp_path):
    """A 4-role tiny cluster: gold's requests are all served while a low-priority flood runs
    (three alternating phases of 4 gold requests alone and at least 2 s of them with the flood),
    the flood is shed (429 priority_shed) but not starved, and /metrics counts both tenants.
    Gold's p90 TTFT with and without the flood is printed (timings are not asserted)."""
    import threading
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from mooncake_lite.sim.metrics import quantile
    from tests.conductor.test_e2e import COMMON, STORE_ARGS, _wait_ready

    spec = tmp_path / "tenants.toml"
    spec.write_text(LIVE_TENANTS)
    conductor = role_procs("conductor", "--port", "0", "--model", "tiny", "--admission", "early",
                           "--tenants", str(spec), *COMMON)
    url = conductor.url()
    store = role_procs("store", "--port", "0", "--data-port", "0", "--dram", "64MiB", "--conductor", url,
                       "--event-interval", "0.05", *COMMON)
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(role_procs, "prefill", "--conductor", url, *STORE_ARGS(store.addresses["data"]),
                               "--model", "tiny", "--threads", "1", "--heartbeat-interval", "0.5", "--no-profile",
                               *COMMON),
                   pool.submit(role_procs, "decode", "--conductor", url, "--data-port", "0", "--model", "tiny",
                               "--threads", "1", "--heartbeat-interval", "0.5", "--no-profile", *COMMON)]
        for f in started:
            f.result()
    _wait_ready(url)
    _gold_ttfts(url, 1)                                          # warm-up
    on, stop, counts = threading.Event(), threading.Event(), {}
    flooders = [threading.Thread(target=_flood, args=(url, on, stop, counts)) for _ in range(4)]
    for t in flooders:
        t.start()
    alone, flooded = [], []
    try:   # alternating phases, so the machine's own load drifting hits both alike
        for _ in range(3):
            alone += _gold_ttfts(url, 4)
            on.set()
            # at least 2 s: a shed flood client waits its 1 s Retry-After before it tries again,
            # and on a quick machine 4 gold requests are over before then
            flooded += _gold_ttfts(url, 4, min_s=2.0)
            on.clear()
    finally:
        stop.set()
        for t in flooders:
            t.join(timeout=30)
    assert all(t is not None for t in alone + flooded)            # every gold request was served
    assert counts.get("priority_shed", 0) > 0 and counts.get("ok", 0) > 0, counts
    assert set(counts) <= {"ok", "priority_shed"}, counts
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert sample(text, "mooncake_conductor_tenant_ttft_seconds_count", tenant="gold") == 1 + len(alone + flooded)
    assert sample(text, "mooncake_conductor_tenant_rejections_total", tenant="flood", reason="priority") == \
        counts["priority_shed"]
    assert sample(text, "mooncake_conductor_tenant_rejections_total", tenant="gold", reason="priority") == 0
    p90a, p90b = quantile(sorted(alone), 0.9), quantile(sorted(flooded), 0.9)
    print(f"\ngold p90 TTFT alone {p90a * 1e3:.1f} ms, with a low-priority flood {p90b * 1e3:.1f} ms "
          f"(x{p90b / p90a:.2f}); flood: {counts}")
