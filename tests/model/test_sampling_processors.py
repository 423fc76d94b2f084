"""The logits processors and logprobs of ``model/sampling.py`` (issue #32) against ``transformers``'
own processors on the same logits, and OpenAI's documented penalty formula written out here."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mooncake_lite.model.sampling import (SamplingParams, SequenceSampler, make_draws, process, prompt_logprobs,
                                          sample, token_logprob)

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,  # noqa: E402
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

VOCAB = 97
PROMPT = [3, 5, 5, 8, 13, 21]
OUTPUT = [5, 40, 40, 40, 2, 77]


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits = _logits()
    ours = process(logits.clone(), SamplingParams(repetition_penalty=penalty, penalty_ids=tuple(set(PROMPT))),
                   Counter(OUTPUT), len(OUTPUT))
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUT]), logits.clone()[None])[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("num_generated", [0, 2, 3, 7])
def test_min_tokens_equals_transformers(num_generated):
    stops = (2, 77)
    logits = _logits(1)
    ours = process(logits.clone(), SamplingParams(min_tokens=3, stop_token_ids=stops), Counter(), num_generated)
    ids = torch.tensor([PROMPT + OUTPUT[:num_generated]])
    theirs = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, list(stops))(ids, logits.clone()[None])[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert torch.isinf(ours[list(stops)]).all() == (num_generated < 3)


def test_logit_bias_equals_transformers_sequence_bias():
    bias = ((4, 2.5), (9, -100.0), (60, 7.0))
    logits = _logits(2)
    ours = process(logits.clone(), SamplingParams(logit_bias=bias), Counter(), 0)
    processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})
    theirs = processor(torch.tensor([PROMPT]), logits.clone()[None])[0]
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("presence, frequency", [(0.7, 0.0), (0.0, 1.1), (-0.5, 0.4), (2.0, -2.0)])
def test_presence_and_frequency_follow_openais_formula(presence, frequency):
    # OpenAI: mu[j] -> mu[j] - c[j] * frequency_penalty - float(c[j] > 0) * presence_penalty,
    # c[j] the times token j was sampled so far (the output, not the prompt).
    logits = _logits(3)
    expected = logits.clone()
    for j in range(VOCAB):
        c = OUTPUT.count(j)
        expected[j] -= c * frequency + float(c > 0) * presence
    ours = process(logits.clone(), SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                                                  penalty_ids=tuple(PROMPT)), Counter(OUTPUT), len(OUTPUT))
    torch.testing.assert_close(ours, expected)


def test_logprobs_are_the_raw_log_softmax_before_every_processor():
    logits = _logits(4)
    params = SamplingParams(logprobs=5, repetition_penalty=1.8, presence_penalty=1.0, logit_bias=((11, 50.0),),
                            penalty_ids=tuple(PROMPT))
    sampler = SequenceSampler(params)
    token, lp = sampler.next(logits)
    raw = torch.log_softmax(logits, dim=-1)
    assert token == 11                       # the bias chose it ...
    assert lp.logprob == pytest.approx(float(raw[11]), abs=1e-6)   # ... its logprob is the raw model's
    top = torch.topk(raw, 5)
    assert list(lp.top_ids) == top.indices.tolist()
    assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=1e-6)


def test_prompt_logprobs_score_each_next_token():
    logits = torch.stack([_logits(s) for s in range(5)])
    following = torch.tensor([7, 1, 90, 33, 4])
    got = prompt_logprobs(logits, following, 2)
    raw = torch.log_softmax(logits, dim=-1)
    for row, (lp, t) in enumerate(zip(got, following.tolist())):
        assert lp == token_logprob(raw[row], t, 2)


def test_choices_draw_from_seed_plus_index():
    params = SamplingParams(temperature=1.0, seed=100, logprobs=0)
    rows = [_logits(s) for s in range(10)]
    for index in range(3):
        sampler = SequenceSampler(params, index)
        alone = make_draws(SamplingParams(temperature=1.0, seed=100 + index))
        assert [sampler.next(r)[0] for r in rows] == [sample(r, params, alone.at(p)) for p, r in enumerate(rows)]


class _OnlyEven:
    """A LogitsMask: only even ids are allowed; remembers what it was told."""

    def __init__(self) -> None:
        self.told: list[int] = []

    def apply(self, logits: torch.Tensor) -> None:
        logits[1::2] = -torch.inf

    def advance(self, token: int) -> None:
        self.told.append(token)


def test_a_mask_constrains_the_draw_but_not_the_logprobs():
    mask = _OnlyEven()
    sampler = SequenceSampler(SamplingParams(temperature=1.0, seed=5, logprobs=1), mask=mask)
    rows = [_logits(s) for s in range(20)]
    drawn = [sampler.next(r) for r in rows]
    assert all(t % 2 == 0 for t, _ in drawn) and mask.told == [t for t, _ in drawn]
    for (t, lp), r in zip(drawn, rows):
        raw = torch.log_softmax(r, dim=-1)
        assert lp.logprob == pytest.approx(float(raw[t]), abs=1e-6) and lp.top_ids == (int(raw.argmax()),)
