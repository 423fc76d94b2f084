"""The decode HTTP API in process: admission refusals, bad input, abort, NDJSON events."""

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import orjson
import pytest

from mooncake_lite.common.service import bound_port, start_site
from mooncake_lite.decode.app import DecodeAppSettings, make_app
from mooncake_lite.decode.batcher import DecodeBatcher
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.scheduler.costs import DecodeCostModel

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine():
    runner = ModelRunner(build_model("tiny"), num_blocks=16, block_size=8)
    # 5 ms + 10 ms per sequence: the SLO of 30 ms admits two sequences, not three
    batcher = DecodeBatcher(runner.allocator, 8, cost=DecodeCostModel(0.005, 0.010, 0.0), tbt_slo_s=0.030)
    return DecodeEngine(runner, batcher, ThreadPoolExecutor(1))


def gen(rid, prompt_len=8, max_tokens=4, timeout=30, **more):
    return orjson.dumps({"request_id": rid, "transfer_id": f"t-{rid}", "prompt_len": prompt_len,
                         "sampling": {"max_tokens": max_tokens}, "kv_timeout_s": timeout, **more})


async def test_refusals_have_reasons_and_abort_frees(aiohttp_client, engine):
    client = await aiohttp_client(make_app(engine, DecodeAppSettings()))
    r1 = await client.post("/v1/generate", data=gen("a"))
    r2 = await client.post("/v1/generate", data=gen("b"))
    assert r1.status == r2.status == 200
    r3 = await client.post("/v1/generate", data=gen("c"))
    assert r3.status == 429
    assert "predicted TBT 35.00 ms with batch 3 exceeds the TBT SLO 30.00 ms" in (await r3.json())["error"]
    big = await client.post("/v1/generate", data=gen("d", prompt_len=500))
    assert big.status == 429 and "only 16" in (await big.json())["error"]
    dup = await client.post("/v1/generate", data=gen("e").replace(b"t-e", b"t-a"))
    assert dup.status == 400 and "already in use" in (await dup.json())["error"]

    aborted = await client.post("/v1/abort", json={"request_id": "a"})
    assert (await aborted.json()) == {"aborted": True}
    assert orjson.loads(await r1.content.readline()) == {"finish_reason": "abort"}
    assert (await (await client.post("/v1/abort", json={"request_id": "a"})).json()) == {"aborted": False}
    load = await (await client.get("/v1/load")).json()
    assert load["num_waiting"] == 1 and load["rejected"] == 2
    r3 = await client.post("/v1/generate", data=gen("c"))   # room again after the abort
    assert r3.status == 200


async def test_a_reservation_whose_kv_comes_later_is_judged_then(aiohttp_client, engine):
    # a and b (KV due now, 4 tokens at 25 ms) will have finished when c's KV is due in a minute
    client = await aiohttp_client(make_app(engine, DecodeAppSettings()))
    for rid in ("a", "b"):
        assert (await client.post("/v1/generate", data=gen(rid))).status == 200
    now = await client.post("/v1/generate", data=gen("c"))
    assert now.status == 429 and "with batch 3" in (await now.json())["error"]
    soon = await client.post("/v1/generate", data=gen("c", kv_in_s=0.01))
    assert soon.status == 429 and "when its KV is due in 0.01 s" in (await soon.json())["error"]
    later = await client.post("/v1/generate", data=gen("c", kv_in_s=60))
    assert later.status == 200 and engine.batcher.seqs["c"].join_at > engine.batcher.seqs["a"].join_at + 59


@pytest.mark.parametrize("body, fragment", [
    (b"not json", "invalid JSON"),
    (b'{"request_id": "x"}', "missing field"),
    (b'{"request_id": "x", "transfer_id": "t", "prompt_len": "5", "sampling": {}}', "expected int"),
    (b'{"request_id": "x", "transfer_id": "t", "prompt_len": 0, "sampling": {}}', "must be positive"),
    (b'{"request_id": "x", "transfer_id": "t", "prompt_len": 3, "sampling": {}, "kv_timeout_s": 0}', "kv_timeout_s"),
    (b'{"request_id": "x", "transfer_id": "t", "prompt_len": 3, "sampling": {"temperature": -1}}', "temperature"),
    (gen("x", kv_in_s=-0.5), "kv_in_s must be within [0, 3600] seconds, got -0.5"),
    (gen("x", kv_in_s=1e300), "kv_in_s must be within"),
    (gen("x", kv_in_s="soon"), "kv_in_s: expected float"),
    (gen("x", kv_in_s=True), "kv_in_s: expected float"),
    (gen("x", kv_in_s=[1]), "kv_in_s: expected float"),
    (gen("x")[:-1] + b', "kv_in_s": NaN}', "invalid JSON"),
    (gen("x")[:-1] + b', "kv_in_s": 1e999}', "invalid JSON"),
])
async def test_bad_requests_get_400(aiohttp_client, engine, body, fragment):
    client = await aiohttp_client(make_app(engine, DecodeAppSettings()))
    resp = await client.post("/v1/generate", data=body)
    assert resp.status == 400 and fragment in (await resp.json())["error"]
    assert engine.runner.allocator.num_free == 16



async def test_a_disconnect_ends_the_stream_quietly(engine, caplog):
    """The conductor closing a token stream (stop string, its client gone, its shutdown) is
    normal: decode aborts the request, logs one INFO line and no ERROR traceback. Served as in
    production (``start_site``: a disconnect does not cancel the handler, as aiohttp's test
    server would)."""
    runner, site = await start_site(make_app(engine, DecodeAppSettings(disconnect_poll_s=0.02)), "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"http://127.0.0.1:{bound_port(site)}/v1/generate", data=gen("a"))
            assert resp.status == 200 and "a" in engine.requests   # its KV never comes: it waits
            caplog.set_level(logging.INFO)
            resp.close()                                          # the conductor goes away
            for _ in range(500):                                  # the poll notices; the handler ends
                if "a" not in engine.requests:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)   # room for aiohttp to log what the handler raised, if anything
    finally:
        await runner.cleanup()
    assert "client of request a disconnected; aborting it" in caplog.text
    assert "a" not in engine.requests and engine.runner.allocator.num_free == 16
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
