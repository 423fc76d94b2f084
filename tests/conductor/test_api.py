"""The public API through the official openai client against a conductor with fake instances."""

from __future__ import annotations

import openai
import pytest

from mooncake_lite.conductor.api.params import chat_prompt
from mooncake_lite.model.tokenizer import ByteTokenizer
from tests.conductor.fakes import block_events, expected_tokens

TOK = ByteTokenizer(320)


def client(cluster, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                              timeout=10, **kw)


def text_of(ids: list[int]) -> str:
    return TOK.decode(ids)


async def test_completion_matches_the_instances_tokens(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    out = await c.completions.create(model="tiny", prompt="The moon is", max_tokens=7, temperature=0,
                                     presence_penalty=0, logprobs=None, echo=False)   # defaults are fine
    want = expected_tokens(TOK.encode("The moon is"), 7)
    assert out.choices[0].text == text_of(want)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(TOK.encode("The moon is"))
    assert out.usage.completion_tokens == 7 and out.usage.total_tokens == out.usage.prompt_tokens + 7
    await c.close()


async def test_streamed_completion_ends_with_done(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True,
                                        stream_options={"include_usage": True})
    texts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(texts) == text_of(expected_tokens(TOK.encode("hello"), 5))
    assert finish == "length" and usage.completion_tokens == 5
    # raw bytes: the stream really ends with the [DONE] sentinel
    async with cluster.session.post(cluster.url + "/v1/completions",
                                    json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        raw = await r.read()
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert raw.rstrip().endswith(b"data: [DONE]")
    await c.close()


async def test_chat_uses_the_documented_template(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    prompt_ids = TOK.encode("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n")
    assert prompt_ids == TOK.encode(chat_prompt(messages))
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text_of(expected_tokens(prompt_ids, 4))
    assert out.usage.prompt_tokens == len(prompt_ids)
    stream = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True)
    parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
    assert "".join(parts) == out.choices[0].message.content
    await c.close()


async def test_stop_token_and_stop_string(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    prompt = TOK.encode("abc")
    full = expected_tokens(prompt, 12)
    # stop on the third token id (vLLM's stop_token_ids extension)
    out = await c.completions.create(model="tiny", prompt="abc", max_tokens=12,
                                     extra_body={"stop_token_ids": [full[2]]})
    cut = full.index(full[2]) + 1
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == cut
    # stop string: text is cut before it, decode is told to stop
    text = text_of(full)
    stop = text[5:7]
    out = await c.completions.create(model="tiny", prompt="abc", max_tokens=12, stop=[stop])
    assert out.choices[0].text == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    await c.close()


async def test_models_health_metrics(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    models = await c.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert (await c.models.retrieve("tiny")).id == "tiny"   # GET /v1/models/{model}: it was a 404
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await c.models.retrieve("gpt-4")
    await c.completions.create(model="tiny", prompt="x", max_tokens=2)
    await block_events(cluster.session, cluster.url, "store0:1", full=True)   # a live store, no block yet
    async with cluster.session.get(cluster.url + "/health") as r:
        health = await r.json()
    assert (health["status"], health["ready"], health["prefill"], health["decode"]) == ("ok", True, 1, 1)
    assert health["stores"] == [{"store": "store0:1", "num_blocks": 0}]   # it was missing until it held one
    assert {(i["instance_id"], i["role"], i["alive"]) for i in health["instances"]} == \
        {("p0", "prefill", True), ("d0", "decode", True)}
    async with cluster.session.get(cluster.url + "/metrics") as r:
        text = await r.text()
    assert 'mooncake_conductor_requests_total{endpoint="completions",outcome="ok"} 1.0' in text
    assert "mooncake_conductor_ttft_seconds_count 1.0" in text
    assert 'mooncake_conductor_instances{role="prefill",state="alive"} 1.0' in text
    await c.close()


async def test_api_key_is_required_when_set(make_cluster):
    cluster = await make_cluster(api_key="sekret")
    bad = client(cluster, api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    good = client(cluster, api_key="sekret")
    out = await good.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2
    await bad.close()
    await good.close()
