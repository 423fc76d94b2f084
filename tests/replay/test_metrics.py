"""Metric arithmetic on a hand-made recorded stream; every expected number is worked out by hand."""

import pytest

from mooncake_lite.bench.replay.metrics import (RequestRecord, cached_token_hit_rate, compute_metrics, meets_slos,
                                                parse_slos, prefix_hit_request_share, tpot)
from mooncake_lite.common.tbt import paper_tbt

A = RequestRecord(0, 0.0, 0.0, (0.10, 0.15, 0.25, 0.30), prompt_tokens=10, output_tokens=4, status=200,
                  reused_blocks=1, num_prompt_blocks=4)
B = RequestRecord(1, 1.0, 1.0, (1.2, 1.4), prompt_tokens=20, output_tokens=2, status=200,
                  reused_blocks=2, num_prompt_blocks=4)
C = RequestRecord(2, 2.0, 2.0, (), prompt_tokens=5, status=429, error="rejected")
D = RequestRecord(3, 3.0, 3.0, (3.5,), prompt_tokens=30, output_tokens=1, status=200)
E = RequestRecord(4, 3.5, 3.6, (), prompt_tokens=7, status=500, error="boom")
RECORDS = [A, B, C, D, E]


def test_counts_and_throughputs():
    m = compute_metrics(RECORDS, duration_s=4.0)
    assert (m["num_requests"], m["completed"], m["num_rejected_429"], m["num_failed"]) == (5, 3, 1, 1)
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_throughput"] == pytest.approx(1.75)
    assert m["total_token_throughput"] == pytest.approx(16.75)
    assert "request_goodput" not in m


def test_latency_summaries_in_ms():
    m = compute_metrics(RECORDS, duration_s=4.0)
    # TTFT 100, 200, 500 ms; linear-interpolated percentiles (numpy / vLLM)
    assert m["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(440)
    assert m["p99_ttft_ms"] == pytest.approx(494)
    # TPOT: A (300-100)/3 = 66.67, B (400-200)/1 = 200; D has one token, so none
    assert m["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert m["p90_tpot_ms"] == pytest.approx(200 / 3 + 0.9 * 400 / 3)
    # ITL pooled: 50, 100, 50 (A) and 200 (B)
    assert m["mean_itl_ms"] == pytest.approx(100)
    assert m["median_itl_ms"] == pytest.approx(75)
    assert m["p90_itl_ms"] == pytest.approx(170)
    assert m["p99_itl_ms"] == pytest.approx(197)
    # E2EL 300, 400, 500
    assert (m["mean_e2el_ms"], m["median_e2el_ms"]) == (pytest.approx(400), pytest.approx(400))
    assert m["p99_e2el_ms"] == pytest.approx(498)
    # paper TBT: A's slowest 10% of 3 gaps is its one slowest (100), B's only gap is 200
    assert m["mean_tbt_ms"] == pytest.approx(150) and m["p90_tbt_ms"] == pytest.approx(190)


def test_goodput_counts_requests_meeting_every_slo():
    m = compute_metrics(RECORDS, 4.0, parse_slos(["ttft:250", "tpot:150"]))
    assert m["request_goodput"] == pytest.approx(0.25)      # only A
    m = compute_metrics(RECORDS, 4.0, parse_slos(["e2el:450"]))
    assert m["request_goodput"] == pytest.approx(0.5)       # A and B
    assert meets_slos(D, {"tpot": 0.001})                    # one token: TPOT counts as 0 (vLLM)
    assert not meets_slos(C, {"ttft": 100.0})                # a rejected request is never good


def test_paper_tbt_is_mean_of_slowest_tenth():
    gaps = [0.01] * 18 + [0.5, 0.3]
    assert paper_tbt(gaps) == pytest.approx(0.4)             # 20 gaps -> slowest 2
    assert paper_tbt([0.2, 0.1]) == pytest.approx(0.2)       # fewer than 10 -> the slowest one
    assert paper_tbt([]) is None
    assert tpot(D) is None


def test_empty_and_bad_inputs():
    m = compute_metrics([C, E], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["p99_itl_ms"] is None
    with pytest.raises(ValueError):
        compute_metrics(RECORDS, 0.0)
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slos(bad)


def test_prefix_hit_request_share():
    zero = RequestRecord(5, 0.0, 0.0, (0.1,), output_tokens=1, status=200, reused_blocks=0)
    assert prefix_hit_request_share([A, B, zero, C]) == pytest.approx(2 / 3)   # C was rejected: not counted
    assert prefix_hit_request_share([D]) is None                               # no header at all


def test_cached_token_hit_rate_uses_the_servers_counts():
    def rec(i, cached, prompt, server=None, status=200):
        return RequestRecord(i, 0.0, 0.0, (0.1,), prompt_tokens=prompt, status=status, cached_tokens=cached,
                             server_prompt_tokens=server)
    got = cached_token_hit_rate([rec(0, 0, 100), rec(1, 64, 100, server=101), rec(2, 128, 200),
                                 rec(3, None, 500), rec(4, 64, 100, status=429)])
    assert got["cached_token_hit_rate"] == 192 / 401 and got["cached_tokens"] == 192
    assert got["requests_reporting_cached_tokens"] == 3 and got["requests_with_cached_tokens"] == 2 / 3
    assert cached_token_hit_rate([rec(0, None, 10)])["cached_token_hit_rate"] is None


def test_prediction_errors_compare_the_servers_predictions_with_what_the_client_measured():
    from dataclasses import replace

    from mooncake_lite.bench.replay.metrics import prediction_errors
    from mooncake_lite.bench.replay.report import prediction_lines
    # A: TTFT 0.10 measured, 0.05 predicted (x2); TBT (gaps .05 .10 .05: slowest .10) against 0.08
    # B: TTFT 0.20 against 0.25 (x0.8), no TBT predicted; C rejected, E failed: not counted
    records = [replace(A, predicted_ttft_s=0.05, predicted_tbt_s=0.08), replace(B, predicted_ttft_s=0.25),
               replace(C, predicted_ttft_s=1.0), D, E]
    p = prediction_errors(records)
    assert p["ttft"]["count"] == 2 and p["ttft"]["median_ratio"] == pytest.approx(1.4)
    assert p["ttft"]["median_error"] == pytest.approx(0.6)        # |2 - 1| and |0.8 - 1|, their median
    assert p["tbt"] == {"count": 1, "median_error": pytest.approx(0.25), "p90_error": pytest.approx(0.25),
                        "median_ratio": pytest.approx(1.25), "first": 1, "first_median_error": pytest.approx(0.25),
                        "by_tens": [0.25]}
    # the first N in the order sent: A was sent first (its error 1.0), B second (0.2)
    assert prediction_errors(records, first=1)["ttft"]["first_median_error"] == pytest.approx(
        1.0 if A.send_s <= B.send_s else 0.2)
    assert any("TTFT measured/predicted, median (n=2)" in line for line in prediction_lines(p))
    assert prediction_errors([D])["ttft"]["count"] == 0 and prediction_lines(prediction_errors([D])) == []
