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
