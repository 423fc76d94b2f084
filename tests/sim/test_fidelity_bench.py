"""``mooncake bench fidelity``'s pieces: the error arithmetic, the slice as the simulator sees it,
and a whole report (live column from recorded client timings, sim column from a real simulation
with a profile in the exported format) on five requests — no cluster, so it stays fast; the live
run itself is the command's (docs/sim.md, Fidelity)."""

from __future__ import annotations

import math

import orjson
import pytest

from mooncake_lite.bench.fidelity import cli as fidelity
from mooncake_lite.bench.fidelity import gaps as fidelity_gaps
from mooncake_lite.bench.fidelity import live as fidelity_live
from mooncake_lite.bench.replay.metrics import token_gaps
from mooncake_lite.bench.fidelity import report as fidelity_report
from mooncake_lite.bench.fidelity import sim as fidelity_sim
from mooncake_lite.bench.replay.metrics import RequestRecord
from mooncake_lite.bench.replay.workload import SynthRequest
from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.sim.costs import load_profile
from mooncake_lite.trace.format import TraceRequest


def test_rel_error_is_signed_and_refuses_a_zero_or_missing_reference():
    assert fidelity_report.rel_error(110.0, 100.0) == pytest.approx(0.10)
    assert fidelity_report.rel_error(85.0, 100.0) == pytest.approx(-0.15)
    assert fidelity_report.rel_error(3.0, 0.0) is None
    assert fidelity_report.rel_error(None, 1.0) is None and fidelity_report.rel_error(1.0, None) is None
    assert fidelity_report.rel_error(float("nan"), 1.0) is None


def test_dist_interpolates_like_numpy():
    d = fidelity_report.dist([4.0, 1.0, 3.0, 2.0])
    assert d == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7)}
    assert fidelity_report.dist([]) == {"mean": None, "p50": None, "p90": None}


def test_rejection_agreement_counts_the_symmetric_difference():
    agree = fidelity_report.rejection_agreement(frozenset({1, 2, 3}), frozenset({2, 3, 4, 5}), 20)
    assert (agree["both"], agree["live_only"], agree["sim_only"]) == (2, 1, 2)
    assert (agree["live_ids"], agree["sim_ids"], agree["of"]) == ([1, 2, 3], [2, 3, 4, 5], 20)
    assert agree["differ_share"] == pytest.approx(3 / 20)


def _side(ttft, tbt, rejected=()):
    return fidelity_report.Side(ttft=tuple(ttft), tbt=tuple(tbt), completed=len(ttft), rejected=frozenset(rejected),
                         failed=0, prefix_hit_tokens=100, prompt_tokens=1000)


def test_compare_judges_the_goals():
    live = _side([1.0, 1.0], [0.1, 0.1], rejected={7})
    close = fidelity_report.compare(live, _side([1.1, 1.1], [0.09, 0.09], rejected={7}), 20)
    assert close["rows"]["ttft_mean_s"]["rel_error"] == pytest.approx(0.10)
    assert close["rows"]["tbt_mean_s"]["rel_error"] == pytest.approx(-0.10)
    assert close["goals"] == {"mean_ttft_within_15%": True, "mean_tbt_within_15%": True,
                              "same_rejections_within_10%": True}
    # as many rejections, but other requests: 3 of 10 differ
    far = fidelity_report.compare(live, _side([2.0, 2.0], [0.1, 0.1], rejected={1, 2}), 10)
    assert far["rows"]["rejected"]["rel_error"] == pytest.approx(1.0)
    assert far["goals"]["mean_ttft_within_15%"] is False
    assert far["goals"]["same_rejections_within_10%"] is False


PROFILE = {"name": "live-test", "prefill": {"c0": 0.01, "c1": 2e-4, "c2": 1e-8, "c3": 1e-5},
           "decode": {"c0": 0.02, "c1": 1e-3, "c2": 1e-7}, "kv_bytes_per_token": 46080, "block_size": 16,
           "network_bytes_per_s": 2e9, "decode_max_context_tokens": 200_000}


