"""Output-length prediction: deepest shared prefix first, then recent history of similar prompts,
never above max_tokens; memory bounded."""

from __future__ import annotations

import pytest

from mooncake_lite.scheduler.predict import OutputPredictor, PredictorConfig, length_bucket


def test_before_anything_finished_it_guesses_the_default_within_max_tokens():
    p = OutputPredictor(PredictorConfig(default_tokens=256))
    assert p.predict((1, 2), 1000, 4096) == 256
    assert p.predict((1, 2), 1000, 100) == 100
    assert p.predict((), 10, 1) == 1


def test_a_later_turn_of_a_conversation_reads_the_earlier_turns_output():
    p = OutputPredictor()
    p.observe((0, 1, 2), 1500, 40)          # turn 1 of conversation A
    p.observe((0, 7, 8), 1500, 900)         # another conversation, same system prompt (key 0)
    # turn 2 of A resends turn 1's prompt (keys 0, 1, 2) and more: the deepest known key is 2
    assert p.predict((0, 1, 2, 3, 4), 2500, 4096) == 40
    # a new conversation of the same application: only key 0 is shared, seen by both
    assert p.predict((0, 5), 1000, 4096) == (40 + 900) / 2
    assert p.predict((0, 5), 1000, 300) == 300


def test_an_unshared_prompt_gets_the_median_of_recent_similar_prompt_lengths():
    p = OutputPredictor(PredictorConfig(history=3))
    for out in (10, 20, 1000):                       # long prompts
        p.observe((), 20_000, out)
    for out in (300, 400, 500, 600):                 # short prompts; history keeps the last 3
        p.observe((), 600, out)
    assert length_bucket(20_000) != length_bucket(600) == length_bucket(1000)
    assert p.predict((), 30_000, 4096) == 20         # median of 10, 20, 1000
    assert p.predict((), 1000, 4096) == 500          # median of 400, 500, 600
    assert p.predict((), 3, 4096) == 500             # a bucket never seen: all recent outputs


def test_prior_weight_shrinks_a_rarely_seen_prefix_towards_recent_history():
    p = OutputPredictor(PredictorConfig(prior_weight=1.0))
    p.observe((9,), 600, 100)
    p.observe((), 600, 500)
    p.observe((), 600, 500)
    assert p.predict((9,), 600, 4096) == (100 + 500) / 2


def test_memory_is_bounded_oldest_prefix_first():
    p = OutputPredictor(PredictorConfig(max_prefixes=3, default_tokens=7))
    p.observe((1, 2), 100, 50)
    p.observe((3, 4), 100, 60)
    assert len(p._prefix) == 3 and 1 not in p._prefix
    assert p.predict((2,), 100, 4096) == 50 and p.predict((1,), 100, 4096) != 50


@pytest.mark.parametrize("bad", [dict(history=0), dict(max_prefixes=0), dict(prior_weight=-1),
                                 dict(default_tokens=0)])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        PredictorConfig(**bad)
