"""Conductor flags: durations, choices and bad values give clear errors."""

from __future__ import annotations

import pytest

from mooncake_lite.common.config import ConfigError, load_config
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.config import Config


def _load(*argv: str) -> Config:
    return load_config(Config, list(argv), prog="mooncake --role conductor", section="conductor", env={})


def test_flags_land_in_the_config():
    cfg = _load("--port", "0", "--strategy", "cache-aware", "--admission", "early", "--ttft-slo", "500ms",
                "--tbt-slo", "0.1", "--kvcache-balancing-threshold", "2", "--dead-after", "3s",
                "--api-key", "k", "--uniform-decode", "4s")
    assert (cfg.port, cfg.strategy, cfg.admission, cfg.ttft_slo, cfg.tbt_slo) == (0, "cache-aware", "early", 0.5, 0.1)
    assert (cfg.kvcache_balancing_threshold, cfg.dead_after, cfg.api_key, cfg.uniform_decode) == (2.0, 3.0, "k", 4.0)


def test_slos_are_relative_unless_given():
    cfg = _load()
    assert (cfg.admission, cfg.ttft_slo, cfg.tbt_slo, cfg.ttft_slo_factor, cfg.tbt_slo_factor) == \
        ("predictive", None, None, 10.0, 5.0)
    cfg = _load("--ttft-slo-factor", "20", "--tbt-slo-factor", "3", "--tbt-slo", "300ms")
    assert (cfg.ttft_slo, cfg.tbt_slo, cfg.ttft_slo_factor, cfg.tbt_slo_factor) == (None, 0.3, 20.0, 3.0)


def test_the_ttft_margin_reaches_the_scheduler_and_is_none_by_default():
    assert _load().scheduler_config().ttft_admit_margin == 0.0
    assert _load("--ttft-admit-margin", "0.1").scheduler_config().ttft_admit_margin == 0.1


@pytest.mark.parametrize("argv, needle", [
    (("--ttft-slo", "-1"), "--ttft-slo must be positive"),
    (("--tbt-slo-factor", "0.5"), "--tbt-slo-factor must be >= 1"),
    (("--ttft-slo-factor", "0"), "--ttft-slo-factor must be >= 1"),
    (("--tbt-slo", "soon"), "not a duration"),
    (("--kvcache-balancing-threshold", "0.5"), "ratio >= 1"),
    (("--dead-after", "0"), "--dead-after must be positive"),
    (("--port", "70000"), "--port must be in"),
    (("--ttft-admit-margin", "1"), "--ttft-admit-margin must be in"),
])
def test_bad_values_are_clear_errors(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        _load(*argv)


def test_unknown_model_is_refused_at_startup():
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        make_app(Config(model="nope"))
