"""Seeded sampling: the draw at output position p depends only on (seed + choice, p), so a run
that starts drawing at position k (the decode after the prefill's token 1, a continued request)
draws what an uninterrupted one does there; and every value the API accepts samples a token."""

from collections import Counter

import pytest
import torch

from mooncake_lite.model.sampling import SamplingParams, SequenceSampler, draw_seed, make_draws, sample

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_sampler_resumed_at_k_draws_what_an_uninterrupted_one_does(device, top_p):
    params = SamplingParams(temperature=0.8, top_p=top_p, seed=1234, max_tokens=40)
    logits = torch.randn(30, 257, generator=torch.Generator().manual_seed(0)).to(device)
    whole = SequenceSampler(params, 2, device)
    drawn = [whole.next(row)[0] for row in logits]
    for k in (1, 7):
        resumed = SequenceSampler(params, 2, device)
        resumed.resume(drawn[:k])                         # the prefill's token 1, or a continuation's k
        assert [resumed.next(row)[0] for row in logits[k:]] == drawn[k:]


def test_draws_differ_across_positions_choices_and_seeds():
    # The check above could pass by accident if every position drew alike.
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=64)
    flat = torch.zeros(257)
    drawn = [SequenceSampler(params, 0).next(flat)[0] for _ in range(3)]
    assert len(set(drawn)) == 1                            # position 0, three times: one token
    one = SequenceSampler(params, 0)
    assert len({one.next(flat)[0] for _ in range(40)}) > 20   # 40 positions of a flat row: many tokens
    seeds = {draw_seed(s, p) for s in (-1, 0, 1, 2, 2**64 - 1) for p in range(50)}
    assert len(seeds) == 4 * 50                            # -1 and 2**64 - 1 are one 64-bit stream


def test_resume_counts_the_tokens_as_output():
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, min_tokens=5, stop_token_ids=(3,))
    sampler = SequenceSampler(params)
    sampler.resume([9, 9, 4])
    assert sampler.counts == Counter({9: 2, 4: 1}) and sampler.num_generated == 3
    row = torch.zeros(257)
    row[3] = 100.0                                          # the stop id, masked while fewer than 5
    row[9] = 2.5                                            # 2.5 - (2 * 0.5 + 1.0) = 0.5
    row[8] = 1.0
    assert sampler.next(row)[0] == 8


def test_a_draw_reseeds_its_generator_from_stream_and_position():
    draws = make_draws(SamplingParams(temperature=1.0, seed=3))
    assert draws is not None and draws.at(5).initial_seed() == draw_seed(3, 5)


# Issue #15, finding 3: every value the API accepts samples a valid token (no inf/nan).
TINY = [1e-300, 5e-324, 1e-45, 1e-8]


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, top_p=1.0, seed=3)
    assert params.is_greedy and make_draws(params) is None
    logits = torch.randn(20, 257, generator=torch.Generator().manual_seed(1)) * 30
    assert [sample(row, params) for row in logits] == [int(torch.argmax(row)) for row in logits]


@pytest.mark.parametrize("temperature", [1e-5, 1e-4, 0.01])
def test_small_temperature_above_the_cutoff_samples_the_top_token(temperature):
    params = SamplingParams(temperature=temperature, top_p=1.0, seed=3)
    logits = torch.randn(20, 257, generator=torch.Generator().manual_seed(1)) * 1e4   # huge logits too
    draws = make_draws(params)
    assert draws is not None
    assert [sample(row, params, draws.at(p)) for p, row in enumerate(logits)] == [int(torch.argmax(row)) for row in logits]


@pytest.mark.parametrize("top_p", TINY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tiny_top_p_keeps_the_top_token(top_p, dtype):
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
    logits = (torch.randn(20, 257, generator=torch.Generator().manual_seed(2)) * 5).to(dtype)
    draws = make_draws(params)
    assert [sample(row, params, draws.at(p)) for p, row in enumerate(logits)] == [int(torch.argmax(row.float())) for row in logits]


@pytest.mark.parametrize("temperature, top_p", [(2.0, 1.0), (2.0, 1e-300), (1e-5, 0.5), (0.7, 0.999999999)])
def test_extreme_logits_still_give_a_token(temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=5)
    gen = make_draws(params).at(0)
    for row in (torch.full((257,), -1e30), torch.tensor([3e38] * 3 + [-3e38] * 254),
                torch.tensor([float("-inf")] * 256 + [0.0])):
        token = sample(row, params, gen)
        assert 0 <= token < 257 and torch.isfinite(row[token]) and row[token] == row.max()
