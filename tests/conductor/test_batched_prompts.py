"""A batch of prompts in /v1/completions (issue #32): one flight per prompt, choice i per prompt i,
streamed and not, each text what that prompt alone gets (fake instances)."""

from __future__ import annotations

from tests.conductor.fakes import expected_tokens
from tests.conductor.test_api import TOK, client, text_of

PROMPTS = ["The moon is", "Two plus two", "hello"]


async def test_a_batch_of_prompts_gets_one_choice_each(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    out = await c.completions.create(model="tiny", prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == [text_of(expected_tokens(TOK.encode(p), 6)) for p in PROMPTS]
    assert out.usage.prompt_tokens == sum(len(TOK.encode(p)) for p in PROMPTS)
    assert out.usage.completion_tokens == 18
    await c.close()


async def test_a_streamed_batch_interleaves_its_choices_and_ends_each(make_cluster):
    cluster = await make_cluster()
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt=[TOK.encode(p) for p in PROMPTS], max_tokens=5,
                                        stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
        usage = chunk.usage or usage
    assert [texts[i] for i in range(3)] == [text_of(expected_tokens(TOK.encode(p), 5)) for p in PROMPTS]
    assert finish == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 15
    await c.close()
