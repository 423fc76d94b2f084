"""``--reasoning-parser think``: a thinking model's reasoning apart from its answer."""

from __future__ import annotations

import openai
import pytest

from mooncake_lite.conductor.api.params import chat_prompt
from mooncake_lite.conductor.api.reasoning import ThinkSplitter, opens_reasoning, split_whole
from mooncake_lite.model.tokenizer import ByteTokenizer
from tests.conductor import fakes

ANSWERS = {   # output -> (reasoning, content), the output starting as the model writes it
    "<think>\nIt is Paris.\n</think>\n\nParis.": ("It is Paris.\n", "Paris."),
    "Paris.": (None, "Paris."),
    "  Paris": (None, "  Paris"),
    "<think>\n\n</think>\n\nHi": (None, "Hi"),                   # thinking switched off by the template
    "<think>cut short by max_tokens": ("cut short by max_tokens", ""),
    "<thi": (None, "<thi"),                                       # a tag never finished is text
    "a <think> b </think> c": (None, "a <think> b </think> c"),   # only a leading block is reasoning
    "<think>x</thinking> y</think>z": ("x</thinking> y", "z"),
}


# The prompt already opened the block (an R1-distill template): the answer starts inside it.
OPENED = {
    "Let me see.\n</think>\n\n42": ("Let me see.\n", "42"),
    "<think>\nhm\n</think>\n\nok": ("hm\n", "ok"),               # the model repeats the prompt's tag
    "no closing tag": ("no closing tag", ""),
    "\n\n</think>\n\nA": (None, "A"),
}


def _streamed(output: str, size: int, opened: bool) -> tuple[str | None, str]:
    splitter, reasoning, content = ThinkSplitter(opened), "", ""
    for i in range(0, len(output), size):
        r, c = splitter.feed(output[i:i + size])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return (reasoning + r) or None, content + c


@pytest.mark.parametrize("output, opened", [(o, False) for o in ANSWERS] + [(o, True) for o in OPENED])
def test_whole_and_streamed_in_any_cut_agree(output, opened):
    want = (OPENED if opened else ANSWERS)[output]
    assert split_whole(output, opened) == want
    for size in range(1, len(output) + 1):        # every delta size: tags cut at every point
        assert _streamed(output, size, opened) == want, size


def test_a_template_that_opens_the_block_is_recognised():
    assert opens_reasoning("<|Assistant|><think>\n") and not opens_reasoning("<|assistant|>\n")


TOK = ByteTokenizer(320)
SCRIPT = "<think>\nhmm\n</think>\n\nok"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def scripted(monkeypatch):
    """The fake model writes SCRIPT after the chat prompt of MESSAGES, then 'z' for ever."""
    prompt, script = TOK.encode(chat_prompt(MESSAGES)), TOK.encode(SCRIPT)
    real = fakes.fake_next

    def next_id(ids):
        at = len(ids) - len(prompt)
        if list(ids[:len(prompt)]) != prompt:
            return real(ids)
        return script[at] if at < len(script) else TOK.encode("z")[0]
    monkeypatch.setattr(fakes, "fake_next", next_id)
    return len(script)


async def test_the_api_sends_reasoning_apart_whole_and_streamed(make_cluster, scripted):
    cluster = await make_cluster(reasoning_parser="think")
    c = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=10)
    out = await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=scripted)
    message = out.choices[0].message.model_dump()
    assert (message["reasoning_content"], message["content"]) == ("hmm\n", "ok")
    inside = len(TOK.encode("<think>\nh"))                     # cut by max_tokens inside the block
    cut = await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=inside)
    assert (cut.choices[0].message.model_dump()["reasoning_content"], cut.choices[0].message.content) == ("h", None)
    assert out.usage.completion_tokens == scripted            # every token counted, tags included
    stream = await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=scripted, stream=True)
    reasoning, content = "", ""
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert (reasoning, content) == ("hmm\n", "ok")
    await c.close()


async def test_without_the_parser_the_tags_are_content(make_cluster, scripted):
    cluster = await make_cluster()
    c = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=10)
    out = await c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=scripted)
    assert out.choices[0].message.content == SCRIPT
    assert "reasoning_content" not in out.choices[0].message.model_dump(exclude_unset=True)
    await c.close()
