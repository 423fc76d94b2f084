"""Prefill's forwards and decode's steps on the host's monotonic clock (``GET /v1/timeline``),
which the conductor's cost export joins to split a decode's steps beside a computing prefill on
the same host from those run alone (issue #20 item 4)."""

from __future__ import annotations

import time

import pytest
from aiohttp import web

from mooncake_lite.decode.app import timeline as decode_timeline
from mooncake_lite.instance.colocation import colocation_split
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.app import SERVICE, timeline as prefill_timeline
from mooncake_lite.scheduler.costs import DecodeCostModel
from tests.pd.harness import cluster

pytestmark = pytest.mark.timeout(60)


async def test_forwards_and_steps_on_one_clock(aiohttp_client):
    async with cluster(build_model("tiny", seed=0), chunk=16) as c:
        t0 = time.monotonic()
        await c.request("a", list(range(1, 40)), max_tokens=6)     # 39 tokens: three chunks of 16
        await c.request("b", list(range(50, 60)), max_tokens=4)
        t1 = time.monotonic()
        forwards, steps = list(c.prefill.stage.timeline), list(c.decode.timeline)
        assert len(forwards) == 4 and len(steps) == 5 + 3
        assert all(t0 <= a < b <= t1 for a, b in forwards)
        assert all(t0 <= s[0] and s[0] + s[1] <= t1 for s in steps)
        # a request's steps come after its prefill's forwards; each request's first step after a wait
        assert steps[0][0] >= forwards[2][1] and steps[5][0] >= forwards[3][1]
        assert [s[4] for s in steps] == [1, 0, 0, 0, 0, 1, 0, 0]
        assert [(s[2], s[3], s[5]) for s in steps[:2]] == [(1, 40, 40), (1, 41, 41)]   # batch, context, longest
        intake = list(c.decode.intake)                   # (join time, prompt tokens, write seconds)
        assert [n for _, n, _ in intake] == [39, 10] and all(w > 0 for _, _, w in intake)
        assert forwards[2][1] <= intake[0][0] <= steps[0][0]
        split = colocation_split(steps, forwards, DecodeCostModel(c0=0.001))
        assert split["gaps_idle"] + split["gaps_busy"] == 6            # no gap across a wait

        app = web.Application()
        app[SERVICE] = c.prefill
        app.router.add_get("/p", prefill_timeline)
        client = await aiohttp_client(app)
        body = await (await client.get("/p")).json()
        assert body["clock"] == "monotonic" and body["host"] and len(body["forwards"]) == 4
        # what the waiting list did, on the same clock: each request landed, had its turn, gave it back
        turns = body["turns"]
        assert [(e[1], e[2]) for e in turns] == [("land", "a"), ("grant", "a"), ("free", ""),
                                                ("land", "b"), ("grant", "b"), ("free", "")]
        assert t0 <= turns[0][0] <= forwards[0][0] and forwards[2][1] <= turns[2][0] <= turns[3][0] <= t1


async def test_the_decode_says_its_attention_pads_on_cpu(aiohttp_client):
    from mooncake_lite.decode.app import ENGINE
    async with cluster(build_model("tiny", seed=0)) as c:
        await c.request("a", list(range(1, 12)), max_tokens=3)
        app = web.Application()
        app[ENGINE] = c.decode
        app.router.add_get("/d", decode_timeline)
        body = await (await (await aiohttp_client(app)).get("/d")).json()
    assert body["padded_attention"] is True and len(body["steps"]) == 2 and body["host"]
