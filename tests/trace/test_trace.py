"""Trace reading, stats on a hand-written trace, synthesis and the CLI."""

from __future__ import annotations

import pytest

from mooncake_lite.trace import TraceError, read_trace, scale_time, write_trace
from mooncake_lite.trace.format import spread_arrivals
from mooncake_lite.trace.cli import main
from mooncake_lite.trace.stats import compute_stats
from mooncake_lite.trace.synth import SynthConfig, synthesize

# Four requests, block size 512. Blocks: r0 [0,1]; r1 [0,1,2] reuses 2; r2 [3] new; r3 [0,4] reuses 1.
HAND = b"""{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}
{"timestamp": 2000, "input_length": 1500, "output_length": 30, "hash_ids": [0, 1, 2]}

{"timestamp": 1000, "input_length": 100, "output_length": 20, "hash_ids": [3]}
{"timestamp": 4000, "input_length": 600, "output_length": 40, "hash_ids": [0, 4]}
"""


@pytest.fixture
def hand(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_bytes(HAND)
    return path


def test_read_sorts_by_time_and_skips_blank_lines(hand):
    reqs = read_trace(hand)
    assert [r.input_length for r in reqs] == [1000, 100, 1500, 600]
    assert [r.request_id for r in reqs] == [0, 1, 2, 3]
    assert reqs[2].hash_ids == (0, 1, 2) and reqs[2].arrival_s == 2.0


def test_speed_divides_timestamps(hand):
    assert [r.timestamp_ms for r in read_trace(hand, speed=2)] == [0, 500, 1000, 2000]
    assert [r.timestamp_ms for r in scale_time(read_trace(hand), 4)] == [0, 250, 500, 1000]
    with pytest.raises(ValueError):
        read_trace(hand, speed=0)


def test_arrivals_spread_within_their_rounded_interval_in_time_order(hand):
    """Four requests at 0, 1, 2 and 4 s, rounded to 1 s: each lands in [t, t + 1 s), the result is
    in time order and numbered in it, seeded (the same seed, the same times), and 0 changes nothing."""
    reqs = read_trace(hand)
    spread = spread_arrivals(reqs, 1000.0, seed=3)
    assert spread == spread_arrivals(reqs, 1000.0, seed=3) and spread != spread_arrivals(reqs, 1000.0, seed=4)
    times = [r.timestamp_ms for r in spread]
    assert times == sorted(times) and [r.request_id for r in spread] == [0, 1, 2, 3]
    by_input = {r.input_length: r.timestamp_ms for r in spread}
    for r in reqs:
        assert r.timestamp_ms <= by_input[r.input_length] < r.timestamp_ms + 1000.0
    # a burst (here two requests at 0 ms, 2 s wide) comes out in either order, never at one instant
    burst = [r for r in reqs if r.timestamp_ms < 1500] * 1
    assert len({r.timestamp_ms for r in spread_arrivals(burst, 2000.0, seed=1)}) == len(burst)
    assert spread_arrivals(reqs, 0.0) == reqs
    with pytest.raises(ValueError):
        spread_arrivals(reqs, -1.0)


def test_stats_known_answers(hand):
    s = compute_stats(read_trace(hand))
    assert s.num_requests == 4 and s.duration_s == 4.0
    assert s.input_avg == 800 and s.input_median == 800 and s.input_max == 1500
    assert s.output_avg == 25
    assert s.num_block_refs == 8 and s.num_unique_blocks == 5
    assert s.block_reuse_share == pytest.approx(3 / 8)           # 0,1 in r1; 0 in r3
    assert s.token_reuse_share == pytest.approx((1024 + 512) / 3200)
    assert s.most_shared_block == 0 and s.most_shared_block_share == 0.75


@pytest.mark.parametrize("line, msg", [
    (b"not json", "not JSON"),
    (b'{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    (b'{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp"),
    (b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "ceil"),
])
def test_bad_lines_name_the_line(tmp_path, line, msg):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(HAND + line + b"\n")
    with pytest.raises(TraceError, match=msg) as info:
        read_trace(path)
    assert ":6:" in str(info.value)


def test_write_read_roundtrip(hand, tmp_path):
    reqs = read_trace(hand)
    out = tmp_path / "copy.jsonl"
    assert write_trace(reqs, out) == 4
    assert read_trace(out) == reqs


def test_synth_is_deterministic_and_well_formed():
    cfg = SynthConfig(num_requests=400, rate_per_s=2.0, input_lengths=(4096, 8192), cache_ratio=0.5,
                      num_prefixes=4, input_dist="uniform", seed=7)
    a, b = synthesize(cfg), synthesize(cfg)
    assert a == b and a != synthesize(SynthConfig(**{**cfg.__dict__, "seed": 8}))
    for r in a:
        assert len(r.hash_ids) == -(-r.input_length // 512)
        assert 2048 <= r.input_length <= 12288 and r.output_length == 512
    s = compute_stats(a)
    assert 0.4 < s.block_reuse_share <= 0.5       # converges to the cache ratio from below
    assert 1.5 < s.request_rate_per_s < 2.5       # Poisson at rate 2


def test_synth_zero_cache_has_no_reuse():
    reqs = synthesize(SynthConfig(num_requests=50, cache_ratio=0.0, input_lengths=(2000,)))
    assert compute_stats(reqs).block_reuse_share == 0.0


def test_cli_stats_synth_scale(tmp_path, hand, capsys):
    out = tmp_path / "s.jsonl"
    assert main(["synth", "-o", str(out), "-n", "20", "--input-len", "1k,2k", "--seed", "3"]) == 0
    assert len(read_trace(out)) == 20
    assert main(["stats", str(hand), "--json"]) == 0
    assert '"num_requests":4' in capsys.readouterr().out
    fast = tmp_path / "fast.jsonl"
    assert main(["scale", str(hand), "--speed", "2", "-o", str(fast)]) == 0
    assert read_trace(fast)[-1].timestamp_ms == 2000
    assert main(["stats", str(tmp_path / "missing.jsonl")]) == 2
