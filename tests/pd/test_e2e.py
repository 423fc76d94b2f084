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
COMMON = ("--model", "tiny", "--block-size", str(BS), "--port", "0", "--no-profile")


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def decode_load(session, decode):
    async with session.get(f"{decode.url()}/v1/load") as resp:
        return await resp.json()


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
    decode = role_procs("decode", *COMMON, "--num-blocks", "128")
    prefill = role_procs("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "20")
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


async def test_two_stage_cpp_group_matches_reference(role_procs, model):
    decode = role_procs("decode", *COMMON, "--num-blocks", "128")
    prefill = role_procs("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "12", "--pipeline-group", "2")
    async with aiohttp.ClientSession() as session:
        await check_prompts(session, model, prefill, decode)


async def test_decode_refuses_over_tbt_slo_with_reason(role_procs):
    decode = role_procs("decode", "--model", "tiny", "--block-size", str(BS), "--port", "0", "--tbt-slo", "1us")
    async with aiohttp.ClientSession() as session:
        out = await generate(session, "http://unused", decode.url(), decode.addresses["data"], prompt(5, 1), 4)
        assert out.status == 429 and "TBT" in out.error and "SLO" in out.error
        bad = await session.post(f"{decode.url()}/v1/generate", data=b'{"request_id": 1}')
        assert bad.status == 400 and "GenerateRequest" in (await bad.json())["error"]


async def test_dead_prefill_and_dead_decode(role_procs, model):
    decode = role_procs("decode", *COMMON, "--num-blocks", "512")
    prefill = role_procs("prefill", *COMMON, "--num-blocks", "512", "--prefill-chunk", "8")
    long_prompt = prompt(3000, 7)
    async with aiohttp.ClientSession() as session:
        # prefill dies midway through the stream: decode fails the request and frees its blocks
        task = asyncio.ensure_future(generate(session, prefill.url(), decode.url(), decode.addresses["data"],
                                              long_prompt, 4, kv_timeout_s=20))
        await asyncio.sleep(1.0)
        prefill.proc.kill()
        out = await asyncio.wait_for(task, 60)
        assert out.finish_reason == "error" and ("broke midway" in out.error or "did not arrive" in out.error)
        load = await decode_load(session, decode)
        assert load["free_blocks"] == 512 and load["pending_transfers"] == 0

        # decode dies midway: prefill abandons the stream, answers 502, frees, and keeps serving
        prefill2 = role_procs("prefill", *COMMON, "--num-blocks", "512", "--prefill-chunk", "8")
        task = asyncio.ensure_future(generate(session, prefill2.url(), decode.url(), decode.addresses["data"],
                                              long_prompt, 4))
        await asyncio.sleep(1.0)
        decode.proc.kill()
        out = await asyncio.wait_for(task, 60)
        assert out.prefill_status == 502 and "decode" in out.prefill["error"].lower()
        async with session.get(f"{prefill2.url()}/v1/load") as resp:
            pload = await resp.json()
        assert pload["free_blocks"] == 512 and pload["num_queued"] == 0 and pload["num_failed"] == 1
        decode2 = role_procs("decode", *COMMON, "--num-blocks", "128")
        toks = prompt(40, 8)
        again = await generate(session, prefill2.url(), decode2.url(), decode2.addresses["data"], toks, 5)
        assert again.tokens == reference_greedy(model, toks, 5)


async def test_client_disconnect_aborts_and_frees(role_procs):
    decode = role_procs("decode", *COMMON, "--num-blocks", "64")
    async with aiohttp.ClientSession() as session:
        body = (b'{"request_id": "gone", "transfer_id": "t-gone", "prompt_len": 100, '
                b'"sampling": {"max_tokens": 50}, "kv_timeout_s": 60}')
        resp = await session.post(f"{decode.url()}/v1/generate", data=body)
        assert resp.status == 200
        assert (await decode_load(session, decode))["free_blocks"] < 64
        resp.close()                      # the conductor's client went away
        for _ in range(100):
            load = await decode_load(session, decode)
            if load["free_blocks"] == 64:
                break
            await asyncio.sleep(0.1)
        assert load["free_blocks"] == 64 and load["pending_transfers"] == 0
