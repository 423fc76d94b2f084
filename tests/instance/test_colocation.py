"""The co-location split (issue #20 item 4): a decode's token gaps, from its step timeline, split
by whether a prefill on its host was computing through them, and each side's spread over the
decode's model (``instance/colocation.colocation_split``)."""

from __future__ import annotations

import pytest

from mooncake_lite.instance.colocation import (colocation_split, covered_share, merge_intervals, padded_step,
                                           step_gaps)
from mooncake_lite.scheduler import DecodeCostModel

MODEL = DecodeCostModel(c0=0.01, c1=0.0, c2=0.0)     # every step: 10 ms by the model


def timeline(busy=(0.5, 1.0), n=100, alone=0.01, beside=0.02, between=0.0):
    """Steps back to back (``between`` s of loop work after each): ``beside`` s each while a
    forward covers ``busy``, ``alone`` s otherwise."""
    steps, t = [], 0.0
    for i in range(n):
        dur = beside if busy[0] <= t + 1e-9 < busy[1] else alone
        steps.append((t, dur, 2, 40, int(i == 0)))
        t += dur + between
    return steps


def test_intervals_merge_and_cover():
    merged = merge_intervals([(3, 4), (0, 1), (0.5, 2), (5, 5)])
    assert merged == [(0, 2), (3, 4)]
    assert covered_share(1, 3, merged) == pytest.approx(0.5)
    assert covered_share(4, 5, merged) == 0.0 and covered_share(2, 2, merged) == 0.0


def test_gaps_run_end_to_end_and_skip_a_wait():
    steps = [(0.0, 0.1, 1, 10, 1, 10), (0.15, 0.1, 1, 11, 0, 11), (2.0, 0.1, 1, 12, 1, 12), (2.1, 0.2, 2, 30, 0, 20)]
    # step 1's tokens 0.15 s after step 0's (0.1 of step, 0.05 between); step 2 came after a wait
    assert step_gaps(steps) == [pytest.approx((0.1, 0.25, 1, 11, 0.1, 11)), pytest.approx((2.1, 2.3, 2, 30, 0.2, 20))]
    assert step_gaps([s[:5] for s in steps])[1][5] == 30      # a timeline without the longest: the sum


def test_steps_beside_a_forward_are_split_out_and_their_slowdown_measured():
    split = colocation_split(timeline(), [(0.5, 1.0)], MODEL)
    assert split["gaps_busy"] == 25 and split["gaps_idle"] == 74          # 99 gaps: the first step has none
    assert split["slowdown"] == pytest.approx(2.0, rel=0.02)
    assert split["idle_ratios"] == pytest.approx([1.0] * 10) and split["busy_ratios"] == pytest.approx([2.0] * 10)
    assert split["step_share"] == pytest.approx(1.0)


def test_work_between_steps_counts_in_the_gap_not_the_step():
    split = colocation_split(timeline(busy=(0, 0), between=0.005), [], MODEL)
    assert split["gaps_busy"] == 0 and split["slowdown"] is None          # no forward: no slowdown to tell
    assert split["idle_ratios"] == pytest.approx([1.5] * 10)               # (10 + 5) ms per 10 ms step
    assert split["step_share"] == pytest.approx(0.01 / 0.015)


def test_too_few_gaps_beside_a_forward_say_nothing():
    split = colocation_split(timeline(busy=(0.5, 0.6)), [(0.5, 0.6)], MODEL)
    assert 0 < split["gaps_busy"] < 20 and split["slowdown"] is None
    assert colocation_split(timeline()[:1], [], MODEL) is None              # one step: no gap


def test_the_padding_cost_is_measured_from_padded_batches():
    model = DecodeCostModel(c0=0.01, c1=0.001, c2=1e-5)
    assert padded_step(model, 1, 500, 500, 4e-6) == model.predict(1, 500)    # one sequence: no padding
    # three sequences run to the longest (2,000): 3,600 padding tokens at 4 us
    assert padded_step(model, 3, 2400, 2000, 4e-6) == pytest.approx(model.predict(3, 2400) + 3600 * 4e-6)
    steps, t = [], 0.0
    for i in range(40):
        batch, context, longest = (3, 2400, 2000) if i % 2 else (2, 800, 400)   # padding 3,600 and 0
        dur = padded_step(model, batch, context, longest, 4e-6)
        steps.append((t, dur, batch, context, int(i == 0), longest))
        t += dur
    split = colocation_split(steps, [], model, padded=True)
    assert split["padding_s_per_token"] == pytest.approx(4e-6)
    assert split["idle_ratios"] == pytest.approx([1.0] * 10)               # over the padded step
    assert colocation_split(steps, [], model)["padding_s_per_token"] == 0.0  # a decode that does not pad
    assert colocation_split(steps, [], model)["idle_ratios"][-1] > 1.3


