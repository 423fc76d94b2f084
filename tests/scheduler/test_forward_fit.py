"""A prefill state's correction as a line, ``scale · (x + offset)`` (``scheduler/forward_fit.py``):
fitted where the forwards span enough, bounded in every step, shown as the model with ``c0``
raised, and the affine error it removes that one factor cannot."""

import math
import random
import statistics

import pytest

from mooncake_lite.scheduler import PrefillCostModel
from mooncake_lite.scheduler.correction import CorrectionConfig, Corrections
from mooncake_lite.scheduler.costs import scaled
from mooncake_lite.scheduler.costs import packed_seconds
from mooncake_lite.scheduler.forward_fit import ForwardLine, fit_line, moved_line

CFG = CorrectionConfig()


def test_the_fit_recovers_a_line_and_says_none_where_the_forwards_do_not_span():
    xs = [0.02, 0.05, 0.1, 0.3, 0.6, 1.2]
    scale, offset = fit_line([(x, 0.8 * (x + 0.07)) for x in xs])
    assert scale == pytest.approx(0.8) and offset == pytest.approx(0.07)
    assert fit_line([(x, 1.5 * x) for x in xs]) == pytest.approx((1.5, 0.0), abs=1e-12)
    scale, offset = fit_line([(x, 2.0 * x - 0.01) for x in xs[2:]])   # a negative fixed cost: none
    assert offset == 0.0 and 1.5 < scale < 2.0
    assert fit_line([(0.1, 0.2), (0.15, 0.3), (0.19, 0.35)]) is None   # under 2x apart: no telling
    assert fit_line([]) is None and fit_line([(0.0, 0.1), (1.0, 1.0)]) is None


def test_a_served_forward_with_a_fixed_cost_is_priced_right_short_and_long():
    """The shape live runs showed (issue #36): short forwards 1.6x their model, long ones 0.8x.
    A factor settles between and misses both; the line holds each within 10%."""
    rng = random.Random(3)
    # a window the fit never fills: the one factor the correction was before the line
    line, plain = Corrections(), Corrections(CorrectionConfig(line_window=10**6, line_min=10**6))
    truth = lambda x: 0.7 * (x + 0.12)               # 0.05 s priced: 1.9x; 2 s: 0.74x
    for _ in range(80):
        x = math.exp(rng.uniform(math.log(0.03), math.log(2.5)))
        y = truth(x) * rng.lognormvariate(0, 0.08)
        line.observe("p", "compute", x, y)
        plain.observe("p", "compute", x, y)
    s, a = line.prefill_scale("p", busy=False), line.prefill_offset("p", busy=False)
    for x in (0.05, 0.3, 2.0):
        assert s * (x + a) == pytest.approx(truth(x), rel=0.10)
    k = plain.prefill_scale("p", busy=False)
    assert max(abs(k * x / truth(x) - 1) for x in (0.05, 2.0)) > 0.3


def test_the_offset_moves_by_a_bounded_step_within_its_bounds_and_cannot_run_away():
    line, scale = ForwardLine(), None
    for i in range(500):      # an adversary: tiny forwards reported at the largest ratio allowed
        x = 0.01 if i % 2 else 0.05
        before = line.offset
        line, scale = moved_line(line, x, x * CFG.max_ratio, CFG.line_window, CFG.line_min, CFG.alpha)
        assert abs(line.offset - before) <= CFG.alpha * statistics.median(p for p, _ in line.pairs) + 1e-12
        assert line.offset >= 0.0
        if scale is not None:     # the fixed part within the fastest forward measured
            assert scale * line.offset <= min(m for _, m in line.pairs) * (1 + 1e-9)
    assert len(line.pairs) == CFG.line_window
    c = Corrections()
    for i in range(2000):
        c.observe("p", "compute", 0.01 if i % 2 else 0.05, 5.0)
    assert c.prefill_scale("p", busy=False) <= CFG.max_factor
    model = PrefillCostModel(0.01, 1e-4, 1e-8, 0.0)
    shown = scaled(model, c.prefill_scale("p", busy=False), c.prefill_offset("p", busy=False))
    assert shown.predict(64) <= 5.0 * 1.01 * CFG.max_factor      # bounded however it was fed
    for bad in (math.nan, -1.0, math.inf):
        before = c.get("p")
        assert c.observe("p", "compute", 0.05, bad) is not None and c.get("p") == before


