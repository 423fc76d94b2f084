"""Tools at the conductor: ``tools``/``tool_choice`` checked (400 naming the field), the chat
template rendering them as ``transformers``' ``apply_chat_template(..., tools=...)`` does, the
grammar that forces ``required``/named calls, and calls parsed out of text, whole or streamed."""

from __future__ import annotations

import json
import random

import pytest
import torch

from mooncake_lite.conductor.api.errors import ApiError
from mooncake_lite.conductor.api.params import parse_request
from mooncake_lite.conductor.api.tool_parser import ToolCallStream, parse_whole
from mooncake_lite.model.chat import ChatTemplate
from mooncake_lite.model.grammar import Grammars, apply_masks
from mooncake_lite.model.tokenizer import ByteTokenizer
from tests.conductor.tool_templates import TEMPLATES, TOOLS

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
VOCAB = 320
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def tokenizer(parser: str | None = None) -> ByteTokenizer:
    tok = ByteTokenizer(VOCAB)
    tok.chat_template = ChatTemplate(TEMPLATES[parser], {"bos_token": "<s>"}) if parser else None
    return tok


def parse(parser: str = "hermes", templated: bool = True, kind: str = "chat", **extra):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    return parse_request(body, kind, served=("m",), tokenizer=tokenizer(parser if templated else None),
                         vocab_size=VOCAB, max_context=4096, tool_parser=parser)


@pytest.mark.parametrize("extra, field", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]}, "messages"),
])
def test_bad_tools_are_a_400_naming_the_field(extra, field):
    with pytest.raises(ApiError) as err:
        parse(**extra)
    assert err.value.status == 400 and err.value.param == field


@pytest.mark.parametrize("extra", [{"tools": TOOLS}, {"tool_choice": "auto"}, {"parallel_tool_calls": False}])
def test_tools_on_completions_are_refused_pointing_to_chat(extra):
    with pytest.raises(ApiError) as err:
        parse_request({"model": "m", "prompt": "x", **extra}, "completion", served=("m",),
                      tokenizer=ByteTokenizer(VOCAB), vocab_size=VOCAB, max_context=512)
    (field,) = extra
    assert err.value.status == 400 and err.value.param == field
    assert "/v1/completions" in err.value.message and "use /v1/chat/completions" in err.value.message


def conversation() -> tuple[list[dict], list[dict]]:
    """The same turns as an OpenAI client sends them (arguments a JSON string, content null) and
    as transformers' documentation has them (arguments an object)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "C"}'}}
    sent = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "call_2"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "21 C, sunny"}]
    hf_call = {**call, "function": {**call["function"], "arguments": {"city": "Paris", "unit": "C"}}}
    hf = [*sent[:2], {"role": "assistant", "content": None, "tool_calls": [hf_call, {**hf_call, "id": "call_2"}]},
          *sent[3:]]
    return sent, hf


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_the_template_renders_tools_calls_and_results_as_transformers_does(parser):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, "[UNK]")),
                                                  bos_token="<s>")
    sent, hf = conversation()
    expected = hf_tok.apply_chat_template(hf, tools=TOOLS, chat_template=TEMPLATES[parser], tokenize=False,
                                          add_generation_prompt=True)
    ours = parse(parser, messages=sent, tools=TOOLS)
    assert ByteTokenizer(VOCAB).decode(list(ours.prompt_ids)) == expected
    assert "get_weather" in expected and "21 C, sunny" in expected


def test_a_template_without_tools_sees_the_calls_written_in_the_parsers_format():
    """SmolLM2's template renders no tools and no tool_calls: the calls go into the assistant's
    content as the model would have written them, so the next turn still sees them."""
    sent, _ = conversation()
    text = ByteTokenizer(VOCAB).decode(list(parse("hermes", templated=False, messages=sent, tools=TOOLS).prompt_ids))
    assert text.count('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                      '</tool_call>') == 2
    assert "get_weather" not in text.split("<|assistant|>")[0]   # the tools themselves are not rendered


def forced(parser: str, seed: int, **extra) -> str:
    """An answer sampled from random logits under the request's tool grammar (until EOS)."""
    req = parse(parser, tools=TOOLS, **extra)
    state, out = Grammars("tiny", VOCAB).start(req.sampling.grammar), []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2000):
        logits = apply_masks(torch.randn(1, VOCAB, generator=gen), [state])
        token = int(torch.argmax(logits[0]))
        if token == ByteTokenizer.eos_token_id:
            return ByteTokenizer(VOCAB).decode(out)
        out.append(token)
        state.advance(token)
    raise AssertionError("the forced call never ended")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_required_and_named_always_yield_valid_calls(parser):
    named = {"type": "function", "function": {"name": "search"}}
    for seed in range(4):
        for extra, names, at_most in (({"tool_choice": "required", "parallel_tool_calls": False}, PARAMS, 1),
                                      ({"tool_choice": "required"}, PARAMS, 99),
                                      ({"tool_choice": named}, {"search"}, 1)):
            content, calls = parse_whole(forced(parser, seed, **extra), parser)
            assert content is None and 1 <= len(calls) <= at_most
            for call in calls:
                assert call.name in names
                jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])