def _slice():
    """Five requests sharing a system prompt (hash id 0), two of them a conversation's turns."""
    ids = [(0, 1, 2), (0, 3), (0, 1, 2, 4, 5), (0, 6, 7), (0, 8)]
    window = [TraceRequest(i, 250.0 * i, 512 * len(h), 300, h) for i, h in enumerate(ids)]
    requests = [SynthRequest(i, 0.25 * i + 5.0, "", 16 * len(h) - 1, 8, len(h) - 1, False) for i, h in enumerate(ids)]
    records = []
    for r in requests:
        if r.request_id == 3:   # the server refused it: it never said how it counted the prompt
            records.append(RequestRecord(3, r.arrival_s, r.arrival_s, prompt_tokens=r.num_prompt_tokens, status=429))
            continue
        chunks = tuple(r.arrival_s + 0.2 + 0.03 * k for k in range(r.max_tokens))
        records.append(RequestRecord(r.request_id, r.arrival_s, r.arrival_s, chunks, r.num_prompt_tokens, 8, 200,
                                     cached_tokens=16 if r.request_id else 0,
                                     server_prompt_tokens=r.num_prompt_tokens + 1))   # BOS
    return window, requests, records


def test_sim_trace_takes_the_servers_counts_and_cuts_hash_ids_to_the_scaled_prompt():
    window, requests, records = _slice()
    trace = fidelity_sim.sim_trace(window, requests, records, 16)
    assert [t.input_length for t in trace] == [r.num_prompt_tokens + 1 for r in requests]  # 3: same BOS offset
    assert [t.output_length for t in trace] == [8] * 5
    assert [t.hash_ids for t in trace] == [w.hash_ids for w in window]   # 16·k tokens: k blocks
    assert trace[0].timestamp_ms == 0.0 and trace[4].timestamp_ms == pytest.approx(1000.0)


