"""``mooncake bench chaos --conductors N``'s flags and report (the run itself: docs/results/2026-11-29-ha.md;
its processes are the HA tests' rig, exercised by tests/ha)."""

from __future__ import annotations

import pytest

from mooncake_lite.bench.chaos import cli, ha


def test_conductors_flag_goes_to_the_ha_bench_and_one_conductor_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--conductors", "1"])
    assert "--conductors must be at least 2" in capsys.readouterr().err


def test_render_names_each_kill_and_the_goodput_spread():
    kill = {"victim": "c1", "in_flight_failed": 2, "new_failed": 0, "new_requests": 40, "all_new_succeed_s": 0.3,
            "haproxy_down_s": 0.21, "ttft_p50_before_s": 0.05, "ttft_p50_after_s": 0.06, "errors": ["boom"]}
    res = {"model": "tiny", "conductors": 2, "prefill": 1, "decode": 1, "load": {"concurrency": 4, "max_tokens": 32},
           "kills": [kill, {**kill, "victim": "etcd", "haproxy_down_s": None, "errors": []}],
           "goodput": {"1": {"mean_rps": 3.0, "goodput_rps": [2.9, 3.1], "mean_ttft_s": 0.1, "ttft_p50_s": [0.1, 0.1]}}}
    text = ha.render(res)
    assert "0/40" in text and "boom" in text and "etcd" in text and "goodput 3.00 req/s (runs [2.9, 3.1])" in text
