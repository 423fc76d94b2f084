"""Failures seen at once, work retried (issue #15): a refused or broken connection makes an
instance suspect without waiting for heartbeats, a request that fails before its first token is
sent again elsewhere, and a silent store's blocks leave the index."""

from __future__ import annotations

import asyncio

import openai
import pytest

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.protocol import Register
from mooncake_lite.conductor.cluster.membership import Membership
from tests.conductor import fakes
from tests.conductor.fakes import expected_tokens
from tests.conductor.test_api import TOK, client
from tests.conductor.test_dispatch import _wait_for

pytestmark = pytest.mark.timeout(60)
SLOW_PREFILL = {"prefill": {"c0": 0.05}}   # the scheduler prefers the other prefill instance
SLOW_DECODE = {"decode": {"c0": 0.05}}     # ... decode instance


async def _kill(inst) -> None:
    """As kill -9 looks from the conductor: connections refused, no more heartbeats."""
    inst.is_heartbeating = False
    await inst.server.close()


async def _complete(cluster, prompt: str, max_tokens: int = 4, **extra) -> tuple[int, dict, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    async with cluster.session.post(cluster.url + "/v1/completions", json=body) as r:
        return r.status, dict(r.headers), await r.json()


async def _metrics(cluster) -> str:
    async with cluster.session.get(cluster.url + "/metrics") as r:
        return await r.text()


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_refused_instance_is_suspect_at_once_and_the_request_retried(make_cluster, role):
    # dead_after 60 s: nothing here can come from missed heartbeats
    cluster = await make_cluster(prefill=1, decode=1, dead_after=60.0)
    if role == "prefill":
        await cluster.add("prefill", "p1", store="store1:1", cost=SLOW_PREFILL)
    else:
        await cluster.add("decode", "d1", cost=SLOW_DECODE)
    failed, healthy = ("p0", "p1") if role == "prefill" else ("d0", "d1")
    await _kill(cluster.instances[failed])
    header = "X-Mooncake-Prefill" if role == "prefill" else "X-Mooncake-Decode"
    for prompt in ("first", "second"):
        status, headers, body = await _complete(cluster, prompt)
        assert status == 200, body
        assert body["choices"][0]["text"] == TOK.decode(expected_tokens(TOK.encode(prompt), 4))
        assert headers[header] == healthy
    m = cluster.svc.membership
    assert m.instances[failed].is_alive and m.instances[failed].is_suspect
    snap = m.snapshot()
    assert [i.instance_id for i in (snap.prefills if role == "prefill" else snap.decodes)] == [healthy]
    text = await _metrics(cluster)
    # one retry: the second request went straight to the healthy instance
    assert f'mooncake_conductor_retries_total{{reason="{role}-unreachable"}} 1.0' in text
    assert f'mooncake_conductor_instance_events_total{{event="suspect",role="{role}"}} 1.0' in text
    assert f'mooncake_conductor_instances{{role="{role}",state="suspect"}} 1.0' in text


async def test_a_prefill_error_is_retried_elsewhere_and_the_first_reservation_aborted(make_cluster):
    cluster = await make_cluster(prefill=1, decode=1)
    await cluster.add("prefill", "p1", store="store1:1", cost=SLOW_PREFILL)
    p0, p1, d0 = (cluster.instances[i] for i in ("p0", "p1", "d0"))
    p0.behaviour.fail_status = 500
    c = client(cluster)
    out = await c.completions.create(model="tiny", prompt="retry me", max_tokens=5, temperature=0)
    assert out.choices[0].text == TOK.decode(expected_tokens(TOK.encode("retry me"), 5))
    first, second = d0.requests               # two reservations, each its own ids
    assert first.request_id != second.request_id and first.transfer_id != second.transfer_id
    assert [r.request_id for r in p1.requests] == [second.request_id]
    await _wait_for(lambda: d0.aborts == [first.request_id])
    assert not cluster.svc.membership.instances["p0"].is_suspect      # it answered
    assert 'retries_total{reason="prefill-error"} 1.0' in await _metrics(cluster)
    m = cluster.svc.membership
    assert all(not i.prefill_jobs and not i.decode_jobs and not i.incoming_jobs for i in m.instances.values())
    await c.close()


async def test_retries_are_bounded(make_cluster):
    cluster = await make_cluster(prefill=3, decode=1, dispatch_retries=1)
    for i in range(3):
        cluster.instances[f"p{i}"].behaviour.fail_status = 503
    status, _, body = await _complete(cluster, "never")
    assert status == 502 and "answered 503" in body["error"]["message"]
    assert sum(len(cluster.instances[f"p{i}"].requests) for i in range(3)) == 2


async def test_a_lone_refused_prefill_is_probed_then_dead_after_consecutive_failures(make_cluster):
    cluster = await make_cluster(prefill=1, decode=1, dead_after=60.0, dead_after_failures=2)
    await _kill(cluster.instances["p0"])
    m = cluster.svc.membership
    status, _, body = await _complete(cluster, "a")
    assert status == 502 and body["error"]["message"].startswith("prefill instance p0 failed (connection refused)")
    assert m.instances["p0"].is_suspect and m.instances["p0"].is_alive
    status, _, body = await _complete(cluster, "b")    # the only prefill: probed, and fails again
    assert status == 502
    assert not m.instances["p0"].is_alive
    status, _, body = await _complete(cluster, "c")
    assert status == 503 and "no live prefill" in body["error"]["message"]
    text = await _metrics(cluster)
    assert 'instance_events_total{event="dead-failures",role="prefill"} 1.0' in text
    assert 'instance_events_total{event="connection-failure",role="prefill"} 2.0' in text


async def test_a_heartbeat_clears_suspicion(make_cluster):
    cluster = await make_cluster(prefill=1, decode=1, dead_after=60.0)
    p0 = cluster.instances["p0"]
    p0.is_heartbeating = False
    await p0.server.close()          # refuses connections, but will heartbeat again
    status, _, _ = await _complete(cluster, "x")
    assert status == 502 and cluster.svc.membership.instances["p0"].is_suspect
    p0.is_heartbeating = True
    await _wait_for(lambda: not cluster.svc.membership.instances["p0"].is_suspect)
    assert 'event="cleared",role="prefill"} 1.0' in await _metrics(cluster)


async def test_after_tokens_streamed_a_failure_ends_the_stream_without_retry(make_cluster):
    """With continuations off (--migration-limit 0; tests/conductor/test_continuation.py has them on)."""
    cluster = await make_cluster(prefill=1, decode=1, migration_limit=0)
    d1 = await cluster.add("decode", "d1", cost=SLOW_DECODE)
    cluster.instances["d0"].behaviour.break_after = 2
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt="abc", max_tokens=10, stream=True)
    got = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            got.append(chunk.choices[0].text)
    assert "decode instance d0" in str(info.value)
    assert "".join(got) == TOK.decode(expected_tokens(TOK.encode("abc"), 3))
    assert not d1.requests and "retries_total{" not in await _metrics(cluster)
    assert cluster.svc.membership.instances["d0"].is_suspect      # its stream broke
    await c.close()