def test_a_report_on_five_requests_has_both_columns_and_a_plot(tmp_path):
    window, requests, records = _slice()
    (tmp_path / "costs.json").write_bytes(orjson.dumps(PROFILE))
    hw = load_profile(tmp_path / "costs.json")
    trace = fidelity_sim.sim_trace(window, requests, records, 16)
    slos = fidelity_sim.converted_slos([t.input_length for t in trace], hw, 10.0, 5.0)
    lengths = sorted(t.input_length for t in trace)
    assert slos["ttft_slo_s"] == pytest.approx(10.0 * hw.prefill.predict(lengths[2]))
    res = fidelity_sim.simulate(trace, hw, prefill=1, decode=1, admission="predictive",
                            ttft_slo_s=slos["ttft_slo_s"], tbt_slo_s=slos["tbt_slo_s"], block=16)
    packed = fidelity_sim.sim_side(fidelity_sim.simulate(trace, hw, prefill=1, decode=1, admission="predictive",
                                                 ttft_slo_s=slos["ttft_slo_s"], tbt_slo_s=slos["tbt_slo_s"],
                                                 block=16, batch_tokens=512))   # the live prefill's packing
    assert packed.completed + len(packed.rejected) == 5
    live, sim = fidelity_live.live_side(records), fidelity_sim.sim_side(res)
    assert live.rejected == {3} and live.completed == 4 and live.prefix_hit_tokens == 48
    assert sim.completed + len(sim.rejected) == 5
    assert sim.prefix_hit_tokens > 0        # the shared system-prompt block is reused in the sim too
    report = fidelity_report.compare(live, sim, 5)
    for row in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "tbt_mean_s", "tbt_p50_s", "tbt_p90_s"):
        assert report["rows"][row]["live"] is not None and report["rows"][row]["sim"] is not None
    assert report["rows"]["tbt_mean_s"]["live"] == pytest.approx(0.03)
    text = fidelity_report.format_report(report)
    assert "live" in text.splitlines()[0] and "sim" in text.splitlines()[0]
    assert "ttft_mean (ms)" in text and "same requests rejected" in text
    rows = fidelity.per_request(records, res)
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4] and rows[3]["live_status"] == 429
    assert rows[0]["live_ttft"] == pytest.approx(0.2) and rows[0]["sim_status"] in ("completed", "rejected")
    fidelity_report.cdf_plot(tmp_path / "cdf.png", live, sim, "test")
    assert (tmp_path / "cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert all(math.isfinite(v) for v in live.ttft + sim.ttft)


def test_gaps_are_split_by_whether_a_prefill_was_in_progress():
    a = RequestRecord(0, 0.0, 0.0, (1.0, 1.1, 1.2, 1.3), 10, 4, 200)
    b = RequestRecord(1, 1.0, 1.0, (1.25, 1.5), 10, 2, 200)      # b's prefill: 1.0 .. 1.25
    out = fidelity_gaps.gaps_by_prefill_activity([a, b])
    assert (out["gaps_during_prefill"], out["gaps_prefill_idle"]) == (3, 1)
    assert out["gap_mean_during_prefill_s"] == pytest.approx(0.1)
    assert out["gap_ratio_during_vs_idle"] == pytest.approx(0.1 / 0.25)


def test_first_tokens_landing_together_are_counted():
    a = RequestRecord(0, 0.0, 0.0, (1.00, 1.001, 1.3), 10, 3, 200)   # packed with b; tokens 1 and 2 together
    b = RequestRecord(1, 0.0, 0.0, (1.02, 1.4), 10, 2, 200)          # packed with a
    c = RequestRecord(2, 0.0, 0.0, (2.0, 2.3), 10, 2, 200)
    out = fidelity_gaps.first_token_shapes([a, b, c])
    assert (out["first_tokens_packed"], out["first_two_tokens_together"], out["requests_with_two_tokens"]) == (2, 1, 3)


def test_the_finish_chunk_is_no_token_gap():
    # 3 tokens, then the chunk that carries only the finish reason, right after the last token
    r = RequestRecord(0, 0.0, 0.0, (1.0, 1.1, 1.3, 1.3), 10, 3, 200)
    assert token_gaps(r) == pytest.approx([0.1, 0.2])
    assert fidelity_live.live_side([r]).tbt == pytest.approx((0.2,))


def test_ablations_take_out_one_modelled_effect_at_a_time(tmp_path):
    import dataclasses
    (tmp_path / "p.json").write_bytes(orjson.dumps({"prefill": {"c1": 1e-3}}))
    hw = load_profile(tmp_path / "p.json")
    assert fidelity_sim.ablations(hw) == {}
    full = dataclasses.replace(hw, decode_step_ratios=(0.9, 1.3), decode_padding_s_per_token=2e-6,
                               decode_colocated_slowdown=1.4, decode_kv_write_s_per_token=1e-5,
                               prefill_idle=PrefillCostModel(c1=8e-4), prefill_busy=PrefillCostModel(c1=1.3e-3))
    out = fidelity_sim.ablations(full)
    assert set(out) == {"without_step_spread", "without_padded_context", "without_colocated_slowdown",
                        "without_kv_writes", "without_node_states", "without_any"}
    assert out["without_padded_context"] == dataclasses.replace(full, decode_padding_s_per_token=0.0)
    assert out["without_node_states"] == dataclasses.replace(full, prefill_idle=None, prefill_busy=None)
    assert out["without_any"] == hw


def test_warm_up_sends_distinct_short_completions_before_the_replay():
    import http.server
    import threading
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._answer({"data": [{"id": "m"}]})

        def do_POST(self):
            seen.append((self.path, orjson.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self._answer({"choices": [{"text": "x"}]})

        def _answer(self, body):
            data = orjson.dumps(body)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        fidelity_live.warm_up(f"http://127.0.0.1:{server.server_port}", 2)
    finally:
        server.shutdown()
        server.server_close()
    assert [p for p, _ in seen] == ["/v1/completions"] * 2
    assert all(b["model"] == "m" and b["max_tokens"] == 8 for _, b in seen)
    assert seen[0][1]["prompt"][:12] != seen[1][1]["prompt"][:12]      # no block shared between them


def test_held_out_compares_the_last_requests_on_the_models_exported_before_them(tmp_path):
    from types import SimpleNamespace
    window, requests, records = _slice()
    trace = fidelity_sim.sim_trace(window, requests, records, 16)
    ns = SimpleNamespace(held_out=2)
    lr = SimpleNamespace(records=records, timelines={})   # no decode timeline: no delivery jitter
    seen = []

    def simulated(hw, jitter=None):
        assert jitter == ()
        seen.append(hw)
        return fidelity_sim.simulate(trace, hw, prefill=1, decode=1, admission="none", ttft_slo_s=60.0,
                                     tbt_slo_s=1.0, block=16)
    assert fidelity.held_out(ns, lr, trace, simulated, tmp_path) is None    # no export taken: nothing
    slow = {**PROFILE, "prefill": {k: 3 * v for k, v in PROFILE["prefill"].items()},
            "corrections": {"p0": {"scale": 3.0}}}
    (tmp_path / "costs_learned.json").write_bytes(orjson.dumps(slow))
    h = fidelity.held_out(ns, lr, trace, simulated, tmp_path)
    assert seen[-1].prefill.c1 == pytest.approx(3 * PROFILE["prefill"]["c1"])   # the learned export
    # requests 3 (a 429 live) and 4 alone; the simulator admitted both
    assert (h["rows"]["completed"]["live"], h["rows"]["rejected"]["live"]) == (1, 1)
    assert (h["rows"]["completed"]["sim"], h["rows"]["rejected"]["sim"]) == (2, 0)
    assert h["rejections"]["live_only"] == 1 and h["corrections"] == {"p0": {"scale": 3.0}}


def test_the_simulator_s_own_prediction_error_is_none_in_fifo_order_and_some_shortest_first():
    """The simulated conductor prices each request with the instance's model, and the simulated
    forwards take exactly that: in FIFO order, one prompt a forward, the prediction at arrival is
    the outcome (the queue ahead is all there is), so any error here is a rule that prices a queue
    wrong. Shortest first, a burst's later, shorter arrivals pass the earlier ones, and with
    packing later arrivals join a waiting job's forward: that error no prediction at arrival can
    avoid, and ``simulated_predictions`` reports it beside the live one."""
    from tests.sim.helpers import req, toy_hardware
    rng = __import__("random").Random(5)
    trace = [req(b * 8 + i, b * 20.0 + 0.001 * i, rng.randrange(100, 400), 4) for b in range(6) for i in range(8)]
    hw = toy_hardware(prefill_per_token=1e-3)

    def figures(overtakes: int, pack: int) -> dict:
        decisions: list = []
        res = fidelity_sim.simulate(trace, hw, prefill=1, decode=1, admission="none", ttft_slo_s=math.inf,
                                    tbt_slo_s=math.inf, block=16, batch_tokens=pack, overtakes=overtakes,
                                    correct=True, decisions=decisions)
        assert len(decisions) == len(trace)
        return fidelity_sim.simulated_predictions(trace, res, decisions)["ttft"]
    fifo, packed, shortest = figures(0, 0), figures(0, 512), figures(4, 512)
    assert fifo["count"] == packed["count"] == shortest["count"] == 48
    assert fifo["p90_error"] < 1e-6 and fifo["median_ratio"] == pytest.approx(1.0)
    assert packed["p90_error"] > 0.05 and shortest["median_error"] > 0.05


def test_a_burst_placed_together_is_priced_exactly_where_one_placed_as_it_comes_is_not():
    """Shortest first, one prompt a forward: each burst (8 requests within 7 ms, 20 s apart) meets
    an idle instance, whose first request starts at once; the rest are held for the burst window
    and placed shortest first (``scheduler/arrivals.py``), so each knows everything that will run
    before it, and the prediction at placement is the outcome. Placed as they come, later shorter
    members pass earlier ones that were priced without them. The decisions stay in arrival order."""
    from tests.sim.helpers import req, toy_hardware
    rng = __import__("random").Random(5)
    trace = [req(b * 8 + i, b * 20.0 + 0.001 * i, rng.randrange(100, 400), 4) for b in range(6) for i in range(8)]
    hw = toy_hardware(prefill_per_token=1e-3)

    def run(window: float) -> tuple[dict, list]:
        decisions: list = []
        res = fidelity_sim.simulate(trace, hw, prefill=1, decode=1, admission="none", ttft_slo_s=math.inf,
                                    tbt_slo_s=math.inf, block=16, overtakes=4, correct=True,
                                    decisions=decisions, burst_window_s=window)
        return fidelity_sim.simulated_predictions(trace, res, decisions)["ttft"], decisions
    (apart, _), (together, decisions) = run(0.0), run(0.05)
    assert apart["count"] == together["count"] == 48
    assert apart["median_error"] > 0.05 and together["p90_error"] < 1e-6
    # arrival order: a burst's first member started at once, queue 0; the others waited for it
    assert [d.predicted_queue_s == 0 for d in decisions[:8]] == [True] + [False] * 7


def _run_report(ttft_err, first50, ttft_rel, refused):
    """The parts of one run's report the --runs summary reads."""
    from mooncake_lite.bench.fidelity.admission import share
    return {"predictions": {"ttft": {"median_error": ttft_err, "first_median_error": first50},
                            "tbt": {"median_error": 0.3}},
            "rows": {"ttft_mean_s": {"rel_error": ttft_rel}, "tbt_mean_s": {"rel_error": 0.1}},
            "rejections": {"differ_share": 0.05},
            "admission": {"admitted_met": share(190, 195, 0.95, True),
                          "refused_would_meet": share(*refused, 0.10, False)}}


def test_runs_give_each_figure_s_median_and_range_and_pool_the_admission_outcomes():
    from mooncake_lite.bench.fidelity import runs
    reports = [_run_report(0.172, 0.172, -0.036, (1, 5)), _run_report(0.260, 0.219, 0.172, (3, 7)),
               _run_report(0.194, 0.153, 0.011, (0, 0))]
    summary = runs.summarize(reports)
    ttft = summary["figures"]["TTFT prediction error, median"]
    assert (ttft["median"], ttft["min"], ttft["max"]) == (0.194, 0.172, 0.260) and ttft["goal_met"] is False
    fid = summary["figures"]["fidelity: mean TTFT, sim vs live"]
    assert fid["median"] == pytest.approx(0.011) and fid["goal_met"] is True      # judged by its size
    refused = summary["pooled"]["refused that would have met it"]
    assert (refused["met"], refused["of"]) == (4, 12)           # summed over the runs
    one = reports[1]["admission"]["refused_would_meet"]["ci95"]
    assert refused["ci95"][1] - refused["ci95"][0] < one[1] - one[0]   # narrower than one run's
    assert summary["pooled"]["admitted that met their SLO"]["of"] == 3 * 195
    # a run without a figure leaves it out; none at all says so
    assert summary["pooled"]["  ... over the counterfactual's bias"]["of"] == 0
    text = runs.summary_text(summary)
    assert "over 3 runs" in text and "+19.4% [+17.2%, +26.0%]" in text and "4/12" in text and "none" in text
    done = runs.repeated(2, lambda i: {**reports[i - 1], "text": f"report {i}"})
    assert done["runs"] == 2 and "run 2:\nreport 2" in done["text"] and "over 2 runs" in done["text"]


def test_reruns_set_each_live_run_against_the_others_and_each_simulation_against_the_other_lives():
    from mooncake_lite.bench.fidelity import runs
    def run(live, sim):
        return {"rejections": {"of": 20, "live_ids": live, "sim_ids": sim, "differ_share": 0.0}}
    reports = [run([1, 2, 3], [1, 2]), run([2, 3, 4, 5], [2, 3, 4]), run([1, 2, 3, 4], [9])]
    reruns = runs.summarize(reports)["reruns"]
    # live pairs: {1}^{4,5} -> 3, {4} -> 1, {1,5} -> 2 of 20
    assert sorted(reruns["live_vs_live"]["values"]) == pytest.approx([1 / 20, 2 / 20, 3 / 20])
    assert reruns["live_vs_live"]["median"] == pytest.approx(2 / 20)
    # a simulation against the other runs' lives, never its own: sim 1 vs lives 2 and 3, ...
    cross = reruns["sim_vs_other_live"]["values"]
    assert len(cross) == 6 and cross[0] == pytest.approx(len({1, 2} ^ {2, 3, 4, 5}) / 20)
    assert "decisions that differ, live vs live" in runs.summary_text(runs.summarize(reports))
    # one run, or reports written before the sets went along: nothing to set against
    assert runs.summarize(reports[:1])["reruns"] is None
    assert runs.summarize([{"rejections": {"differ_share": 0.1}}] * 2)["reruns"] is None


def test_runs_refuse_a_running_cluster_and_a_count_below_one(capsys):
    from mooncake_lite.bench.fidelity import cli
    assert cli.main(["--runs", "2", "--conductor", "http://127.0.0.1:9"]) == 2
    assert cli.main(["--runs", "0"]) == 2
    assert "--runs" in capsys.readouterr().err
    assert cli.main(["--ttft-admit-margin", "1.5"]) == 2       # before any cluster starts
    assert "--ttft-admit-margin in [0, 1)" in capsys.readouterr().err


def test_the_report_says_what_the_hypervisor_took_while_the_prefills_computed():
    """CPU seconds stolen per second of forwards over the replay, all prefills together; none
    when the prefills ran no forward (or were not scraped)."""
    before = {"0.mooncake_prefill_forward_seconds_total": 10.0, "0.mooncake_prefill_forward_steal_seconds_total": 1.0,
              "1.mooncake_prefill_forward_seconds_total": 0.0, "1.mooncake_prefill_forward_steal_seconds_total": 0.0}
    after = {"0.mooncake_prefill_forward_seconds_total": 40.0, "0.mooncake_prefill_forward_steal_seconds_total": 4.0,
             "1.mooncake_prefill_forward_seconds_total": 10.0, "1.mooncake_prefill_forward_steal_seconds_total": 2.0}
    assert fidelity_gaps.prefill_steal(before, after) == {"prefill_steal_per_forward_s": pytest.approx(0.125)}
    # and the prefills' threads' seconds on a CPU and on the run queue, where they report them
    ran = {"0.mooncake_prefill_forward_cpu_seconds_total": 30.0, "0.mooncake_prefill_forward_runqueue_seconds_total": 6.0}
    assert fidelity_gaps.prefill_steal(before, {**after, **ran}) == {
        "prefill_steal_per_forward_s": pytest.approx(0.125), "prefill_cpu_per_forward_s": pytest.approx(0.75),
        "prefill_runqueue_per_forward_s": pytest.approx(0.15)}
    assert fidelity_gaps.prefill_steal(before, before) == {}
    assert fidelity_gaps.prefill_steal({}, {}) == {}
