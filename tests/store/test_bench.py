"""``mooncake bench store`` runs end to end and reports every figure (no speed assertions)."""

from __future__ import annotations

import subprocess
import sys

import orjson

from tests.conftest import REPO


def test_bench_store_json_smoke():
    res = subprocess.run([sys.executable, "-m", "mooncake_lite", "bench", "store", "--sizes", "64KiB",
                          "--repeat", "1", "--bytes-per-run", "2MiB", "--batch-bytes", "512KiB",
                          "--dram", "8MiB", "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    report = orjson.loads(res.stdout)
    fig = report["sizes"]["65536"]
    assert fig["memcpy_gbps"] > 0 and fig["socket_gbps"] > 0
    assert fig["memcpy_cold_read_gbps"] > 0 and fig["memcpy_cold_write_gbps"] > 0   # as the slab is copied
    for op in ("put", "get", "batched_put", "batched_get"):
        assert fig[op]["gbps"] > 0 and fig[op]["p99_ms"] >= fig[op]["p50_ms"] > 0
        assert fig[op]["mooncake_gbps"] == report["reference_mooncake_gbps"][op]["65536"]
        assert set(fig[op]["goals_met"]) >= {"1.5x_mooncake"}
    assert fig["config"]["blocks_per_request"] == 8
    # The same-node fast path, beside TCP in the same run, with its goals (issue 17).
    for op in ("shm_put", "shm_put_alone", "shm_get", "shm_batched_put", "shm_batched_get", "shm_leased_get"):
        assert fig[op]["gbps"] > 0 and fig[op]["vs_tcp"] > 0 and "2x_tcp" in fig[op]["goals_met"]
        assert fig[op]["vs_memcpy_cold"] > 0
    assert fig["put_alone"]["gbps"] > 0 and fig["put_alone"]["goals_met"] == {}
    assert "64KiB_get_50us" in fig["shm_leased_get"]["goals_met"]
    # The round-trip floor beside the single gets: echoes between two event loops, a no-work request.
    assert set(fig["round_trip_us"]) == {"unix_echo", "tcp_echo", "store_request"}
    assert all(v > 0 for v in fig["round_trip_us"].values())


def test_shm_goals_are_the_issues_only():
    """The cold-memcpy ratio is a reference beside the goals, never one of them (issue 17 sets
    50% of the cache-hot memcpy): a path at 40% hot / 80% cold misses, with no cold "ok"."""
    from mooncake_lite.bench.store.summary import _shm_goals
    entry = {"gbps": 4.0, "vs_memcpy": 0.4, "vs_memcpy_cold": 0.8, "p50_ms": 1.0}
    goals = _shm_goals("shm_get", 1 << 20, entry, {"get": {"gbps": 1.0}})
    assert goals == {"2x_tcp": True, "50pct_memcpy": False}


def test_memcpy_reference_is_the_best_round_and_flags_a_disturbed_one():
    """The 50% goal is judged against the best cache-hot memcpy of the session, not the median a
    slowed round drags down; a round whose hot memcpy fell below its cold read is marked invalid."""
    from mooncake_lite.bench.store.summary import _shm_goals, memcpy_reference
    ref = memcpy_reference({"memcpy": [20.0, 8.0, 19.0], "memcpy_cold_read": [10.0, 12.0, 9.0]})
    assert ref["memcpy_gbps"] == 20.0 and ref["memcpy_median_gbps"] == 19.0
    assert ref["invalid_rounds"] == [1]
    # Leased gets are judged against it too, on their own row (the docs count them).
    entry = {"gbps": 9.0, "vs_memcpy": 9.0 / ref["memcpy_gbps"], "vs_memcpy_cold": 0.9, "p50_ms": 1.0}
    assert _shm_goals("shm_leased_get", 1 << 20, entry, {"get": {"gbps": 1.0}})["50pct_memcpy"] is False
