"""Structured outputs at the conductor (api/structured.py): ``response_format`` and vLLM's
``structured_outputs`` become a grammar, malformed ones a 400 naming the field; every new grammar
is compiled once in a child process that a hostile one cannot wedge (it is killed), while the
event loop goes on; verdicts are cached and bounded."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_lite.conductor.api import structured
from mooncake_lite.conductor.api.errors import ApiError
from mooncake_lite.conductor.api.params import parse_request
from mooncake_lite.conductor.api.structured import GrammarChecker, parse_structured
from mooncake_lite.model.tokenizer import ByteTokenizer

pytest.importorskip("llguidance")
VOCAB = 320
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parse(kind: str = "chat", **extra):
    body = {"model": "m", "max_tokens": 4, **extra}
    body.setdefault("messages" if kind == "chat" else "prompt", [{"role": "user", "content": "hi"}]
                    if kind == "chat" else "hi")
    return parse_request(body, kind, served=("m",), tokenizer=ByteTokenizer(VOCAB), vocab_size=VOCAB,
                         max_context=512)


def refused(kind: str = "chat", **extra) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(kind, **extra)
    assert err.value.status == 400
    return err.value


def test_each_form_becomes_a_grammar_on_the_wire():
    forms = [{"response_format": {"type": "json_object"}},
             {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
             {"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": '{"type": "object"}'}},
             {"structured_outputs": {"regex": "[0-9]+"}}, {"structured_outputs": {"choice": ["yes", "no"]}},
             {"structured_outputs": {"json_object": True}}]
    grammars = {parse(**f).sampling.grammar for f in forms}
    assert None not in grammars and len(grammars) == 4   # object, SCHEMA, regex, choice: each twice or once
    assert parse(response_format={"type": "text"}).sampling.grammar is None
    assert parse().sampling.grammar is None
    assert parse("completion", structured_outputs={"regex": "a"}).sampling.grammar is not None


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_a_malformed_request_is_a_400_naming_its_field(extra, field):
    assert refused(**extra).param == field


def test_strict_false_is_enforced_all_the_same():
    """``strict`` false, true or absent: the same grammar, so an answer that stops matches the
    schema whatever the flag (vLLM's rule); a schema OpenAI's strict mode would refuse (a
    property not required) is taken, and its optional property may be left out."""
    import llguidance

    from mooncake_lite.model.grammar import ll_tokenizer
    loose = {**SCHEMA, "properties": {**SCHEMA["properties"], "b": {"type": "string"}}}
    grammars = {parse(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": loose, **flag}})
                .sampling.grammar for flag in ({"strict": False}, {"strict": True}, {})}
    assert len(grammars) == 1

    def accepts(text: str) -> bool:   # the byte tokenizer: a token per byte
        m = llguidance.LLMatcher(ll_tokenizer("tiny", VOCAB), grammars.copy().pop())
        ids = list(text.encode())
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
    assert accepts('{"a":1}') and accepts('{"a":1,"b":"x"}')
    assert not accepts('{"b":"x"}') and not accepts('{"a":"1"}') and not accepts('{"a": 1}')   # compact, too


@pytest.fixture
def checker():
    c = GrammarChecker("tiny", VOCAB)
    yield c
    asyncio.run(c.close())


def grammar(**spec) -> structured.Constraint:
    return parse_structured({"structured_outputs": spec})


def test_the_checker_refuses_what_does_not_compile_and_names_the_field(checker):
    async def run():
        await checker.check(grammar(json=SCHEMA))
        for bad, field in (({"json": {"type": "nope"}}, "structured_outputs.json"),
                           ({"regex": "(a|b"}, "structured_outputs.regex")):
            with pytest.raises(ApiError) as err:
                await checker.check(grammar(**bad))
            assert err.value.status == 400 and err.value.param == field
        await checker.close()
    asyncio.run(run())


def test_a_compile_past_its_time_is_refused_its_child_killed_and_the_loop_goes_on(checker, monkeypatch):
    async def run():
        await checker.warm()
        first = checker._child
        monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.0)   # every compile "too slow"
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        error = await checker.error_of(grammar(regex="(a{100}){100}").grammar)
        ticker.cancel()
        assert "did not compile within" in error and ticks > 0
        assert first.returncode is not None   # killed
        monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 30.0)
        assert await checker.error_of(grammar(regex="[0-9]+").grammar) == ""   # a new child answers
        assert await checker.error_of(grammar(regex="(a{100}){100}").grammar) == error   # remembered
        await checker.close()
    asyncio.run(run())


def test_verdicts_are_remembered_and_bounded(checker, monkeypatch):
    monkeypatch.setattr(structured, "NUM_CHECKED", 2)

    async def run():
        texts = [grammar(regex=f"x{{{n}}}").grammar for n in (1, 2, 3)]
        for text in texts:
            assert await checker.error_of(text) == ""
        assert list(checker._verdicts) == texts[1:]
        await checker.close()
    asyncio.run(run())
