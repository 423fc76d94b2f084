"""`mooncake sim` and `mooncake sim reproduce` end to end on small inputs."""

from __future__ import annotations

from dataclasses import replace

import orjson

from mooncake_lite.sim.cli import main
from mooncake_lite.trace.format import write_trace
from mooncake_lite.trace.synth import SynthConfig, synthesize
from tests.conftest import TRACE, needs_trace


def synth_file(tmp_path, n=120, rate=2.0):
    path = tmp_path / "t.jsonl"
    write_trace(synthesize(SynthConfig(num_requests=n, rate_per_s=rate, input_lengths=(2048, 8192),
                                       input_dist="exponential", output_lengths=(64,), seed=3)), path)
    return path


def test_sim_run_json_and_outputs(tmp_path, capsys):
    path = synth_file(tmp_path)
    out = tmp_path / "out"
    assert main([str(path), "--prefill", "2", "--decode", "2", "--baseline", "--json", "--out", str(out)]) == 0
    summaries = orjson.loads(capsys.readouterr().out)
    assert [s["system"] for s in summaries] == ["mooncake", "colocated"]
    for s in summaries:
        assert s["completed"] + s["rejected"] == s["num_requests"] == 120
    assert (out / "cdf.png").stat().st_size > 1000 and (out / "load.png").exists()
    assert orjson.loads((out / "results.json").read_bytes())["summaries"][0]["num_requests"] == 120


def test_sim_run_table_and_seed_determinism(tmp_path, capsys):
    path = synth_file(tmp_path)
    args = ["run", str(path), "--prefill", "2", "--decode", "1", "--strategy", "random", "--seed", "4", "--json",
            "--no-progress"]
    assert main(args) == 0
    a = orjson.loads(capsys.readouterr().out)
    assert main(args) == 0
    b = orjson.loads(capsys.readouterr().out)
    for k in ("ttft_s", "tbt_s", "rejected", "completed"):
        assert a[k] == b[k]
    assert main([str(path), "--prefill", "2", "--decode", "1", "--no-progress"]) == 0
    assert "SLO ok" in capsys.readouterr().out


def test_sim_spreads_a_rounded_trace_s_arrivals_as_the_replay_does(tmp_path, capsys):
    """Ten requests at one timestamp: as recorded a burst, spread within 30 s they queue less (the
    same requests, a lower mean TTFT); a negative spread is a clear error."""
    path = tmp_path / "burst.jsonl"
    reqs = synthesize(SynthConfig(num_requests=10, rate_per_s=1.0, input_lengths=(2048, 8192), output_lengths=(16,),
                                  seed=5))
    write_trace([replace(r, timestamp_ms=0.0) for r in reqs], path)
    runs = []
    for extra in ([], ["--arrival-spread", "30s"]):
        assert main([str(path), "--admission", "none", "--json", "--no-progress", *extra]) == 0
        runs.append(orjson.loads(capsys.readouterr().out))
    assert runs[0]["completed"] == runs[1]["completed"] == 10
    assert runs[1]["ttft_s"]["mean"] < runs[0]["ttft_s"]["mean"]
    assert main([str(path), "--arrival-spread=-1s"]) == 2 and "arrival spread" in capsys.readouterr().err


def test_sim_bad_input_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main([str(bad)]) == 2
    assert "missing field" in capsys.readouterr().err
    assert main([str(synth_file(tmp_path)), "--cost-model", "nope"]) == 2
    for gbps in ("0", "nan", "-3"):
        assert main([str(synth_file(tmp_path)), "--network-gbps", gbps]) == 2
        assert "--network-gbps must be a positive number" in capsys.readouterr().err


@needs_trace
def test_tiny_reproduction(tmp_path, capsys):
    out = tmp_path / "repro"
    assert main(["reproduce", "--trace", str(TRACE), "--limit", "150", "--out", str(out),
                 "--capacity-iterations", "1", "--json"]) == 0
    res = orjson.loads(capsys.readouterr().out)
    assert res["num_requests"] == 150
    assert len(res["table1"]["rows"]) == 18
    assert {r["admission"] for r in res["table3"]["rows"]} == {"none", "early", "predictive"}
    assert [r["strategy"] for r in res["strategies"]["rows"]][:4] == ["random", "load-balance", "cache-aware",
                                                                 "kvcache-centric"]
    assert [r["tbt_slo_s"] for r in res["capacity"]["rows"]] == [0.1, 0.2, 0.3]
    for name in ("table1", "table3", "strategies", "capacity"):
        for plot in res[name]["plots"]:
            assert (out / plot.split("/")[-1]).stat().st_size > 1000
    assert (out / "results.json").exists()


