"""A decode step's measured spread around its model (issue #20 item 4, fidelity): measured by the
refiner, exported by the conductor, replayed by the simulator — and nothing changes without it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mooncake_lite.common.protocol import InstanceLoad
from mooncake_lite.conductor.cluster.cost_export import _step_ratios
from mooncake_lite.instance.refine import RATIO_QUANTILES, STEP_RATIO_KEYS, DecodeRefiner
from mooncake_lite.scheduler import DecodeCostModel, SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import load_profile
from tests.sim.helpers import req, toy_hardware

SPIKY = (0.9,) * 8 + (1.0, 3.0)     # one step in ten three times as slow


def run(hw, trace, **sched):
    cfg = SimConfig(num_prefill=1, num_decode=1, seed=0, store_blocks_per_node=100,
                    scheduler=SchedulerConfig(**{"admission": "none", "ttft_slo_s": 100.0, "tbt_slo_s": 10.0,
                                                 **sched}))
    return MooncakeSim(cfg, hardware=hw).run(trace).requests


def burst(n=12):
    return [req(i, 0.05 * i, 600 + 37 * i, 40 + 3 * i) for i in range(n)]


def outcome(results):
    return [(r.status, r.prefill_id, r.decode_id, r.ttft, r.tbt, r.mean_gap, r.finish) for r in results]


def test_no_spread_or_a_flat_one_changes_nothing():
    hw = toy_hardware(step_s=0.02)
    plain = outcome(run(hw, burst()))
    assert outcome(run(dataclasses.replace(hw, decode_step_ratios=(1.0,) * 10), burst())) == plain


def test_a_spiky_spread_raises_tbt_keeps_the_mean_gap_and_repeats():
    hw = toy_hardware(step_s=0.02)
    plain = run(hw, burst())
    spiky_hw = dataclasses.replace(hw, decode_step_ratios=SPIKY)
    spiky, again = run(spiky_hw, burst()), run(spiky_hw, burst())
    assert outcome(spiky) == outcome(again)                     # seeded: a run repeats
    scale = float(np.mean(SPIKY))
    for p, s in zip(plain, spiky):
        assert s.tbt > p.tbt * scale * 1.5                      # the slowest 10% carry the spikes
        # the step's time is the model's × the spread's mean, and the replayed gaps keep it
        assert s.mean_gap == pytest.approx(p.mean_gap * scale, rel=0.25)
    assert np.mean([s.mean_gap for s in spiky]) == pytest.approx(np.mean([p.mean_gap for p in plain]) * scale,
                                                                rel=0.05)


def test_refiner_reports_the_spread_of_steps_around_its_model():
    model = DecodeCostModel(c0=0.01, c1=0.001, c2=0.0)
    r = DecodeRefiner(model, window=64, tolerance=10.0)          # the model stays the one reported
    assert r.ratio_quantiles() is None
    rng = np.random.default_rng(0)
    ratios = rng.choice([1.0, 1.0, 1.0, 1.0, 2.0], size=60)
    for i, k in enumerate(ratios):
        b = 1 + i % 4
        r.observe(b, 10 * b, model.predict(b, 10 * b) * k)
    q = r.ratio_quantiles()
    assert len(q) == len(RATIO_QUANTILES) == len(STEP_RATIO_KEYS)
    assert q == sorted(q) and q[0] == pytest.approx(1.0) and q[-1] == pytest.approx(2.0)
    assert np.mean(q) == pytest.approx(np.mean(ratios), abs=0.1)


def test_the_export_and_the_profile_carry_the_spread(tmp_path):
    class Inst:
        load = InstanceLoad(**dict(zip(reversed(STEP_RATIO_KEYS), reversed(SPIKY))), num_running=3.0)
    assert _step_ratios(Inst) == list(SPIKY)                   # in quantile order, other keys left out
    path = tmp_path / "p.json"
    path.write_text('{"prefill": {"c1": 0.001}, "decode_step_ratios": [0.9, 1.0, 3.0]}')
    assert load_profile(path).decode_step_ratios == (0.9, 1.0, 3.0)
    assert load_profile(path).to_dict()["decode_step_ratios"] == [0.9, 1.0, 3.0]
    path.write_text('{"prefill": {"c1": 0.001}, "decode_busy_step_ratios": [0.9, 1.0, 3.0]}')
    assert load_profile(path).to_dict()["decode_busy_step_ratios"] == [0.9, 1.0, 3.0]
    assert "decode_busy_step_ratios" not in toy_hardware().to_dict()
    for key in ("decode_step_ratios", "decode_busy_step_ratios"):
        path.write_text(f'{{"prefill": {{"c1": 0.001}}, "{key}": [1.0, 0.5]}}')
        with pytest.raises(ValueError, match=f"{key} must be .* ascending"):
            load_profile(path)


def test_each_step_counts_once_not_each_shape():
    model = DecodeCostModel(c0=0.01, c1=0.001, c2=0.0)
    r = DecodeRefiner(model, tolerance=10.0)
    for _ in range(200):                          # the common shape, on time
        r.observe(1, 10, model.predict(1, 10))
    for _ in range(20):                           # a rare one, twice as slow: 9% of the steps
        r.observe(8, 80, 2 * model.predict(8, 80))
    q = r.ratio_quantiles()
    assert q[-2] == pytest.approx(1.0) and q[-1] == pytest.approx(2.0)   # by bucket it would be 38%
