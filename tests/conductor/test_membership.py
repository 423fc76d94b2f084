"""Registration (refusals), heartbeats, dead instances, block events feeding the index."""

from __future__ import annotations

import asyncio
import logging
import time

import openai
import pytest

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.protocol import Heartbeat
from tests.conductor import fakes
from tests.conductor.test_api import TOK, client


@pytest.mark.parametrize("changes, needle", [
    ({"model": "small"}, "model 'small' (conductor serves 'tiny')"),
    ({"block_size": 16}, "block_size 16 (cluster uses 4)"),
    ({"hash_seed": 7}, "hash_seed 7 (cluster uses 0)"),
    ({"kv_bytes_per_token": 3}, "kv_bytes_per_token 3"),
])
async def test_mismatched_registration_is_refused_with_409(make_cluster, changes, needle):
    cluster = await make_cluster()
    inst = await cluster.add("prefill", "p-bad", register=False)
    status, body = await fakes.register(cluster.session, cluster.url, inst, **changes)
    assert status == 409, body
    assert needle in body["error"]["message"] and body["error"]["code"] == "cluster_mismatch"
    assert "p-bad" not in cluster.svc.membership.instances


async def test_malformed_registration_and_unknown_heartbeat(make_cluster):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/internal/v1/register", data=b'{"role": "prefill"}') as r:
        assert r.status == 400 and "missing field" in (await r.json())["error"]["message"]
    inst = await cluster.add("decode", "d-x", register=False)
    status, body = await fakes.register(cluster.session, cluster.url, inst, data=None)
    assert status == 400 and "data address" in body["error"]["message"]
    status, body = await fakes.register(cluster.session, cluster.url, inst, cost={"prefill": {"c9": 1}})
    assert status == 400 and "unknown coefficient" in body["error"]["message"]
    status, body = await fakes.post(cluster.session, cluster.url + "/internal/v1/heartbeat", Heartbeat("nobody"))
    assert status == 404 and "register again" in body["error"]["message"]


async def test_cluster_token_guards_internal_endpoints(make_cluster):
    cluster = await make_cluster(prefill=0, decode=0, cluster_token="t0k")
    inst = await cluster.add("prefill", "p0", register=False, store="s:1")
    status, _ = await fakes.register(cluster.session, cluster.url, inst)
    assert status == 403
    inst.token = "t0k"
    status, _ = await fakes.register(cluster.session, cluster.url, inst)
    assert status == 200


async def test_block_events_feed_the_index_and_route_to_the_holder(make_cluster):
    cluster = await make_cluster(prefill=2, decode=1, strategy="cache-aware")
    prompt = TOK.encode("0123456789abcdefghij")          # 21 tokens = 5 full blocks of 4
    keys = prefix_hash(prompt, 4, 0)
    status, body = await fakes.block_events(cluster.session, cluster.url, "store1:1", stored=keys[:4])
    assert status == 200 and body["num_blocks"] == 4
    c = client(cluster)
    raw = await c.completions.with_raw_response.create(model="tiny", prompt="0123456789abcdefghij", max_tokens=2)
    assert raw.headers["X-Mooncake-Prefill"] == "p1" and raw.headers["X-Mooncake-Route"] == "local-hit"
    sent = cluster.instances["p1"].requests[-1]
    assert sent.prefix_keys == tuple(k.hex() for k in keys[:4])
    assert sent.decode_data == cluster.instances["d0"].register_msg().data
    # evicted: the hit is gone, the index says so
    await fakes.block_events(cluster.session, cluster.url, "store1:1", evicted=keys[:4])
    raw = await c.completions.with_raw_response.create(model="tiny", prompt="0123456789abcdefghij", max_tokens=2)
    assert raw.headers["X-Mooncake-Reused-Blocks"] == "0"
    # bad keys are refused as a whole
    async with cluster.session.post(cluster.url + "/internal/v1/block_events",
                                    json={"store": "s", "stored": [keys[0].hex(), "zz"]}) as r:
        assert r.status == 400
    assert cluster.svc.scheduler.index.num_blocks() == 0
    await c.close()


async def test_a_store_it_never_synced_with_is_asked_for_its_inventory(make_cluster):
    """After a conductor restart the stores' plain events only carry changes: the conductor
    applies them but asks for a full sync, which replaces all it believed about that store."""
    cluster = await make_cluster(prefill=1, decode=1)
    index = cluster.svc.scheduler.index
    keys = prefix_hash(list(range(40)), 4, 0)
    status, body = await fakes.block_events(cluster.session, cluster.url, "s:1", stored=keys[:3])
    assert status == 200 and body["resync"] is True and index.num_blocks("s:1") == 3
    status, body = await fakes.block_events(cluster.session, cluster.url, "s:1", stored=keys[5:7], full=True)
    assert body["resync"] is False and body["num_blocks"] == 2           # keys[:3] forgotten
    assert index.prefix_len(keys[5:7], "s:1") == 2 and index.prefix_len(keys[:3], "s:1") == 0
    status, body = await fakes.block_events(cluster.session, cluster.url, "s:1", stored=keys[7:9])
    assert body == {"ok": True, "num_blocks": 4, "resync": False,   # later parts and events add up
                    "dead_after_s": cluster.svc.membership.dead_after_s}
    status, body = await fakes.block_events(cluster.session, cluster.url, "other:1", full=True)
    assert body["resync"] is False and body["num_blocks"] == 0          # an empty store is synced too


