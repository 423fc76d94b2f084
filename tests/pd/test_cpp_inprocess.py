"""A 2- and 3-stage CPP group in one process over loopback: exact tokens, overlap, failures."""

import asyncio

import pytest
import torch

from mooncake_lite.common.protocol import GenerateRequest, PrefillRequest, Sampling
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import PrefillAborted
from tests.pd.harness import cluster

pytestmark = pytest.mark.timeout(120)

BS = 8


def slices(bounds):
    return [build_model("tiny", seed=3, layer_range=r) for r in bounds]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("bounds", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
async def test_group_tokens_equal_reference_with_prefix_reuse(model, bounds):
    shared = prompt(2 * BS, 5)
    prompts = [shared + prompt(9, 6), shared + prompt(3, 7), prompt(4, 8)]
    async with cluster(model, block_size=BS, chunk=5, stage_models=slices(bounds)) as c:
        for i, toks in enumerate(prompts):
            got, reason, err = await c.request(f"r{i}", toks, 5)
            assert err is None and got == reference_greedy(model, toks, 5)
            for s in [c.prefill.stage, *(st.stage for st in c.stages)]:
                await s.drain_puts()
        many = await asyncio.gather(*(c.request(f"m{i}", p, 4) for i, p in enumerate(prompts)))
        assert [m[0] for m in many] == [reference_greedy(model, p, 4) for p in prompts]
        for s in [c.prefill.stage, *(st.stage for st in c.stages)]:
            assert s.runner.allocator.num_free == s.runner.allocator.num_blocks and s.jobs == {}


async def test_chunks_are_handed_on_while_the_next_stage_is_busy(model):
    """Stage 1 is held; the head still gets every chunk acknowledged, so it computes ahead."""
    async with cluster(model, block_size=BS, chunk=4, stage_models=slices([(0, 2), (2, 4)])) as c:
        stage1 = c.stages[0].stage
        gate = asyncio.Event()
        real = stage1.run_chunk

        async def held(job, start, **kw):
            await gate.wait()
            return await real(job, start, **kw)
        stage1.run_chunk = held
        toks = prompt(20, 9)
        task = asyncio.ensure_future(c.request("held", toks, 3))
        for _ in range(500):
            work = c.stages[0].works.get("held")
            if work is not None and work.chunks.qsize() >= 4:
                break
            await asyncio.sleep(0.01)
        assert work.chunks.qsize() >= 4      # all 5 chunks of 4 tokens passed on, stage 1 blocked on one
        gate.set()
        tokens, _, err = await task
        assert err is None and tokens == reference_greedy(model, toks, 3)


async def test_decode_dropping_the_request_stops_every_stage_and_frees(model):
    async with cluster(model, block_size=BS, chunk=2, stage_models=slices([(0, 2), (2, 4)])) as c:
        for i in range(30):
            rid = f"x{i}"
            c.decode.add_request(GenerateRequest(rid, f"t-{rid}", 30, Sampling(max_tokens=2)))
            task = asyncio.ensure_future(c.prefill.prefill(
                PrefillRequest(rid, f"t-{rid}", tuple(prompt(30, i)), c.data, Sampling(max_tokens=2))))
            for _ in range(i % 5 + 1):
                await asyncio.sleep(0)
            c.decode.abort(rid)
            with pytest.raises(PrefillAborted):
                await task
        stages = [c.prefill.stage, c.stages[0].stage]
        for _ in range(500):       # aborts travel down the group
            if all(not s.jobs for s in stages) and not c.stages[0].works:
                break
            await asyncio.sleep(0.01)
        for s in [c.prefill.stage, c.stages[0].stage]:
            assert s.jobs == {} and s.runner.allocator.num_free == s.runner.allocator.num_blocks
        assert c.stages[0].works == {}
        toks = prompt(12, 3)
        assert (await c.request("after", toks, 3))[0] == reference_greedy(model, toks, 3)


async def test_a_full_stage_refuses_cleanly_through_the_http_api(model, aiohttp_client):
    from mooncake_lite.prefill.app import make_app
    async with cluster(model, block_size=BS, chunk=4, stage_models=slices([(0, 2), (2, 4)])) as c:
        stage1 = c.stages[0].stage.runner.allocator
        held = stage1.allocate(stage1.num_free - 1)          # stage 1 has room for one block only
        client = await aiohttp_client(make_app(c.prefill))
        events = c.decode.add_request(GenerateRequest("big", "t-big", 20, Sampling(max_tokens=2)))
        body = {"request_id": "big", "transfer_id": "t-big", "token_ids": prompt(20, 1),
                "decode_data": c.data, "sampling": {"max_tokens": 2}}
        resp = await client.post("/v1/prefill", json=body)
        assert resp.status == 502 and "KV cache full" in (await resp.json())["error"]
        ev = await asyncio.wait_for(events.get(), 10)           # decode hears the abort, frees
        assert ev.finish_reason == "error"
        head = c.prefill.stage.runner.allocator
        assert head.num_free == head.num_blocks and c.prefill.stage.jobs == {}
        stage1.free(held)
        toks = prompt(20, 2)
        assert (await c.request("fits", toks, 3))[0] == reference_greedy(model, toks, 3)
