"""Admission judged by its outcomes (``bench/fidelity/admission.py``, issue #36 item 3) on a small
synthetic slice: the Wilson interval, the live share of admitted requests that met their SLO, and
the simulator's counterfactual for each refused one — computed, not assumed: a refused request
that the idle cluster serves well within its SLO counts as one that would have met it, one behind
a queue long enough does not."""

from __future__ import annotations

import math

import orjson
import pytest

from mooncake_lite.bench.fidelity import admission
from mooncake_lite.bench.fidelity.admission import Outcome
from mooncake_lite.bench.fidelity.report import admission_lines
from mooncake_lite.sim.costs import load_profile
from mooncake_lite.trace.format import TraceRequest
from tests.sim.test_fidelity_bench import PROFILE


def test_wilson_interval():
    lo, hi = admission.wilson(19, 20)
    assert lo == pytest.approx(0.7639, abs=1e-3) and hi == pytest.approx(0.9911, abs=1e-3)
    assert admission.wilson(0, 10)[0] == 0.0 and admission.wilson(10, 10)[1] == pytest.approx(1.0)
    assert admission.wilson(0, 0) is None


@pytest.fixture
def hw(tmp_path):
    (tmp_path / "costs.json").write_bytes(orjson.dumps(PROFILE))
    return load_profile(tmp_path / "costs.json")


def _slice():
    """Eight 4,096-token prompts at once (a burst: each prefill ~1 s on PROFILE), then two alone
    much later; nothing shares a prefix."""
    burst = [TraceRequest(i, 0.0, 4096, 8, tuple(range(1000 * i, 1000 * i + 256))) for i in range(8)]
    late = [TraceRequest(8 + i, 60_000.0 + 30_000.0 * i, 4096, 8, tuple(range(20_000 + 1000 * i, 20_256 + 1000 * i)))
            for i in range(2)]
    return burst + late


def test_the_counterfactual_is_simulated_per_refused_request(hw):
    trace = _slice()
    alone = hw.prefill.predict(4096)
    limits = admission.slo_limits(hw, (3.5 * alone, 1.0), (10.0, 5.0))
    sim = admission.admitting_all(hw, prefill=1, decode=1, block=16)
    # live: the first three of the burst admitted (two met, one late), the rest refused; 8 admitted,
    # 9 refused although it came alone
    live = {0: Outcome("ok", 1.1 * alone, 0.05), 1: Outcome("ok", 2.2 * alone, 0.05),
            2: Outcome("ok", 5.0 * alone, 0.05), 8: Outcome("ok", 1.2 * alone, 0.05),
            **{i: Outcome("rejected") for i in (3, 4, 5, 6, 7, 9)}}
    out = admission.judge(trace, live, limits, sim)
    assert (out["admitted_met"]["met"], out["admitted_met"]["of"]) == (3, 4)
    assert out["admitted_missed_by"] == {"ttft": 1, "tbt": 0}      # 2: 5x alone against 3.5x
    # 9 arrives to an idle cluster: it would have met its SLO. 3 would be 4th in the burst's queue
    # (~4 prefills: over 3.5); 4..7 later still
    assert out["refused_would_meet_ids"] == [9]
    r = out["refused_would_meet"]
    assert (r["met"], r["of"]) == (1, 6) and r["share"] == pytest.approx(1 / 6)
    assert r["goal_met"] is False and r["ci95"] == pytest.approx(admission.wilson(1, 6))
    assert out["admitted_met"]["goal_met"] is False           # 75% < 95%
    # the simulator's own view of the admitted four (the counterfactual's bias in this run)
    assert out["sim_admitted_met"]["of"] == 4
    text = "\n".join(admission_lines({**out, "slos": "absolute"}))
    assert "1/6 = 16.7%" in text and "3/4 = 75.0%" in text


def test_a_looser_slo_flips_the_counterfactual(hw):
    """The same refusals judged against a limit the whole burst fits in: every one would have met it."""
    trace = _slice()
    limits = admission.slo_limits(hw, (100.0, 1.0), (10.0, 5.0))
    live = {i: Outcome("rejected") for i in range(10)}
    out = admission.judge(trace, live, limits, admission.admitting_all(hw, prefill=1, decode=1, block=16))
    assert out["refused_would_meet"]["share"] == 1.0 and out["admitted_met"]["of"] == 0