async def test_hot_spot_migration_is_sent_to_prefill(make_cluster):
    # p0's queue makes p1 cheaper; p1 must pull the prefix from store0 (kvcache-centric)
    cluster = await make_cluster(prefill=2, decode=1, strategy="kvcache-centric")
    prompt = TOK.encode("0123456789abcdefghij")
    keys = prefix_hash(prompt, 4, 0)
    await fakes.block_events(cluster.session, cluster.url, "store0:1", stored=keys[:5])
    cluster.instances["p0"].behaviour.hang = True
    c = client(cluster)
    first = asyncio.create_task(c.completions.create(model="tiny", prompt=[1] * 2000, max_tokens=2))
    while not cluster.instances["p0"].requests:
        await asyncio.sleep(0.01)
    raw = await c.completions.with_raw_response.create(model="tiny", prompt="0123456789abcdefghij", max_tokens=2)
    assert raw.headers["X-Mooncake-Prefill"] == "p1" and raw.headers["X-Mooncake-Route"] == "transfer"
    sent = cluster.instances["p1"].requests[-1]
    assert sent.migrate_from == "store0:1"
    assert sent.migrate_keys == tuple(k.hex() for k in keys[:5])
    assert sent.prefix_keys == tuple(k.hex() for k in keys[:5])
    first.cancel()
    await c.close()


async def test_silent_instance_is_marked_dead_and_gets_no_work(make_cluster):
    cluster = await make_cluster(prefill=1, decode=2, dead_after=1.0)
    d0 = cluster.instances["d0"]
    d0.is_heartbeating = False
    while cluster.svc.membership.instances["d0"].is_alive:
        await asyncio.sleep(0.05)
    c = client(cluster)
    for _ in range(4):
        raw = await c.completions.with_raw_response.create(model="tiny", prompt="abc", max_tokens=2)
        assert raw.headers["X-Mooncake-Decode"] == "d1"
    assert not d0.requests
    # it comes back when it heartbeats again
    d0.is_heartbeating = True
    while not cluster.svc.membership.instances["d0"].is_alive:
        await asyncio.sleep(0.05)
    await c.close()


async def test_a_held_up_conductor_does_not_take_every_instance_out_at_once(make_cluster, caplog):
    """The conductor's own loop stalls (an overloaded box) past the silence bound: the heartbeats
    sent meanwhile are unread, not missing, so no instance is declared dead; one truly silent
    still is, a period later."""
    cluster = await make_cluster(prefill=1, decode=2, dead_after=1.0)
    await asyncio.sleep(0.5)
    with caplog.at_level(logging.WARNING):
        time.sleep(2.5)   # blocks this loop: conductor, fake instances and their heartbeats alike
        await asyncio.sleep(1.0)
    m = cluster.svc.membership
    assert all(i.is_alive for i in m.instances.values()), [i.instance_id for i in m.instances.values()]
    assert "the reaper ran" in caplog.text
    cluster.instances["d0"].is_heartbeating = False
    for _ in range(100):
        if not m.instances["d0"].is_alive:
            break
        await asyncio.sleep(0.05)
    assert not m.instances["d0"].is_alive and m.instances["d1"].is_alive


async def test_request_in_flight_on_a_dying_instance_fails_cleanly(make_cluster, caplog):
    caplog.set_level(logging.INFO)
    cluster = await make_cluster(prefill=1, decode=1, dead_after=1.0)
    p0, d0 = cluster.instances["p0"], cluster.instances["d0"]
    d0.behaviour.hang = True     # decode never sends a token...
    c = client(cluster)
    task = asyncio.create_task(c.completions.create(model="tiny", prompt="abc", max_tokens=5))
    while not d0.requests:
        await asyncio.sleep(0.01)
    d0.is_heartbeating = False   # ...and goes silent
    with pytest.raises(openai.APIStatusError) as info:
        await task
    assert info.value.status_code == 502 and "stopped heartbeating" in info.value.message
    # bookkeeping is clean; with no decode left the next request is a clear 503
    assert not cluster.svc.membership.instances["p0"].prefill_jobs
    with pytest.raises(openai.APIStatusError) as info:
        await c.completions.create(model="tiny", prompt="abc", max_tokens=5)
    assert info.value.status_code == 503 and "no live decode instance" in info.value.message
    # the conductor's log says what the client was told, not "no decode instance with room"
    said = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert said and all("no live decode instance" in m for m in said), said
    assert p0.aborts == []   # prefill had already answered: nothing to abort there
    await c.close()


