"""Real prefill and decode processes on 127.0.0.1: the tokens must be the monolithic greedy ones."""

import asyncio

import aiohttp
import pytest
import torch

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from tests.pd.client import generate

pytestmark = pytest.mark.timeout(240)

BS = 16
COMMON = ("--model", "tiny", "--block-size", str(BS), "--port", "0", "--no-profile", "--threads", "1")


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def start_many(role_procs, *specs):
    """Start several roles at once (each waits for its own ready line)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(lambda spec: role_procs(*spec), specs))


async def decode_load(session, decode):
    async with session.get(f"{decode.url()}/v1/load") as resp:
        return await resp.json()


async def streaming(session, decode, timeout: float = 30.0) -> None:
    """Until ``decode`` has a KV stream coming in: a peer killed then dies midway (after a fixed
    sleep, a fast box had finished the whole prompt first)."""
    for _ in range(int(timeout / 0.01)):
        if (await decode_load(session, decode))["pending_transfers"] > 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no KV stream reached the decode")


async def check_prompts(session, model, prefill, decode):
    shared = prompt(3 * BS, 1)
    prompts = [shared + prompt(5, 2), shared + prompt(BS + 3, 3), prompt(2 * BS, 4), prompt(7, 5),
               shared + prompt(5, 2)]
    sequential = [await generate(session, prefill.url(), decode.url(), decode.addresses["data"], p, 6)
                  for p in prompts[:2]]
    concurrent = await asyncio.gather(*(generate(session, prefill.url(), decode.url(), decode.addresses["data"],
                                                 p, 4 + i) for i, p in enumerate(prompts)))
    for p, out in zip(prompts[:2], sequential):
        assert out.error is None and out.tokens == reference_greedy(model, p, 6)
    for i, (p, out) in enumerate(zip(prompts, concurrent)):
        assert out.error is None and out.finish_reason == "length"
        assert out.tokens == reference_greedy(model, p, 4 + i)
    assert sequential[1].prefill["num_prefix_tokens"] == 3 * BS   # the shared prefix was loaded, not computed
    load = await decode_load(session, decode)
    assert load["num_running"] == 0 and load["pending_transfers"] == 0


async def test_single_instance_chunked_with_prefix_reuse_and_shared_batch(role_procs, model):
    decode, prefill = start_many(role_procs, ("decode", *COMMON, "--num-blocks", "128"),
                                 ("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "20"))
    async with aiohttp.ClientSession() as session:
        await check_prompts(session, model, prefill, decode)
        # the conductor's prefix keys are checked against the prompt
        toks = prompt(2 * BS + 1, 9)
        keys = tuple(k.hex() for k in prefix_hash(toks, BS, 0))
        ok = await generate(session, prefill.url(), decode.url(), decode.addresses["data"], toks, 3, prefix_keys=keys)
        assert ok.tokens == reference_greedy(model, toks, 3)
        bad = await generate(session, prefill.url(), decode.url(), decode.addresses["data"], toks, 3,
                             prefix_keys=("00" * 16,), kv_timeout_s=1.0)
        assert bad.prefill_status == 400 and "prefix_keys" in bad.prefill["error"]
        assert bad.finish_reason == "error"   # decode gave up on the KV that never came
        await check_client_disconnect(session, decode)
        await check_metrics(session, prefill, decode)


async def scrape(session, role) -> dict[str, float]:
    async with session.get(f"{role.url()}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def check_metrics(session, prefill, decode):
    """Prometheus figures track the work just done (prefix reuse counted, KV bytes moved, steps)."""
    p, d = await scrape(session, prefill), await scrape(session, decode)
    assert p["mooncake_prefill_prefix_tokens_total"] >= BS        # the shared-prefix prompts reused blocks
    assert p["mooncake_prefill_computed_tokens_total"] > 0
    assert p["mooncake_prefill_kv_bytes_sent_total"] > 0
    assert p["mooncake_prefill_num_queued"] == 0
    assert d["mooncake_decode_steps_total"] > 0 and d["mooncake_decode_num_running"] == 0
    if not torch.cuda.is_available():
        assert not any(k.startswith("mooncake_gpu") for k in {**p, **d})  # no GPU: no figures, no error


async def test_two_stage_cpp_group_matches_reference(role_procs, model):
    decode, prefill = start_many(
        role_procs, ("decode", *COMMON, "--num-blocks", "128"),
        ("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "12", "--pipeline-group", "2"))
    async with aiohttp.ClientSession() as session:
        await check_prompts(session, model, prefill, decode)
    assert prefill.stop() == 0     # a clean shutdown of the group is not an error


async def test_dead_prefill_and_dead_decode(role_procs, model):
    decode, decode2, prefill, prefill2 = start_many(
        role_procs, ("decode", *COMMON, "--num-blocks", "512"), ("decode", *COMMON, "--num-blocks", "128"),
        *[("prefill", *COMMON, "--num-blocks", "512", "--prefill-chunk", "8")] * 2)
    long_prompt = prompt(3000, 7)
    async with aiohttp.ClientSession() as session:
        # prefill dies midway through the stream: decode fails the request and frees its blocks
        task = asyncio.ensure_future(generate(session, prefill.url(), decode.url(), decode.addresses["data"],
                                              long_prompt, 4, kv_timeout_s=20))
        await streaming(session, decode)
        prefill.proc.kill()
        out = await asyncio.wait_for(task, 60)
        assert out.finish_reason == "error" and ("broke midway" in out.error or "did not arrive" in out.error)
        load = await decode_load(session, decode)
        assert load["free_blocks"] == 512 and load["pending_transfers"] == 0

        # decode dies midway: prefill abandons the stream, answers 502, frees, and keeps serving
        task = asyncio.ensure_future(generate(session, prefill2.url(), decode.url(), decode.addresses["data"],
                                              long_prompt, 4))
        await streaming(session, decode)
        decode.proc.kill()
        out = await asyncio.wait_for(task, 60)
        assert out.prefill_status == 502 and "decode" in out.prefill["error"].lower()
        async with session.get(f"{prefill2.url()}/v1/load") as resp:
            pload = await resp.json()
        assert pload["free_blocks"] == 512 and pload["num_queued"] == 0 and pload["num_failed"] == 1
        toks = prompt(40, 8)
        again = await generate(session, prefill2.url(), decode2.url(), decode2.addresses["data"], toks, 5)
        assert again.tokens == reference_greedy(model, toks, 5)


async def check_client_disconnect(session, decode):
    """A client that goes away while waiting for its stream aborts the request and frees it."""
    total = (await decode_load(session, decode))["free_blocks"]
    body = (b'{"request_id": "gone", "transfer_id": "t-gone", "prompt_len": 100, '
            b'"sampling": {"max_tokens": 50}, "kv_timeout_s": 60}')
    resp = await session.post(f"{decode.url()}/v1/generate", data=body)
    assert resp.status == 200
    assert (await decode_load(session, decode))["free_blocks"] < total
    resp.close()                      # the conductor's client went away
    for _ in range(100):
        load = await decode_load(session, decode)
        if load["free_blocks"] == total:
            break
        await asyncio.sleep(0.1)
    assert load["free_blocks"] == total and load["pending_transfers"] == 0


async def test_prefix_through_the_store_and_hot_spot_migration(role_procs, model):
    """Prefill A writes blocks to store 1 and loads them back from it for the next request;
    prefill C (store 2) gets them by migration from store 1; a CPP group on store 1 loads them
    layer range by layer range. Tokens stay exact throughout."""
    store_args = ("--port", "0", "--data-port", "0", "--dram", "16MiB", "--slot-bytes", "64KiB")
    store1, store2, decode = start_many(role_procs, ("store", *store_args), ("store", *store_args),
                                        ("decode", *COMMON, "--num-blocks", "128"))
    # with --store, a prefill keeps no private cache: a hit on `a` itself came from the store
    a, c, cpp = start_many(
        role_procs, ("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "24", "--store", store1.addresses["data"]),
        ("prefill", *COMMON, "--num-blocks", "64", "--store", store2.addresses["data"]),
        ("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "8", "--pipeline-group", "2",
         "--store", store1.addresses["data"]))

    shared = prompt(4 * BS, 21)
    data = decode.addresses["data"]
    async with aiohttp.ClientSession() as session:
        first = await generate(session, a.url(), decode.url(), data, shared + prompt(9, 22), 5)
        assert first.prefill["num_prefix_tokens"] == 0
        toks = shared + prompt(3, 23)
        for _ in range(50):   # write-back is asynchronous
            out = await generate(session, a.url(), decode.url(), data, toks, 5)
            if out.prefill["num_prefix_tokens"]:
                break
            await asyncio.sleep(0.1)
        assert out.prefill["num_prefix_tokens"] == 4 * BS and out.tokens == reference_greedy(model, toks, 5)

        keys = [k.hex() for k in prefix_hash(toks, BS, 0)]
        rid = "migrated"
        gen = {"request_id": rid, "transfer_id": "t-m", "prompt_len": len(toks), "sampling": {"max_tokens": 5}}
        resp = await session.post(f"{decode.url()}/v1/generate", json=gen)
        pre = {"request_id": rid, "transfer_id": "t-m", "token_ids": toks, "decode_data": data,
               "sampling": {"max_tokens": 5}, "migrate_from": store1.addresses["data"], "migrate_keys": keys}
        async with session.post(f"{c.url()}/v1/prefill", json=pre) as presp:
            result = await presp.json()
        tokens = [result["first_token"]] + [e["token"] async for e in _events(resp) if "token" in e]
        assert result["num_prefix_tokens"] == 4 * BS
        assert tokens == reference_greedy(model, toks, 5)

        # a CPP group on store 1: each stage loads its own layer range of the cached blocks
        toks = shared + prompt(11, 24)
        out = await generate(session, cpp.url(), decode.url(), data, toks, 5)
        assert out.prefill["num_prefix_tokens"] == 4 * BS and out.tokens == reference_greedy(model, toks, 5)


async def _events(resp):
    import orjson
    async for line in resp.content:
        yield orjson.loads(line)


def test_cpp_head_exits_when_its_stage_dies(role_procs):
    import os
    import signal
    import subprocess
    head = role_procs("prefill", *COMMON, "--num-blocks", "16", "--pipeline-group", "2")
    stage_pids = subprocess.run(["pgrep", "-P", str(head.proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(stage_pids) == 1
    os.kill(int(stage_pids[0]), signal.SIGKILL)
    assert head.proc.wait(60) == 1 and "CPP stage 1 is gone" in head.logs()
