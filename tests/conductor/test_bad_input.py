"""Bad input gets a clear 400 (OpenAI error shape), reaches no instance, and harms nobody."""

from __future__ import annotations

import openai
import pytest

from tests.conductor.test_api import client

LONG = "x" * 5000   # tiny's context is 4096 tokens; one byte = one token (+ BOS)


@pytest.mark.parametrize("body, needle, param", [
    (b"{not json", "not valid JSON", None),
    (b"[1, 2]", "must be a JSON object", None),
    (b'{"prompt": "hi"}', "'model' is required", "model"),
    (b'{"model": "tiny"}', "'prompt' is required", "prompt"),
    (b'{"model": "gpt-4", "prompt": "hi"}', "does not exist", "model"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": -3}', "must be at least 0", "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "9"}', "must be an integer", "max_tokens"),
    (b'{"model": "tiny", "prompt": "' + LONG.encode() + b'"}', "maximum context length is 4096", "prompt"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 5000}', "maximum context length is 4096", "max_tokens"),
    (b'{"model": "tiny", "prompt": []}', "prompt is empty", "prompt"),
    (b'{"model": "tiny", "prompt": ["a", 5]}', "a list of either", "prompt"),
    (b'{"model": "tiny", "prompt": ["a", []]}', "prompt is empty", "prompt"),
    (b'{"model": "tiny", "prompt": ["a", "' + LONG.encode() + b'"]}', "maximum context length", "prompt"),
    (b'{"model": "tiny", "prompt": [1, 99999]}', "outside the vocabulary", "prompt"),
    # issue #32: sampling controls, each bad value named
    (b'{"model": "tiny", "prompt": "hi", "n": 0}', "'n' must be an integer", "n"),
    (b'{"model": "tiny", "prompt": "hi", "n": 2.0}', "'n' must be an integer", "n"),
    (b'{"model": "tiny", "prompt": "hi", "n": 2, "best_of": 3}', "best_of", "best_of"),
    (b'{"model": "tiny", "prompt": "hi", "logprobs": 21}', "'logprobs' must be an integer in [0, 20]", "logprobs"),
    (b'{"model": "tiny", "prompt": "hi", "echo": "yes"}', "'echo' must be a boolean", "echo"),
    (b'{"model": "tiny", "prompt": "hi", "presence_penalty": 2.5}', "[-2, 2]", "presence_penalty"),
    (b'{"model": "tiny", "prompt": "hi", "frequency_penalty": "1"}', "[-2, 2]", "frequency_penalty"),
    (b'{"model": "tiny", "prompt": "hi", "repetition_penalty": 0}', "(0, 10]", "repetition_penalty"),
    (b'{"model": "tiny", "prompt": "hi", "min_tokens": 9, "max_tokens": 4}', "min_tokens", "min_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}}', "not a token id", "logit_bias"),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"99999": 1}}', "not a token id", "logit_bias"),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"5": 101}}', "[-100, 100]", "logit_bias"),
    (b'{"model": "tiny", "prompt": "hi", "suffix": "x"}', "not supported", "suffix"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": 7}', "temperature", "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "stream": "yes"}', "'stream' must be a boolean", "stream"),
])
async def test_completions_bad_input(make_cluster, body, needle, param):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert needle in err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert all(not inst.requests for inst in cluster.instances.values())   # nothing dispatched
    # the server is unharmed: a good request right after works
    async with cluster.session.post(cluster.url + "/v1/completions",
                                    json={"model": "tiny", "prompt": "hi", "max_tokens": 2}) as r:
        assert r.status == 200


@pytest.mark.parametrize("body, needle", [
    ({"model": "tiny"}, "'messages' is required"),
    ({"model": "tiny", "messages": []}, "'messages' is required"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "'role' one of"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, "messages[0].content is required in a user message"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": None}]},
     "messages[1].content is required"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    ({"model": "tiny", "messages": [{"role": "user", "content": LONG}]}, "maximum context length"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "at least 1"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
     "maximum context length"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "'top_logprobs' must be an integer in [0, 20]"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "needs 'logprobs'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "must be a boolean"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True}, "completions only"),
])
async def test_chat_bad_input(make_cluster, body, needle):
    cluster = await make_cluster()
    async with cluster.session.post(cluster.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert all(not inst.requests for inst in cluster.instances.values())


async def test_chat_bad_input_through_openai(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    with pytest.raises(openai.BadRequestError) as info:
        await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    assert info.value.status_code == 400 and "at least 1" in info.value.message
    await c.close()


async def test_unknown_model_via_openai_client(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model="llama-9000", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    await c.close()
