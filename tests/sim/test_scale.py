"""The simulator at scale (issue #20 item 5): a trace streamed from its file, results summarized
as they end, the FAST'25 release's trace layout read as is."""

from __future__ import annotations

import json
import random

import pytest

from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import get_hardware
from mooncake_lite.sim.metrics import QuantileSketch, StreamingSummary, quantile, summarize
from mooncake_lite.trace.format import TraceError, iter_trace, read_trace, write_trace
from mooncake_lite.trace.synth import SynthConfig, iter_synthesize, synthesize

HW = get_hardware("llama2-70b-a800")


def _fast25_lines(n: int, seed: int = 3) -> list[dict]:
    """Requests laid out as the FAST'25 release's synthetic_trace.jsonl lays them out: integer
    millisecond timestamps (ties allowed), one hash id per 512-token block with the last block
    partial, later requests reusing the leading ids of earlier ones."""
    rng, next_id, out, ts = random.Random(seed), 0, [], 0
    for _ in range(n):
        ts += rng.choice([0, 40, 237, 1200])
        tokens = rng.choice([28, 546, 2752, 17642, 40160])
        blocks = -(-tokens // 512)
        reuse = rng.choice(out)["hash_ids"][:blocks - 1] if out and rng.random() < 0.5 else []
        ids = reuse + list(range(next_id, next_id + blocks - len(reuse)))
        next_id += blocks - len(reuse)
        out.append({"timestamp": ts, "input_length": tokens, "output_length": rng.randint(2, 700), "hash_ids": ids})
    return out


def test_the_fast25_layout_reads_as_is_streamed_or_whole(tmp_path):
    path = tmp_path / "synthetic_trace.jsonl"
    lines = _fast25_lines(40)
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))    # '": ' and ', ' as released
    whole, streamed = read_trace(path), list(iter_trace(path))
    assert whole == streamed and len(streamed) == 40
    for r, obj in zip(streamed, lines):
        assert (r.timestamp_ms, r.input_length, r.output_length, list(r.hash_ids)) == \
            (obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"])
    assert [r.request_id for r in streamed] == list(range(40))
    assert [r.request_id for r in iter_trace(path, limit=7)] == list(range(7))


def test_streaming_refuses_a_trace_out_of_time_order(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = _fast25_lines(5)
    lines[3]["timestamp"] = 0
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    assert [r.timestamp_ms for r in read_trace(path)][0] == 0      # the whole-file reader sorts
    with pytest.raises(TraceError, match=r"t\.jsonl:4: .*time order"):
        list(iter_trace(path))


def test_synthesis_streams_the_same_trace():
    cfg = SynthConfig(num_requests=300, rate_per_s=80, seed=5)
    assert list(iter_synthesize(cfg)) == synthesize(cfg)


def _sim() -> MooncakeSim:
    sched = SchedulerConfig(ttft_slo_s=30.0, tbt_slo_s=0.1, block_size=HW.block_size)
    return MooncakeSim(SimConfig(num_prefill=4, num_decode=4, scheduler=sched), HW)


def test_a_streamed_run_reads_as_it_goes_keeps_nothing_and_summarizes_as_the_kept_run(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(iter_synthesize(SynthConfig(num_requests=400, rate_per_s=6, seed=2)), path)
    kept = _sim().run(read_trace(path, block_size=HW.block_size))
    expected = summarize(kept, 30.0, 0.1)

    sim, stream = _sim(), StreamingSummary(30.0, 0.1)
    sim.recorder.sink = stream.add
    ahead = []

    def reading():    # how far the reader is ahead of the arrivals when it hands out a request
        for r in iter_trace(path, block_size=HW.block_size):
            ahead.append(r.request_id - sim.recorder.counters["arrived"])
            yield r

    res = sim.run(reading())
    got = stream.summarize(res)
    assert max(ahead) <= 1 and len(ahead) == 400          # one request read ahead, never the trace
    assert res.requests == [] and sim.recorder.results == {}
    for k in ("num_requests", "completed", "rejected", "rejected_by", "wasted_prefills", "num_events", "counters"):
        assert got[k] == expected[k], k
    for k in ("slo_attainment", "goodput_rps", "throughput_rps", "reused_token_share", "simulated_s"):
        assert got[k] == pytest.approx(expected[k], rel=1e-12), k
    for dist in ("ttft_s", "tbt_s"):
        assert got[dist]["mean"] == pytest.approx(expected[dist]["mean"], rel=1e-12)
        assert got[dist]["max"] == expected[dist]["max"]
        for q in ("p50", "p90", "p99"):
            assert got[dist][q] == pytest.approx(expected[dist][q], rel=0.005), (dist, q)
    assert len(res.timeline) == len(kept.timeline)       # sampled to the same end


def test_a_run_collects_garbage_less_often_and_restores_the_thresholds():
    import gc
    from mooncake_lite.sim import driver
    saved = gc.get_threshold()
    seen = []
    sim = _sim()
    sim.recorder.sink = lambda r: seen.append(gc.get_threshold()[0])
    sim.run(list(iter_synthesize(SynthConfig(num_requests=20, rate_per_s=6, seed=2))))
    assert seen and set(seen) == {driver.GC_YOUNG_THRESHOLD}
    assert gc.get_threshold() == saved


def test_the_sketch_quantiles_are_within_its_relative_error():
    rng = random.Random(11)
    values = [rng.lognormvariate(0, 2) for _ in range(20000)] + [0.0] * 50
    sketch = QuantileSketch(0.01)
    for v in values:
        sketch.add(v)
    values.sort()
    for q in (0.001, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0):
        exact = quantile(values, q)
        assert sketch.quantile(q) == pytest.approx(exact, rel=0.01, abs=1e-12), q
    assert sketch.max == values[-1] and sketch.count == len(values)
    assert len(sketch._counts) < 2000       # bounded by the value range, not the count


def test_decode_logs_are_trimmed_without_changing_any_result(monkeypatch):
    from mooncake_lite.sim import batch
    trace = synthesize(SynthConfig(num_requests=300, rate_per_s=6, seed=4))
    kept_sim = _sim()
    whole = kept_sim.run(trace)
    monkeypatch.setattr(batch, "LOG_TRIM_EVERY", 3)
    sim = _sim()
    trimmed = sim.run(trace)
    assert trimmed.requests == whole.requests        # every TBT folded from the trimmed logs
    kept = sum(len(d.batch.log) for d in kept_sim.decodes)
    assert sum(d.batch._log_base + len(d.batch.log) for d in sim.decodes) == kept    # same entries...
    assert sum(len(d.batch.log) for d in sim.decodes) < kept / 4                     # ...few still held


def test_bench_sim_scale_streams_a_synthetic_trace_and_reports_its_run(capsys, tmp_path):
    from mooncake_lite.bench.sim import scale as sim_scale
    assert sim_scale.main(["-n", "150", "--prefill", "3", "--decode", "2", "--rate", "2", "--json",
                           "--progress-every", "100"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    s = out["summary"]
    assert out["num_requests"] == s["num_requests"] == 150 == s["completed"] + s["rejected"]
    assert out["num_prefill"] == 3 and out["peak_rss_mb"] >= out["peak_rss_mb_before_run"] > 0
    assert s["ttft_s"]["p50"] is not None and 0 < s["reused_token_share"] < 1
    assert "150 requests ended" in captured.err                  # progress goes to stderr
    assert out["cpu"].endswith(" CPUs") and "," in out["cpu"]         # which machine made the figures
    path = tmp_path / "t.jsonl"                                  # --trace: simulate a given file
    path.write_text("".join(json.dumps(obj) + "\n" for obj in _fast25_lines(30)))
    assert sim_scale.main(["--trace", str(path), "--prefill", "2", "--decode", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_requests"] == 30