async def test_a_broken_stream_is_told_in_one_plain_sentence_with_the_detail_logged(make_cluster, caplog):
    """The client reads what happened, not aiohttp's exception repr (that goes to the log); and
    when its own broken stream is the failure that takes the decode out of service, it still reads
    that its stream broke, as any other stream that broke there does."""
    cluster = await make_cluster(prefill=1, decode=1, dead_after=60.0, dead_after_failures=1, migration_limit=0)
    cluster.instances["d0"].behaviour.break_after = 2
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt="abc", max_tokens=10, stream=True)
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            pass
    told = "decode instance d0 failed mid-stream (connection lost); the request was not completed"
    assert info.value.message == told
    assert not cluster.svc.membership.instances["d0"].is_alive      # 1 failure in a row: dead
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(told + ": Client") for m in logged), logged   # the exception, logged
    assert any("1 connections in a row refused or broken" in m for m in logged), logged
    await c.close()


async def test_a_silent_store_leaves_the_index_and_resyncs_when_back(make_cluster):
    cluster = await make_cluster(prefill=2, decode=1, dead_after=1.0)
    prompt = "0123456789abcdef!"
    keys = prefix_hash(TOK.encode(prompt), 4, 0)
    for store in ("store0:1", "store1:1"):
        status, _ = await fakes.block_events(cluster.session, cluster.url, store, stored=keys, full=True)
        assert status == 200
    _, headers, _ = await _complete(cluster, prompt)
    assert headers["X-Mooncake-Route"] == "local-hit" and headers["X-Mooncake-Reused-Blocks"] == "4"
    index = cluster.svc.scheduler.index

    async def keepalive() -> None:         # store1 keeps posting; store0 was killed
        while True:
            await fakes.block_events(cluster.session, cluster.url, "store1:1")
            await asyncio.sleep(0.1)

    task = asyncio.create_task(keepalive())
    try:
        await _wait_for(lambda: index.num_blocks("store0:1") == 0, timeout=10)
        assert index.num_blocks("store1:1") == 4
    finally:
        task.cancel()
    _, headers, _ = await _complete(cluster, prompt)
    assert headers["X-Mooncake-Prefill"] == "p1"        # the only prefill whose store still holds them
    async with cluster.session.get(cluster.url + "/health") as r:
        assert [s["store"] for s in (await r.json())["stores"]] == ["store1:1"]
    assert "mooncake_conductor_stores_dropped_total 1.0" in await _metrics(cluster)
    # store0 comes back: its next post is answered with a request for a full sync
    status, body = await fakes.block_events(cluster.session, cluster.url, "store0:1")
    assert (status, body["resync"]) == (200, True)
    status, body = await fakes.block_events(cluster.session, cluster.url, "store0:1", stored=keys[:2], full=True)
    assert (body["resync"], index.num_blocks("store0:1")) == (False, 2)


