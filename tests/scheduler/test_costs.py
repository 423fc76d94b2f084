import math
import random

import pytest

from mooncake_lite.scheduler import (CostModels, DecodeCostModel, PrefillCostModel,
                                     kv_bytes_per_token, kv_transfer_time)


def test_prefill_fit_recovers_known_coefficients_from_noisy_samples():
    truth = PrefillCostModel(c0=0.02, c1=1.5e-4, c2=2.0e-9, c3=3.0e-6)
    rng = random.Random(1)
    samples = []
    for _ in range(400):
        num_tokens = rng.randint(64, 16384)
        prefix = rng.randint(0, num_tokens - 1)
        samples.append((num_tokens, prefix, truth.predict(num_tokens, prefix) * rng.uniform(0.99, 1.01)))
    fitted = PrefillCostModel.fit(samples)
    for name in ("c0", "c1", "c2", "c3"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    # what the scheduler cares about: predictions across the range
    for n, p in ((512, 0), (8192, 4096), (16000, 15000)):
        assert fitted.predict(n, p) == pytest.approx(truth.predict(n, p), rel=0.02)


def test_prefill_quadratic_term_makes_reuse_pay_more_for_long_prompts():
    m = PrefillCostModel(c0=0.0, c1=1e-4, c2=1e-8)
    saved_short = m.predict(1024, 0) - m.predict(1024, 512)
    saved_long = m.predict(16384, 0) - m.predict(16384, 15872)
    assert saved_long > 20 * saved_short


def test_full_prefix_hit_still_computes_the_last_token():
    m = PrefillCostModel(c0=0.0, c1=1.0)
    assert m.predict(100, 100) == m.predict(100, 99) == 1.0
    assert m.predict(100, 500) == 1.0


def test_decode_fit_recovers_known_coefficients():
    truth = DecodeCostModel(c0=0.015, c1=4e-4, c2=3e-7)
    samples = [(b, ctx, truth.predict(b, ctx)) for b in (1, 2, 4, 8, 16, 32, 64)
               for ctx in (b * 500, b * 4000, b * 12000)]
    fitted = DecodeCostModel.fit(samples)
    for name in ("c0", "c1", "c2"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert fitted.predict(0, 0) == 0.0  # an idle instance takes no steps


def test_fit_needs_enough_samples():
    with pytest.raises(ValueError, match="need at least 4 samples"):
        PrefillCostModel.fit([(10, 0, 1.0)])
    with pytest.raises(ValueError, match="need at least 3 samples"):
        DecodeCostModel.fit([])


def test_dict_round_trip_and_validation():
    m = PrefillCostModel(0.1, 2e-4, 3e-9, 0.0)
    assert PrefillCostModel.from_dict(m.to_dict()) == m
    d = DecodeCostModel(0.02, 1e-3, 1e-7)
    assert DecodeCostModel.from_dict(d.to_dict()) == d
    assert PrefillCostModel.from_dict({"c1": 1}) == PrefillCostModel(c1=1.0)
    with pytest.raises(ValueError, match="unknown coefficient"):
        PrefillCostModel.from_dict({"c9": 1.0})
    for bad in (math.nan, math.inf, "1", True, None):
        with pytest.raises(ValueError, match="finite number"):
            DecodeCostModel.from_dict({"c0": bad})


def test_kv_bytes_per_token_llama2_70b():
    assert kv_bytes_per_token(80, 8, 128, 2) == 327_680
    assert kv_bytes_per_token(80, 8, 128, 2) * 512 == 160 * 2**20
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_bytes_per_token(80, 0, 128, 2)


def test_transfer_time():
    assert kv_transfer_time(0, 1.0) == 0.0
    assert kv_transfer_time(10e9, 5e9) == pytest.approx(2.0)
    assert kv_transfer_time(10e9, 5e9, latency_s=0.001) == pytest.approx(2.001)
    with pytest.raises(ValueError, match="bandwidth"):
        kv_transfer_time(1, 0.0)


def test_cost_models_validate():
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        CostModels(PrefillCostModel(), DecodeCostModel(), kv_bytes_per_token=0)