def test_a_refusal_is_judged_by_the_slo_it_was_refused_by(hw):
    """The conductor states the limits it applied (``X-Mooncake-SLO-*``): a refusal whose stated
    limit is tight would not have met it, though the model's own limit (loose here) says it would;
    a request that stated none falls back to the model's, each metric apart."""
    from types import SimpleNamespace
    trace = _slice()
    loose = admission.slo_limits(hw, (100.0, 1.0), (10.0, 5.0))
    records = [SimpleNamespace(request_id=i, slo_s=(1e-6, None)) for i in range(5)]
    limits = admission.applied(records, loose)
    assert limits(trace[0]) == (1e-6, 1.0) and limits(trace[7]) == loose(trace[7]) == (100.0, 1.0)
    live = {i: Outcome("rejected") for i in range(10)}
    out = admission.judge(trace, live, limits, admission.admitting_all(hw, prefill=1, decode=1, block=16))
    assert out["refused_would_meet"]["met"] == 5 and out["refused_would_meet_ids"] == list(range(5, 10))


def test_a_refusal_that_would_have_met_only_within_the_simulators_bias_is_counted_apart():
    """The counterfactual runs these prompts at half their live TTFT (the admitted ones' sim / live,
    prompts within 2x the refused one's): by 1.0 s against a 1.5 s limit it would have met; over
    that bias (2.0 s) it would not. A size class of fewer than 5 admitted shows no bias."""
    trace = [TraceRequest(i, float(i), 100 + i, 4, ()) for i in range(8)]
    live = {**{i: Outcome("ok", 2.0, 0.01) for i in range(7)}, 7: Outcome("rejected")}
    sim = lambda requests: {t.request_id: Outcome("ok", 1.0, 0.01) for t in requests}   # noqa: E731
    out = admission.judge(trace, live, lambda t: (1.5, 1.0), sim)
    assert out["refused_would_meet_ids"] == [7] and out["refused_ttft_bias"] == [0.5]
    assert out["refused_would_meet_bias_adjusted"]["met"] == 0
    assert admission.size_bias(TraceRequest(9, 0.0, 1000, 4, ()), trace[:7], live, sim(trace)) is None
    text = "\n".join(admission_lines({**out, "slos": "absolute"}))
    assert "1/1 = 100.0%" in text and "0/1 = 0.0%" in text


def test_the_slices_end_is_not_the_future_a_request_is_judged_by(hw):
    """With the last arrival given, a request whose TTFT limit runs past it is left out of both
    shares (the refused 9, alone at the end, would have met only because nothing came after it),
    while every admitted request, judged or not, stays traffic in the counterfactuals."""
    trace = _slice()
    alone = hw.prefill.predict(4096)
    limits = admission.slo_limits(hw, (3.5 * alone, 1.0), (10.0, 5.0))
    live = {0: Outcome("ok", 1.1 * alone, 0.05), 1: Outcome("ok", 2.2 * alone, 0.05),
            2: Outcome("ok", 5.0 * alone, 0.05), 8: Outcome("ok", 1.2 * alone, 0.05),
            **{i: Outcome("rejected") for i in (3, 4, 5, 6, 7, 9)}}
    given: list[list[int]] = []
    sim = admission.admitting_all(hw, prefill=1, decode=1, block=16)

    def recording(requests):
        given.append([t.request_id for t in requests])
        return sim(requests)
    end_s = trace[-1].timestamp_ms / 1e3
    out = admission.judge(trace, live, limits, recording, end_s=end_s)
    assert out["judged"] == {"of": 10, "judged": 9, "end_s": end_s}
    assert (out["refused_would_meet"]["met"], out["refused_would_meet"]["of"]) == (0, 5)   # 9 left out
    assert (out["admitted_met"]["met"], out["admitted_met"]["of"]) == (3, 4)
    assert all(8 in ids for ids in given)        # the admitted traffic, in the baseline and each counterfactual
    text = "\n".join(admission_lines({**out, "slos": "absolute"}))
    assert "judged: 9 of 10 requests" in text and "0/5 = 0.0%" in text
    # a limit that is no number leaves nothing out
    assert admission.judged(trace, lambda t: (math.inf, 1.0), end_s) == set(range(10))
