"""``mooncake bench chaos --conductors N``'s flags and report (the run itself: docs/results/2026-11-29-ha.md;
its processes are the HA tests' rig, exercised by tests/ha)."""

from __future__ import annotations

import pytest

from mooncake_lite.bench.chaos import cli, ha, rig


def test_conductors_flag_goes_to_the_ha_bench_and_one_conductor_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--conductors", "1"])
    assert "--conductors must be at least 2" in capsys.readouterr().err


def test_render_names_each_kill_and_the_goodput_spread():
    kill = {"victim": "c1", "in_flight_failed": 2, "new_failed": 0, "new_requests": 40, "all_new_succeed_s": 0.3,
            "haproxy_down_s": 0.21, "ttft_p50_before_s": 0.05, "ttft_p50_after_s": 0.06, "errors": ["boom"]}
    res = {"model": "tiny", "conductors": 2, "prefill": 1, "decode": 1, "load": {"concurrency": 4, "max_tokens": 32},
           "kills": [kill, {**kill, "victim": "etcd", "haproxy_down_s": None, "errors": []}],
           "goodput": {"1": rig.spread([{"goodput_rps": 2.9, "ttft_p50_s": 0.1}, {"goodput_rps": 3.1, "ttft_p50_s": None}])}}
    text = ha.render(res)
    assert "0/40" in text and "boom" in text and "etcd" in text and "goodput 3.00 req/s (runs [2.9, 3.1])" in text
    assert "TTFT p50 0.10 s (runs [0.1])" in text     # a run without the figure is left out of its mean


def test_a_replay_run_is_judged_by_both_slos_and_the_report_compares_the_counts():
    from mooncake_lite.bench.chaos.ha_replay import judged, render_replay
    from mooncake_lite.bench.replay.metrics import RequestRecord
    fast = RequestRecord(0, 0.0, 0.0, chunk_s=(0.1, 0.11, 0.12), status=200)
    slow_first = RequestRecord(1, 0.0, 0.0, chunk_s=(0.9, 0.91), status=200)
    slow_gaps = RequestRecord(2, 0.0, 0.0, chunk_s=(0.1, 0.5), status=200)
    failed = RequestRecord(3, 0.0, 0.0, status=503, error="no decode")
    fig = judged([fast, slow_first, slow_gaps, failed], {"ttft_slo_s": 0.5, "tbt_slo_s": 0.05})
    assert fig["slo_attainment"] == 0.25 and fig["failed"] == 1.0      # only `fast` meets both
    assert abs(fig["goodput_rps"] - 1 / 0.91) < 1e-9                  # first send to last token
    live = {n: rig.spread([{"goodput_rps": g, "ttft_p50_s": 0.2}]) for n, g in (("1", 2.0), ("2", 1.9))}
    sim = {n: {"goodput_rps": 2.0, "ttft_p50_s": 0.1} for n in live}
    lines = render_replay({"slice": {"requests": 4, "speed": 1.0, "trace": "t.jsonl"}, "slos": {
        "ttft_slo_s": 0.5, "tbt_slo_s": 0.05}, "live": live, "sim": sim, "errors": {"1": [], "2": []}})
    assert any("goodput 95.0% of 1 conductor's" in line for line in lines)