def test_sim_with_a_bench_pd_style_profile(tmp_path, capsys):
    prof = tmp_path / "prof.json"
    prof.write_bytes(orjson.dumps({"name": "tiny-cpu", "prefill": {"c0": 0.001, "c1": 2e-5, "c2": 1e-9, "c3": 0.0},
                                   "decode": {"c0": 0.002, "c1": 1e-4, "c2": 1e-8}, "kv_bytes_per_token": 8192,
                                   "block_size": 16, "bandwidth_bytes_per_s": 2e9}))
    assert main([str(synth_file(tmp_path)), "--cost-model", str(prof), "--prefill", "1", "--decode", "1",
                 "--json"]) == 0
    s = orjson.loads(capsys.readouterr().out)
    assert s["completed"] + s["rejected"] == 120
    assert s["ttft_s"]["p50"] < 1.0        # the tiny model's costs, not the 70B preset's


@needs_trace
def test_sim_ssd_tier_keeps_prefixes_a_small_dram_store_loses(capsys):
    base = [str(TRACE), "--prefill", "2", "--decode", "2", "--limit", "400", "--store-blocks", "50",
            "--json", "--no-progress"]
    assert main(base) == 0
    dram_only = orjson.loads(capsys.readouterr().out)
    assert main(base + ["--ssd-blocks", "5000"]) == 0
    with_ssd = orjson.loads(capsys.readouterr().out)
    assert with_ssd["reused_token_share"] > 1.5 * dram_only["reused_token_share"] > 0
    assert main(base + ["--ssd-blocks", "-1"]) == 2


def test_sim_max_tokens_policy_predictor_and_decode_check_flags(tmp_path, capsys):
    path = synth_file(tmp_path)
    base = [str(path), "--prefill", "2", "--decode", "1", "--admission", "predictive", "--json", "--no-progress"]
    assert main([*base, "--max-tokens-policy", "cap:4096", "--predict-output", "--decode-check", "arrival"]) == 0
    s = orjson.loads(capsys.readouterr().out)
    assert s["completed"] + s["rejected"] == 120
    assert main([*base, "--max-tokens-policy", "cap:0"]) == 2
    assert "max-tokens policy must be" in capsys.readouterr().err


def test_sim_prefill_queue_overtakes_flag_orders_the_queue(tmp_path, capsys, monkeypatch):
    """A burst on one prefill instance: the flag reaches SimConfig, and with K > 0 the shorter
    prompts behind the first (which starts alone) go first (scheduler/queue_order.py)."""
    from mooncake_lite.sim import runner
    from tests.sim.helpers import req
    path = tmp_path / "burst.jsonl"
    write_trace([req(i, 0.0, n, 2) for i, n in enumerate([2500, 2000, 1500, 1000, 500])], path)
    runs = []
    real = runner.run_with_progress

    def keep(*args, **kw):      # the run's per-request TTFTs, which the JSON summary does not list
        runs.append(real(*args, **kw))
        return runs[-1]

    monkeypatch.setattr(runner, "run_with_progress", keep)

    def ttfts(*flags):
        assert main([str(path), "--prefill", "1", "--decode", "1", "--admission", "none", "--json",
                     "--no-progress", *flags]) == 0
        capsys.readouterr()
        return runs[-1].config["prefill_queue_overtakes"], [r.ttft for r in runs[-1].requests]

    k, fifo = ttfts()
    assert k == 0 and fifo == sorted(fifo)                # served in arrival order
    k, shortest = ttfts("--prefill-queue-overtakes", "4")
    assert k == 4 and shortest[0] == fifo[0]             # the first had started: never passed
    assert shortest[1:] == sorted(shortest[1:], reverse=True)
    assert main([str(path), "--prefill-queue-overtakes", "-1"]) == 2
    assert "prefill_queue_overtakes must be >= 0" in capsys.readouterr().err
