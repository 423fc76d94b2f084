from mooncake_lite.bench.replay.client import HIT_METRICS, cache_hit_rate, parse_prometheus

TEXT = """# HELP mooncake_conductor_reused_prefix_blocks_total prompt blocks scheduled as prefix hits
# TYPE mooncake_conductor_reused_prefix_blocks_total counter
mooncake_conductor_reused_prefix_blocks_total 30.0
mooncake_conductor_prompt_blocks_total 120.0
mooncake_conductor_rejections_total{cause="ttft"} 2.0
mooncake_conductor_rejections_total{cause="tbt"} 3.0
mooncake_conductor_ttft_seconds_bucket{le="+Inf"} 7.0
garbage line
"""


def test_parse_prometheus_sums_labelled_samples():
    m = parse_prometheus(TEXT)
    assert m["mooncake_conductor_reused_prefix_blocks_total"] == 30.0
    assert m["mooncake_conductor_rejections_total"] == 5.0
    assert m["mooncake_conductor_ttft_seconds_bucket"] == 7.0 and "garbage" not in m


def test_cache_hit_rate_is_a_delta_over_the_run():
    before = {HIT_METRICS[0]: 10.0, HIT_METRICS[1]: 40.0}
    assert cache_hit_rate(before, parse_prometheus(TEXT)) == (0.25, None)     # 20 / 80
    value, why = cache_hit_rate(parse_prometheus(TEXT), parse_prometheus(TEXT))
    assert value is None and "no full prompt block" in why
    value, why = cache_hit_rate({}, {"other_total": 1.0})
    assert value is None and "has no" in why


def test_a_predicted_time_header_is_read_only_when_it_is_a_finite_number():
    from mooncake_lite.bench.replay.client import _seconds
    assert _seconds("0.125000") == 0.125 and _seconds(None) is None
    for bad in ("", "fast", "nan", "inf", "-1"):
        assert _seconds(bad) is None
