"""Seeded sampling: a generator advanced by skip_draw continues exactly where one that drew a
token left off (what lets decode continue a request whose first token prefill sampled)."""

import pytest
import torch

from mooncake_lite.model.sampling import SamplingParams, make_generator, sample, skip_draw

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_skip_draw_advances_like_one_sample(device, top_p):
    params = SamplingParams(temperature=0.8, top_p=top_p, seed=1234, max_tokens=8)
    logits = torch.randn(5, 257, generator=torch.Generator().manual_seed(0)).to(device)
    drew = make_generator(params, device)
    sample(logits[0], params, drew)                       # prefill's first token
    skipped = make_generator(params, device)
    skip_draw(skipped, logits.shape[1])                    # decode, which never saw those logits
    assert [sample(row, params, drew) for row in logits[1:]] == [sample(row, params, skipped) for row in logits[1:]]


def test_without_the_skip_the_tokens_differ():
    # The check above could pass by accident if a draw did not move the generator at all.
    params = SamplingParams(temperature=1.0, top_p=1.0, seed=7, max_tokens=8)
    logits = torch.zeros(40, 257)
    drew, fresh = make_generator(params), make_generator(params)
    sample(logits[0], params, drew)
    assert [sample(r, params, drew) for r in logits[1:]] != [sample(r, params, fresh) for r in logits[1:]]


# Issue #15, finding 3: every value the API accepts samples a valid token (no inf/nan).
TINY = [1e-300, 5e-324, 1e-45, 1e-8]


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, top_p=1.0, seed=3)
    assert params.is_greedy and make_generator(params) is None
    logits = torch.randn(20, 257, generator=torch.Generator().manual_seed(1)) * 30
    assert [sample(row, params) for row in logits] == [int(torch.argmax(row)) for row in logits]


@pytest.mark.parametrize("temperature", [1e-5, 1e-4, 0.01])
def test_small_temperature_above_the_cutoff_samples_the_top_token(temperature):
    params = SamplingParams(temperature=temperature, top_p=1.0, seed=3)
    logits = torch.randn(20, 257, generator=torch.Generator().manual_seed(1)) * 1e4   # huge logits too
    gen = make_generator(params)
    assert gen is not None
    assert [sample(row, params, gen) for row in logits] == [int(torch.argmax(row)) for row in logits]


@pytest.mark.parametrize("top_p", TINY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tiny_top_p_keeps_the_top_token(top_p, dtype):
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
    logits = (torch.randn(20, 257, generator=torch.Generator().manual_seed(2)) * 5).to(dtype)
    gen = make_generator(params)
    assert [sample(row, params, gen) for row in logits] == [int(torch.argmax(row.float())) for row in logits]


@pytest.mark.parametrize("temperature, top_p", [(2.0, 1.0), (2.0, 1e-300), (1e-5, 0.5), (0.7, 0.999999999)])
def test_extreme_logits_still_give_a_token(temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=5)
    gen = make_generator(params)
    for row in (torch.full((257,), -1e30), torch.tensor([3e38] * 3 + [-3e38] * 254),
                torch.tensor([float("-inf")] * 256 + [0.0])):
        token = sample(row, params, gen)
        assert 0 <= token < 257 and torch.isfinite(row[token]) and row[token] == row.max()
