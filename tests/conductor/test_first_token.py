"""Token 1 reaches a streaming client as soon as the prefill has it, not with decode's first step.

The fake decode holds every token after the first (``token_delay_s`` far beyond the wait), so a
relay that sends token 1 only together with the next one never delivers it here.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tests.conductor.fakes import expected_tokens

HELD_S = 60.0     # decode's pause before token 2: the test ends long before it
WAIT_S = 10.0     # bound on waiting for token 1 (it takes milliseconds once sent)


async def _first_content(resp, kind: str) -> str:
    """The first SSE chunk that carries generated text."""
    async for line in resp.content:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        choice = orjson.loads(line[6:])["choices"][0]
        text = choice["delta"].get("content") if kind == "chat" else choice["text"]
        if text:
            return text
    raise AssertionError("the stream ended without any text")


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_first_token_is_not_held_for_the_second(make_cluster, kind):
    cluster = await make_cluster()
    cluster.instances["d0"].behaviour.token_delay_s = HELD_S
    if kind == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        url, body = "/v1/completions", {"prompt": "hello"}
    body = {"model": "tiny", "max_tokens": 4, "stream": True, **body}
    async with cluster.session.post(cluster.url + url, json=body) as resp:
        assert resp.status == 200
        text = await asyncio.wait_for(_first_content(resp, kind), WAIT_S)
    prefill = cluster.instances["p0"].requests[0]
    assert text == chr(expected_tokens(list(prefill.token_ids), 1)[0])   # token 1, while 2 is held