ANSWERS = {"hermes": ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                      '"unit": {"x": [1, "}"]}}}\n</tool_call>\n<tool_call>\n{"name":"search","arguments":{}}\n</tool_call>'),
           "llama3_json": '{"name": "get_weather", "parameters": {"city": "Pa;ris"}}; {"parameters": {}, "name": "search"}'}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_calls_streamed_in_any_pieces_add_up_to_the_whole_answers_calls(parser):
    content, calls = parse_whole(ANSWERS[parser], parser)
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert content == ("Let me look." if parser == "hermes" else None)
    rng = random.Random(0)
    for _ in range(30):
        stream, text, deltas, i = ToolCallStream(parser), ANSWERS[parser], [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            deltas += stream.feed(text[i:i + n])
            i += n
        deltas += stream.finish()
        got: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                entry = got.setdefault(c["index"], {"name": None, "arguments": ""})
                if "id" in c:
                    assert entry["name"] is None and c["type"] == "function"   # the header comes once, first
                    entry["name"] = c["function"]["name"]
                entry["arguments"] += c["function"]["arguments"]
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        assert [(e["name"], json.loads(e["arguments"])) for e in got.values()] == \
            [(c.name, json.loads(c.arguments)) for c in calls]


def test_text_without_calls_or_with_a_call_cut_short_is_content():
    assert parse_whole("Paris is sunny.", "hermes") == ("Paris is sunny.", [])
    assert parse_whole("Paris is sunny.", "llama3_json") == ("Paris is sunny.", [])
    cut = '<tool_call>\n{"name": "get_weather", "argum'
    assert parse_whole(cut, "hermes") == (cut, [])


MARKERS = ["<tool_call>", "</tool_call>"]


def marker_tokenizer(path, flagged: bool):
    """A chat tokenizer holding Hermes' call markers as tokens: flagged special (Hermes 2 Pro, some
    conversions of Qwen's) or added unflagged (Qwen2.5/3's own tokenizer.json); and its HF twin."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from mooncake_lite.model.tokenizer import HFTokenizer
    from tests.model.hf_fixtures import CHAT_SPECIALS, save_chat_tokenizer
    save_chat_tokenizer(path, [ANSWERS["hermes"], "the weather in Paris"], 400,
                        specials=CHAT_SPECIALS + MARKERS * flagged)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    if not flagged:
        hf.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
        hf.backend_tokenizer.save(str(path / "tokenizer.json"))
    return HFTokenizer.from_file(str(path / "tokenizer.json")), hf


def hermes_choice(tok):
    from mooncake_lite.conductor.api.choices import Choice
    return Choice(0, "chat", tok, (), reasoning=False, opened=False, echo_text=None, top_k=None, tool_parser="hermes")


@pytest.mark.parametrize("flagged", [True, False])
def test_a_call_marker_the_tokenizer_flags_special_still_reaches_the_parser(tmp_path, flagged):
    """A marker flagged special is dropped by a plain decode (``skip_special_tokens``, as
    transformers and every OpenAI server show text), so the call would come back as content; an
    unflagged one shows. Either way the parser gets the marker, and a special token that is no
    marker (the end of turn) stays out of the text."""
    from mooncake_lite.conductor.flight.events import Token
    tok, hf = marker_tokenizer(tmp_path, flagged)
    ids = tok.encode(ANSWERS["hermes"], add_special_tokens=False) + [tok.token_to_id("<|im_end|>")]
    assert tok.token_to_id("<tool_call>") in ids
    assert ("<tool_call>" in hf.decode(ids, skip_special_tokens=True)) is not flagged   # what plain decoding does
    choice = hermes_choice(tok)
    deltas = [d for t in ids for d in choice.deltas(choice.add(Token(t)))]
    deltas += choice.deltas(choice.flush()) + choice.deltas(None)
    streamed = [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    message = choice.message(choice.text.output_text)
    assert streamed == [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "search"]
    assert message["content"] == "Let me look." and "<|im_end|>" not in choice.text.output_text
    assert choice.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("flagged", [True, False])
def test_a_forced_call_writes_the_markers_as_the_tokenizers_tokens(tmp_path, flagged):
    """``tool_choice: required`` on a tokenizer that holds ``<tool_call>`` as one token: the
    grammar allows that token only, never the marker spelled in text pieces (``<``, ``tool``, ...),
    which the model was not trained to write; the parser reads the call out of the answer."""
    import llguidance

    from mooncake_lite.conductor.flight.events import Token
    from mooncake_lite.model.grammar import GrammarState
    tok, _ = marker_tokenizer(tmp_path, flagged)
    start, end, eot = (tok.token_to_id(t) for t in (*MARKERS, "<|im_end|>"))
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False}
    req = parse_request(body, "chat", served=("m",), tokenizer=tok, vocab_size=400, max_context=4096)
    grammar = req.sampling.grammar
    assert f"<[{start}]>" in grammar and f"<[{end}]>" in grammar
    ll = llguidance.LLTokenizer(tok.tokenizer_json, n_vocab=400, eos_token=[eot])
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        state, ids = GrammarState(llguidance.LLMatcher(ll, grammar, log_level=0)), []
        while not ids or ids[-1] != eot:
            ids.append(int(torch.argmax(apply_masks(torch.randn(1, 400, generator=gen), [state])[0])))
            state.advance(ids[-1])
            assert len(ids) < 2000 and not state.is_broken
        assert ids[0] == start and ids[-2] == end and ids.count(start) == ids.count(end) == 1
        choice = hermes_choice(tok)
        for t in ids:
            choice.add(Token(t))
        choice.flush()
        (call,) = choice.message(choice.text.output_text)["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])
