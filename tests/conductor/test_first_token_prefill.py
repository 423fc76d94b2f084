"""The prefill answers /v1/prefill with the first token while decode is still in a step.

Decode answers the KV stream's END only once every frame is written into its cache, and writes
run in its one model thread behind the step in progress; the first token must not wait for that.
Here decode's thread is held (as a long step holds it) while a real prefill streams to it.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import orjson
import pytest
import torch
from aiohttp import web

from mooncake_lite.common.protocol import GenerateRequest, PrefillRequest, Sampling, dumps
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill import app as prefill_app
from tests.pd.harness import cluster

pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0    # bound on the answer's wait (milliseconds once sent; the held step never ends alone)


def prompt(n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(5)).tolist()


async def test_prefill_answers_first_token_while_decode_step_is_held(aiohttp_server):
    model = build_model("tiny", seed=3)
    toks = prompt(21)
    async with cluster(model, block_size=8, chunk=16) as c:
        app = web.Application()
        app[prefill_app.SERVICE], app[prefill_app.ENDING] = c.prefill, set()
        app.router.add_post("/v1/prefill", prefill_app.prefill)
        server = await aiohttp_server(app)
        events = c.decode.add_request(GenerateRequest("r", "t-r", len(toks), Sampling(max_tokens=3)))
        gate = threading.Event()
        c.decode.executor.submit(gate.wait, 30)        # decode's thread is busy "stepping"
        try:
            req = PrefillRequest("r", "t-r", tuple(toks), c.data, Sampling(max_tokens=3))
            async with aiohttp.ClientSession() as s:
                resp = await asyncio.wait_for(s.post(f"http://127.0.0.1:{server.port}/v1/prefill",
                                                     data=dumps(req)), WAIT_S)
                body = orjson.loads(await resp.read())
            assert resp.status == 200, body
            assert "t-r" in c.decode.pending and c.decode.batcher.num_running == 0   # END not yet answered
        finally:
            gate.set()
        tokens = [body["first_token"]]
        while True:
            ev = await asyncio.wait_for(events.get(), WAIT_S)
            if ev.token is not None:
                tokens.append(ev.token)
            if ev.finish_reason is not None:
                break
        assert tokens == reference_greedy(model, toks, 3)
        await asyncio.wait_for(asyncio.gather(*app[prefill_app.ENDING]), WAIT_S)
        assert c.prefill.stage.jobs == {} and c.prefill.queue == {}
