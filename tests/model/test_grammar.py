"""Grammar-constrained decoding (model/grammar.py): whatever the logits say, an answer that ends
on EOS matches its grammar; a decode that rebuilds the state from the tokens so far masks as the
prefill's state does; rows without a grammar are untouched; compiled grammars are bounded."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mooncake_lite.common.protocol import Sampling
from mooncake_lite.model import grammar as grammar_mod
from mooncake_lite.model.grammar import GrammarError, Grammars, apply_masks, check
from mooncake_lite.model.tokenizer import ByteTokenizer
from mooncake_lite.prefill.results import sample_firsts

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

VOCAB = 320   # the byte-level presets' vocabulary: walks over it are fast
TOK = ByteTokenizer(VOCAB)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})


def walk(grammars: Grammars, text: str, seed: int, max_tokens: int = 200) -> tuple[str, bool]:
    """Random logits, masked: the answer, and whether it ended on EOS (a stop)."""
    gen = torch.Generator().manual_seed(seed)
    state, out = grammars.start(text), []
    for _ in range(max_tokens):
        logits = torch.randn(2, VOCAB, generator=gen)
        apply_masks(logits, [state, None])
        token = int(torch.argmax(logits[0]))
        if token == TOK.eos_token_id:
            return TOK.decode(out), True
        out.append(token)
        state.advance(token)
    return TOK.decode(out), False


def test_every_answer_that_stops_matches_its_schema_whatever_the_logits():
    grammars = Grammars("tiny", VOCAB)
    stops = 0
    for seed in range(25):
        answer, stopped = walk(grammars, json_grammar(SCHEMA), seed)
        if stopped:
            stops += 1
            jsonschema.validate(json.loads(answer), SCHEMA)
            assert " " not in answer.replace(json.loads(answer)["name"], "")   # compact: no padding
    assert stops >= 20


def test_regex_and_choice_grammars_hold_too():
    grammars = Grammars("tiny", VOCAB)
    regex = llguidance.LLMatcher.grammar_from_regex(r"[0-9]{3}-[a-z]{2,4}")
    choice = llguidance.LLMatcher.grammar_from_lark('start: "red" | "green" | "blue"')
    for seed in range(10):
        answer, stopped = walk(grammars, regex, seed)
        assert stopped and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", answer)
        answer, stopped = walk(grammars, choice, seed)
        assert stopped and answer in ("red", "green", "blue")


def test_a_state_rebuilt_from_the_tokens_so_far_masks_as_the_original():
    """The decode's matcher is never sent: it starts afresh and takes token 1 (the prefill's) and
    each later token; its masks equal those of one matcher that saw it all."""
    grammars = Grammars("tiny", VOCAB)
    text = json_grammar(SCHEMA)
    original, tokens = grammars.start(text), list(b'{"name":"ab","age":4')
    for t in tokens:
        original.advance(t)
    rebuilt = grammars.start(text)
    for t in tokens:
        rebuilt.advance(t)
    a, b = apply_masks(torch.zeros(1, VOCAB), [original]), apply_masks(torch.zeros(1, VOCAB), [rebuilt])
    assert torch.equal(a, b)
    allowed = {TOK.decode([t]) for t in torch.nonzero(a[0] == 0).flatten().tolist()}
    assert allowed == set("0123456789,}")


def test_unconstrained_rows_of_a_batch_are_left_alone():
    grammars = Grammars("tiny", VOCAB)
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    apply_masks(logits, [None, grammars.start(json_grammar(SCHEMA)), None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isinf(logits[1]).sum() == VOCAB - 1 and logits[1, ord("{")] == before[1, ord("{")]


def test_compiled_grammars_are_cached_and_bounded(monkeypatch):
    monkeypatch.setattr(grammar_mod, "NUM_CACHED", 2)
    grammars = Grammars("tiny", VOCAB)
    texts = [llguidance.LLMatcher.grammar_from_regex(f"x{{{n}}}") for n in (1, 2, 3)]
    for text in texts + texts[2:]:
        grammars.start(text)
    assert list(grammars._cache) == texts[1:]


def test_a_grammar_that_does_not_compile_is_an_error_not_a_crash():
    grammars = Grammars("tiny", VOCAB)
    with pytest.raises(GrammarError):
        grammars.start(llguidance.LLMatcher.grammar_from_regex("(a|b"))
    assert check(llguidance.LLMatcher.grammar_from_regex("(a|b"), "tiny", VOCAB)
    assert check(json_grammar(SCHEMA), "tiny", VOCAB) is None
    with pytest.raises(GrammarError):   # token 1 (the prefill's) under a grammar that fails
        sample_firsts(torch.zeros(VOCAB), Sampling(grammar=llguidance.LLMatcher.grammar_from_regex("(a|b")), [1],
                      grammars)


def test_a_failed_grammar_marks_its_sequence_failed_and_stops_masking_it():
    """A token the grammar refuses (the mask prevents it; a step past its fuel fails alike) sets
    ``error``: the decode ends that sequence with an error rather than a "stop"."""
    grammars = Grammars("tiny", VOCAB)
    state = grammars.start(llguidance.LLMatcher.grammar_from_regex("a+"))
    state.advance(ord("z"))
    assert state.error is not None and "grammar failed" in state.error
    logits = torch.zeros(1, VOCAB)
    assert torch.equal(apply_masks(logits, [state]), torch.zeros(1, VOCAB))


def test_the_grammar_is_each_choices_sampler_mask_and_logprobs_stay_raw():
    """With n = 3 each choice draws token 1 (the prefill's) under its own matcher and generator;
    its logprob is the raw row's, where the token the grammar forbids is still the likeliest.
    The decode's sampler continues its matcher from token 1, then masks its own draws."""
    from mooncake_lite.model.sampling import SequenceSampler, params_from_wire
    grammars = Grammars("tiny", VOCAB)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    logits[ord("z")] = 50.0
    sampling = Sampling(grammar=llguidance.LLMatcher.grammar_from_regex("[ab]{4}"), n=3, temperature=1.0,
                        seed=7, logprobs=1)
    firsts = sample_firsts(logits, sampling, [1, 2], grammars)
    assert set(firsts.tokens) <= {ord("a"), ord("b")} and len(firsts.logprobs) == 3
    raw = torch.log_softmax(logits, -1)
    for token, lp in zip(firsts.tokens, firsts.logprobs):
        assert lp.logprob == pytest.approx(float(raw[token]), abs=1e-5) and lp.top_ids == (ord("z"),)
    sampler = SequenceSampler(params_from_wire(sampling), 0, mask=grammars.start(sampling.grammar))
    sampler.resume(firsts.tokens[:1])
    drawn = [sampler.next(logits.clone())[0] for _ in range(3)]
    assert set(drawn) <= {ord("a"), ord("b")}   # four letters in all, then only the end is allowed
    assert sampler.next(logits.clone())[0] not in (ord("a"), ord("b"), ord("z"))
    assert sampler.mask.error is None