def test_the_shown_model_pays_the_offset_once_per_forward_and_a_rebase_keeps_the_line():
    model = PrefillCostModel(0.02, 1e-3, 1e-7, 0.0)
    shown = scaled(model, 0.8, 0.05)
    for n in (16, 256, 512):
        assert shown.predict(n) == pytest.approx(0.8 * (model.predict(n) + 0.05))
    owns = [shown.predict(n) for n in (40, 60, 100)]     # a pack pays c0, and so the offset, once
    bare = packed_seconds([model.predict(n) for n in (40, 60, 100)], model.c0)
    assert packed_seconds(owns, shown.c0) == pytest.approx(0.8 * (bare + 0.05))
    assert scaled(model, 1.0, 0.0) is model
    c = Corrections()
    rng = random.Random(5)
    for _ in range(60):
        x = rng.uniform(0.02, 1.0)
        c.observe("p", "compute", x, 0.7 * (x + 0.1))
    before = c.prefill_scale("p", busy=False) * (0.5 + c.prefill_offset("p", busy=False))
    last = c.get("p").lines["compute"].pairs[-1]
    c.rebase("p", "compute", math.log(2.0))    # the instance's own model now says 2x by itself
    after = c.prefill_scale("p", busy=False) * (2 * 0.5 + c.prefill_offset("p", busy=False))
    assert after == pytest.approx(before, rel=1e-9)            # a forward's shown time unchanged
    assert c.get("p").lines["compute"].pairs[-1] == pytest.approx((2 * last[0], last[1]))


def test_each_state_is_its_own_line_and_the_busy_one_starts_from_the_idle_one():
    """Until observed, the busy state is priced on the idle line; its first observation moves it
    from that line (scale and offset), not from scratch; then it learns a line of its own, and
    the idle one stays where it was."""
    c = Corrections()
    for i in range(40):
        x = 0.03 + 0.05 * (i % 20)
        c.observe("p", "compute", x, 0.7 * (x + 0.06))
    scale, offset = c.prefill_scale("p", busy=False), c.prefill_offset("p", busy=False)
    assert offset > 0.03 and scale == pytest.approx(0.7, rel=0.15)
    assert (c.prefill_scale("p", busy=True), c.prefill_offset("p", busy=True)) == (scale, offset)   # borrowed
    c.observe("p", "interference", 0.5, scale * (0.5 + offset))   # its first, on the borrowed line
    assert c.prefill_scale("p", busy=True) == pytest.approx(scale, rel=1e-9)
    assert c.prefill_offset("p", busy=True) == pytest.approx(offset, rel=1e-9)
    for i in range(80):
        x = 0.03 + 0.05 * (i % 20)
        c.observe("p", "interference", x, 1.3 * (x + 0.15))
    busy = c.prefill_scale("p", busy=True), c.prefill_offset("p", busy=True)
    for x in (0.05, 0.3, 1.0):   # short and long forwards both within 5% of the busy line
        assert busy[0] * (x + busy[1]) == pytest.approx(1.3 * (x + 0.15), rel=0.05)
    assert (c.prefill_scale("p", busy=False), c.prefill_offset("p", busy=False)) == (scale, offset)


def test_a_chunked_prompt_pays_the_offset_once_as_it_was_fitted():
    """The line is fitted once a request (``x``: its forwards' seconds, chunks summed), so a long
    prompt run chunk by chunk pays the offset once, not once a chunk; and the model with it reads
    back the same from what ``sim export-costs`` writes."""
    model = PrefillCostModel(0.01, 1e-4, 1e-8, 2e-6).with_chunk(512)
    shown = scaled(model, 0.8, 0.1)
    for n, p in ((100, 0), (512, 0), (2000, 0), (5000, 1000), (9000, 0)):
        assert shown.predict(n, p) == pytest.approx(0.8 * (model.predict(n, p) + 0.1), rel=1e-9)
        assert scaled(shown, 1.1, 0.05).predict(n, p) == pytest.approx(1.1 * (shown.predict(n, p) + 0.05), rel=1e-9)
    assert "later_c0" not in model.to_dict()    # an uncorrected model's dict is what it always was
    back = PrefillCostModel.from_dict(shown.to_dict()).with_chunk(512)
    assert back.predict(9000) == pytest.approx(shown.predict(9000), rel=1e-12)