async def test_reported_costs_are_used_and_capacity_limits_requests(make_cluster):
    # the roles send their own model flat (PrefillCostModel/DecodeCostModel.to_dict())
    cluster = await make_cluster(prefill=0, decode=0, admission="early", tbt_slo=0.2)
    await cluster.add("prefill", "p0", store="s0:1", cost={"c0": 0.01, "c1": 0.0, "c2": 0.0, "c3": 0.0})
    d0 = await cluster.add("decode", "d0", register=False, cost={"c0": 0.05, "c1": 0.0, "c2": 0.0})
    status, body = await fakes.register(cluster.session, cluster.url, d0, max_context=64)
    assert status == 200, body
    m = cluster.svc.membership
    assert m.instances["p0"].costs.prefill.c0 == 0.01 and m.instances["d0"].costs.decode.c0 == 0.05
    c = client(cluster)
    out = await c.completions.create(model="tiny", prompt="a" * 40, max_tokens=8)
    assert out.usage.completion_tokens == 8
    # 61 prompt tokens + 8 can never fit a 64-token decode instance: a 400, not a 429
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model="tiny", prompt="a" * 60, max_tokens=8)
    assert "largest decode instance holds 64" in info.value.message
    await c.close()


# A slow CPU's profiles (the measured case): one decode step alone 0.61 s, prefill 10 ms a token.
SLOW_PREFILL = {"c0": 0.01, "c1": 0.01, "c2": 0.0, "c3": 0.0}
SLOW_DECODE = {"c0": 0.6, "c1": 0.01, "c2": 0.0}


async def _slow_cluster(make_cluster, **overrides):
    cluster = await make_cluster(prefill=0, decode=0, admission="predictive", **overrides)
    await cluster.add("prefill", "p0", store="s0:1", cost=SLOW_PREFILL)
    await cluster.add("decode", "d0", cost=SLOW_DECODE)
    return cluster


async def test_an_idle_slow_cluster_admits_its_first_request_by_default(make_cluster, caplog):
    cluster = await _slow_cluster(make_cluster)       # relative SLOs: the default
    c = client(cluster)
    out = await c.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert out.usage.completion_tokens == 4
    await c.close()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_an_absolute_slo_no_instance_can_meet_is_said_once_per_instance(make_cluster, caplog):
    cluster = await _slow_cluster(make_cluster, tbt_slo=0.2)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ["d0: one decode step alone (batch 1) takes 0.61 s by its profile, above --tbt-slo 0.2 s: "
                      "every request will be rejected by predictive admission; raise --tbt-slo or use the "
                      "relative default (--tbt-slo-factor)"]
    status, body = await fakes.register(cluster.session, cluster.url, cluster.instances["d0"])   # again
    assert status == 200, body
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    c = client(cluster)
    with pytest.raises(openai.RateLimitError) as info:       # and indeed: the idle cluster refuses
        await c.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert "predicted TBT 0.61s > SLO 0.2s" in info.value.message
    await c.close()


async def test_prefill_instances_too_small_for_a_prompt_are_skipped(make_cluster):
    cluster = await make_cluster(prefill=0, decode=1)
    small = await cluster.add("prefill", "p-small", register=False, store="s0:1")
    status, _ = await fakes.register(cluster.session, cluster.url, small, max_context=32)
    assert status == 200
    await cluster.add("prefill", "p-big", store="s1:1")
    c = client(cluster)
    for _ in range(3):
        raw = await c.completions.with_raw_response.create(model="tiny", prompt="a" * 40, max_tokens=2)
        assert raw.headers["X-Mooncake-Prefill"] == "p-big"
    cluster.instances["p-big"].is_heartbeating = False
    await asyncio.sleep(0.2)   # > one beat period: a heartbeat already on its way lands first
    cluster.svc.membership.instances["p-big"].last_seen -= 10
    cluster.svc.membership.reap(cluster.svc.membership.instances["p-small"].last_seen + 1)
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model="tiny", prompt="a" * 40, max_tokens=2)
    assert "largest prefill instance holds 32" in info.value.message
    await c.close()


async def test_each_request_tells_a_prefill_that_reads_it_where_the_conductor_placed_it(make_cluster):
    """``PrefillRequest.placed``: the conductor's number for the request, with its own name, so
    the instance counts no overtake for a job placed earlier that reaches it later
    (scheduler/waiting.placed_after); sent only to a prefill that registered it reads it."""
    cluster = await make_cluster(prefill=0, decode=1)
    p0 = await cluster.add("prefill", "p0", store="s0:1", register=False)
    status, _ = await fakes.register(cluster.session, cluster.url, p0, reads_placed=True)
    assert status == 200
    c = client(cluster)
    for i in range(3):
        raw = await c.completions.with_raw_response.create(model="tiny", prompt=f"q{i}", max_tokens=2)
        assert int(raw.headers["X-Mooncake-Placed"]) == p0.requests[-1].placed
    numbers, names = [r.placed for r in p0.requests], {r.placer for r in p0.requests}
    assert numbers == sorted(numbers) and len(set(numbers)) == 3 and len(names) == 1 and "" not in names
    await fakes.register(cluster.session, cluster.url, p0)          # an older prefill: nothing sent
    await c.completions.create(model="tiny", prompt="q9", max_tokens=2)
    assert (p0.requests[-1].placed, p0.requests[-1].placer) == (0, "")
    await c.close()
