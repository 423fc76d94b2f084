"""Structured outputs and tools through ``mooncake up`` on the default model (SmolLM2-135M), with
the official ``openai`` client: every ``json_schema`` answer that stops validates; a constrained
and a free sequence share decode steps; a tool-calling loop completes (SmolLM2's template has no
tools section: ``required``/named calls come from the grammar alone); a named call streams as
OpenAI's do; a hostile grammar is a 400 while other requests go on."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conductor.tool_templates import TOOLS
from tests.real_model import SMOLLM, needs_smollm

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), needs_smollm]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"enum": ["Paris", "Tokyo", "Lima"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
# 100 in docs/results/2026-11-29-structured-outputs.md (MOONCAKE_SCHEMA_ANSWERS=100); fewer by
# default, to keep the suite's time.
NUM_SCHEMA_ANSWERS = int(os.environ.get("MOONCAKE_SCHEMA_ANSWERS", "32"))
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def api(smollm_api):
    """``mooncake up`` exactly as a user runs it (default model, block size and admission), shared
    with the session's other default-model tests (tests/conftest.py)."""
    return smollm_api


def client(api: str, retries: int = 0):
    """``retries``: for a burst, as an eval harness sends it. The default admission may refuse
    part of a burst with 429 + Retry-After where the box is slow or loaded (CI, 2026-11-29:
    "predicted TTFT 0.981s (bound by its measured spread 2.99s) > SLO 2.89s" for the 8th of 8),
    and the official client waits that long and sends it again; what is checked is the answers."""
    return openai.OpenAI(base_url=api, api_key="none", max_retries=retries, timeout=300)


def test_every_json_schema_answer_that_stops_validates(api):
    c = client(api, retries=8)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(i: int):
        r = c.chat.completions.create(model=SMOLLM, messages=[{"role": "user", "content": "Describe a person."}],
                                      response_format=fmt, max_tokens=48, temperature=1.0, seed=i)
        return r.choices[0].finish_reason, r.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(NUM_SCHEMA_ANSWERS)))
    stopped = [text for reason, text in answers if reason == "stop"]
    for text in stopped:
        jsonschema.validate(json.loads(text), PERSON)
    assert {reason for reason, _ in answers} <= {"stop", "length"} and len(stopped) >= NUM_SCHEMA_ANSWERS * 0.8


def _decode_steps(api: str) -> list[list]:
    health = json.load(urllib.request.urlopen(api.removesuffix("/v1") + "/health", timeout=30))
    (decode,) = [i["http"] for i in health["instances"] if i["role"] == "decode"]
    return json.load(urllib.request.urlopen(f"http://{decode}/v1/timeline", timeout=30))["steps"]


def test_a_constrained_and_a_free_sequence_share_decode_steps(api):
    c = client(api)
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    # The free row is long and sent first, so it is still decoding when the shaped one arrives: a
    # decode step of the default model is ~20 ms on one core, so 40 tokens could end before the
    # shaped prompt's prefill (and its grammar) was done, and the two never shared a step.
    free = dict(model=SMOLLM, messages=messages, max_tokens=160, temperature=0, extra_body={"ignore_eos": True})
    alone = c.chat.completions.create(**free).choices[0].message.content
    start = time.monotonic()   # the decode's timeline is on this host's monotonic clock
    with ThreadPoolExecutor(2) as pool:
        together = pool.submit(c.chat.completions.create, **free)
        time.sleep(0.2)
        shaped = pool.submit(c.chat.completions.create, model=SMOLLM, messages=messages, max_tokens=40,
                             temperature=0, response_format={"type": "json_schema",
                                                             "json_schema": {"name": "p", "schema": PERSON}})
        shaped, together = shaped.result(), together.result()
    steps = [step for step in _decode_steps(api) if step[0] >= start]   # (start, seconds, batch, ...)
    assert any(step[2] == 2 for step in steps)          # both in one batch, nothing else in flight
    assert together.choices[0].message.content == alone   # the mask never touched the free row
    if shaped.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(shaped.choices[0].message.content), PERSON)


def test_a_tool_calling_loop_with_the_openai_client(api):
    c = client(api)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.chat.completions.create(model=SMOLLM, messages=messages, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
    final = c.chat.completions.create(model=SMOLLM, messages=messages, tools=TOOLS, tool_choice="none",
                                      max_tokens=30, temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert not answer.message.tool_calls


def test_a_named_call_streams_its_arguments_as_openai_does(api):
    c = client(api)
    chunks = list(c.chat.completions.create(
        model=SMOLLM, messages=[{"role": "user", "content": "Search for cats."}], tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "search"}}, max_tokens=60, temperature=0))
    parts = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert parts[0].id.startswith("call_") and parts[0].function.name == "search"
    assert {p.index for p in parts} == {0} and len(parts) > 2          # the arguments come in pieces
    arguments = "".join(p.function.arguments or "" for p in parts)
    jsonschema.validate(json.loads(arguments), PARAMS["search"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_each_of_n_choices_keeps_its_own_grammar_and_streams_its_own_call(api):
    """n = 2 sampled choices, each with its own matcher (the samplers' mask) and tool-call parser:
    each streams a valid call under its own index and finishes "tool_calls", with logprobs."""
    c = client(api)
    chunks = list(c.chat.completions.create(
        model=SMOLLM, messages=[{"role": "user", "content": "Search for cats."}], tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "search"}}, max_tokens=60, n=2, temperature=1.0,
        seed=5, logprobs=True, parallel_tool_calls=False))
    for index in (0, 1):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == index]
        parts = [d for ch in mine for d in (ch.delta.tool_calls or [])]
        assert parts[0].function.name == "search"
        jsonschema.validate(json.loads("".join(p.function.arguments or "" for p in parts)), PARAMS["search"])
        assert mine[-1].finish_reason == "tool_calls"
        assert all(lp.logprob <= 0 for ch in mine if ch.logprobs for lp in ch.logprobs.content)


def test_vllm_structured_outputs_regex_and_choice(api):
    c = client(api)
    ask = dict(model=SMOLLM, messages=[{"role": "user", "content": "Pick one."}], max_tokens=12, temperature=0)
    r = c.chat.completions.create(**ask, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=SMOLLM, prompt="My number is", max_tokens=12, temperature=0,
                             extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) == 8


def test_a_hostile_grammar_is_a_400_while_other_requests_go_on(api):
    c = client(api)
    c.chat.completions.create(model=SMOLLM, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                              extra_body={"structured_outputs": {"regex": "[a-z]+"}})   # the checker is up
    other: list = []
    free = threading.Thread(target=lambda: other.append(c.chat.completions.create(
        model=SMOLLM, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=24, temperature=0)))
    free.start()
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=SMOLLM, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(a{1000}){1000}(b{1000}){1000}"}})
    assert err.value.body["param"] == "structured_outputs.regex"
    free.join(300)
    assert other and other[0].choices[0].finish_reason in ("stop", "length")