# ---- Membership alone (no IO) ----------------------------------------------------------------
def _reg(role: str, iid: str) -> Register:
    return Register(role=role, instance_id=iid, http=f"{iid}:1", data=f"{iid}:2" if role == "decode" else None,
                    store=None, model="tiny", block_size=16, hash_seed=0, kv_bytes_per_token=64,
                    max_context=4096)


def test_suspects_leave_the_snapshot_unless_their_role_has_no_trusted_instance():
    m = Membership("tiny", 16, 0, dead_after_s=5, max_failures=3)
    for role, iid in (("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")):
        m.register(_reg(role, iid), 0.0)
    ids = lambda: ([p.instance_id for p in m.snapshot().prefills], [d.instance_id for d in m.snapshot().decodes])
    assert m.connection_failed("p0", "refused") == "suspect"
    assert m.connection_failed("d0", "refused") == "suspect"
    assert ids() == (["p1"], ["d0"])          # d0: the only decode, kept so a request probes it
    assert m.connection_failed("p0", "refused") is None
    m.trust("p0", "answered")
    assert ids() == (["p0", "p1"], ["d0"])
    assert m.connection_failed("d0", "refused") is None and m.connection_failed("d0", "refused") == "dead"
    assert ids() == (["p0", "p1"], []) and not m.instances["d0"].is_suspect
    assert m.events[("decode", "dead-failures")] == 1 and m.events[("prefill", "cleared")] == 1


def test_a_prefill_dying_after_its_result_does_not_fail_the_request_it_handed_to_decode():
    """Found by bench chaos: a request kept watching its prefill after the first token, so the
    prefill's death (heartbeats, seconds later) failed streams that decode was serving fine."""
    m = Membership("tiny", 16, 0, dead_after_s=5, max_failures=1)
    for role, iid in (("prefill", "p0"), ("decode", "d0")):
        m.register(_reg(role, iid), 0.0)
    failed: list[str] = []
    m.watch("p0", "r1", failed.append)
    m.watch("d0", "r1", failed.append)
    m.prefill_done("p0", "r1", 1.0)          # the prefill's result (first token) arrived
    assert m.connection_failed("p0", "refused") == "dead"
    assert failed == []
    assert m.connection_failed("d0", "refused") == "dead"
    # the decode still watches it; told in a plain sentence (the "last: ..." detail is the log's)
    assert failed == ["decode instance d0 stopped answering and was taken out of service"]
