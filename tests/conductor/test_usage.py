"""usage.completion_tokens counts every generated token the answer used, the one that completed
a stop string included (as vLLM counts it), streamed or not."""

from __future__ import annotations

import orjson
import pytest

from mooncake_lite.model.tokenizer import ByteTokenizer
from tests.conductor.fakes import expected_tokens

TOK = ByteTokenizer(320)
FULL = expected_tokens(TOK.encode("abc"), 12)   # what the fake instances generate for "abc"
TEXT = TOK.decode(FULL)


async def _sse_usage(r) -> tuple[str, dict]:
    text, usage = [], None
    for line in (await r.read()).decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = orjson.loads(line[6:])
        text += [c["text"] for c in chunk["choices"]]
        usage = chunk.get("usage") or usage
    return "".join(text), usage


@pytest.mark.parametrize("stop_at", [0, 5])   # the stop string in the first token, and mid-answer
async def test_stop_string_finish_counts_the_stopping_token(make_cluster, stop_at):
    cluster = await make_cluster()
    stop = TEXT[stop_at:stop_at + 2]   # one byte = one token: it ends with token stop_at + 1
    generated = stop_at + 2
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 12, "stop": [stop]}
    async with cluster.session.post(cluster.url + "/v1/completions", json={**body, "return_token_ids": True}) as r:
        out = await r.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == TEXT[:stop_at]
    assert choice["token_ids"] == FULL[:generated]
    assert out["usage"]["completion_tokens"] == generated
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + generated
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with cluster.session.post(cluster.url + "/v1/completions", json=streamed) as r:
        text, usage = await _sse_usage(r)
    assert text == TEXT[:stop_at] and usage["completion_tokens"] == generated