def test_the_slowdown_compares_like_shapes():
    """While a prefill runs the batch is larger; a model that underestimates large batches must
    not pass for co-location: busy and idle gaps are compared shape by shape."""
    steps, t = [], 0.0
    for i in range(120):
        busy = 0.5 <= t < 1.5
        batch = 8 if (busy or i % 2) else 1             # large batches both ways, more of them while busy
        dur = MODEL.predict(batch, 40) * (2.0 if batch == 8 else 1.0)   # the model gets batch 8 wrong
        steps.append((t, dur, batch, 40, int(i == 0), 20))
        t += dur
    split = colocation_split(steps, [(0.5, 1.5)], MODEL)
    assert split["gap_mean_busy_s"] > 1.3 * split["gap_mean_idle_s"]     # the plain means would say 2x
    assert split["slowdown"] == pytest.approx(1.0)


def test_padding_and_co_location_are_told_apart():
    """Padded batches run mostly beside a prefill (the long prompt arrives with one): the
    slowdown comes from unpadded gaps, and the padding is fitted with it divided out."""
    model = DecodeCostModel(c0=0.01, c1=0.001, c2=1e-6)
    steps, t = [], 0.0
    for i in range(160):
        beside = 1.0 <= t < 3.0
        batch, context, longest = (3, 2400, 2000) if i % 2 else (1, 300, 300)
        dur = padded_step(model, batch, context, longest, 4e-6) * (2.0 if beside else 1.0)
        steps.append((t, dur, batch, context, int(i == 0), longest))
        t += dur
    split = colocation_split(steps, [(1.0, 3.0)], model, padded=True)
    assert split["slowdown"] == pytest.approx(2.0, rel=0.05)
    assert split["padding_s_per_token"] == pytest.approx(4e-6, rel=0.05)
    assert split["idle_ratios"] == pytest.approx([1.0] * 10, rel=0.05)


def test_kv_writes_come_out_of_the_gaps_of_the_forward_that_streamed_them():
    """A prompt's KV frames come as its prefill computes each layer and are written between the
    decode's steps as they come: a join's write seconds are spread over the forward whose end it
    follows, so once they are taken out the gaps beside it are at the pure co-location slowdown
    (1.5), and the gaps where the joins fall, after the forward, keep their own time."""
    from mooncake_lite.instance.colocation import kv_write_cost
    steps, forwards, t = [], [], 0.0
    for i in range(400):                                 # 50 steps alone, then 30 beside a forward
        beside = i % 80 >= 50
        if i % 80 == 50:
            start = t
        dur = 0.015 / 0.9 if beside else 0.01            # 1.5x the model, stretched by the writes' 10%
        steps.append((t, dur, 2, 40, int(i == 0)))
        t += dur
        if i % 80 == 79:
            forwards.append((start, t))
    joins = [(b + 0.001, 500, 0.05) for _, b in forwards]   # 50 ms of writes over each 0.5 s forward
    assert colocation_split(steps, forwards, MODEL)["slowdown"] == pytest.approx(1.5 / 0.9)
    split = colocation_split(steps, forwards, MODEL, intake=joins)
    assert kv_write_cost(joins) == pytest.approx(1e-4) and kv_write_cost(joins[:4]) is None
    assert split["kv_write_s_per_token"] == pytest.approx(1e-4)
    # (the join 1 ms after the forward: its writes spread over 0.501 s, 0.2% of them after it)
    assert split["slowdown"] == pytest.approx(1.5, rel=1e-3)
    assert split["busy_ratios"] == pytest.approx([1.5] * 10, rel=1e-3)
    assert split["idle_ratios"] == pytest.approx([1.0] * 10)
