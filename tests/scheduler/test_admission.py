"""Early vs prediction-based admission (REFERENCE.md §3) on hand-built states."""

import pytest

from mooncake_lite.scheduler import (BlockIndex, DecodeInstanceState, DecodingRequest,
                                     QueuedPrefill, decode_admits, schedule)
from tests.scheduler.clusters import COSTS, cfg, cluster, decode, prefill, queued, request


def run(clus, admission, now=0.0, **kw):
    return schedule(request(), clus, index=BlockIndex(), config=cfg(admission=admission, **kw),
                    costs=COSTS, now=now)


def test_predictive_counts_prefills_that_reach_decode_before_this_one():
    # Decode is empty now, but 9 queued prefills bound for d0 finish before the new request
    # (each 50 ms, then ours 100 ms): at t = 0.55 s the batch is 9 + 1 -> TBT 0.11 s.
    clus = cluster([prefill("p0", queued(*[50] * 9, decode_id="d0"))], [decode("d0")])
    assert run(clus, "early").accepted
    d = run(clus, "predictive")
    assert not d.accepted and d.reject_cause == "tbt"
    assert d.predicted_tbt_s == pytest.approx(0.11)
    assert d.reason == "rejected: predicted TBT 0.11s > SLO 0.1s"


def test_predictive_ignores_prefills_that_finish_later_or_go_elsewhere():
    later = prefill("p1", queued(5000, decode_id="d0"))          # ends at 5 s, after ours
    elsewhere = prefill("p2", queued(*[1] * 9, decode_id="dX"))  # other decode
    clus = cluster([prefill("p0"), later, elsewhere], [decode("d0")])
    d = run(clus, "predictive", ttft_slo_s=100)
    assert d.accepted and d.predicted_tbt_s == pytest.approx(0.02)


def test_predictive_removes_requests_that_will_have_finished():
    # 9 running now (early: TBT 0.11 > SLO), but they joined at t=-10 and t_d = 10.05 s, so by
    # the time our prefill ends (t = 0.1 s) they are gone.
    clus = cluster([prefill("p0")], [decode("d0", batch=9, joined_at=-10.0)])
    assert run(clus, "early", uniform_decode_s=10.05).reject_cause == "tbt"
    d = run(clus, "predictive", uniform_decode_s=10.05)
    assert d.accepted and d.predicted_tbt_s == pytest.approx(0.02)
    # With a longer t_d they are still there.
    assert run(clus, "predictive", uniform_decode_s=10.2).reject_cause == "tbt"


def test_predictive_per_request_decode_time_from_max_output_tokens():
    # t_d = max_output_tokens * current TBT (0.1 s with 9 running): 100 tokens -> 10 s, 200 -> 20 s
    def running(max_out):
        return tuple(DecodingRequest(f"r{i}", 100, joined_at=-10.0, max_output_tokens=max_out)
                     for i in range(9))
    short = cluster([prefill("p0")], [DecodeInstanceState("d0", running=running(100))])
    long = cluster([prefill("p0")], [DecodeInstanceState("d0", running=running(200))])
    assert run(short, "predictive").accepted
    assert run(long, "predictive").reject_cause == "tbt"


def test_predictive_picks_the_decode_that_will_be_lightest():
    # d0 is busy now but drains before we arrive; d1 is light now but receives 5 prefills first.
    p0 = prefill("p0", queued(*[10] * 5, decode_id="d1"))
    clus = cluster([p0], [decode("d0", batch=6, joined_at=-10.0), decode("d1", batch=1)])
    assert run(clus, "early", uniform_decode_s=10.0).decode_id == "d1"
    assert run(clus, "predictive", uniform_decode_s=10.0).decode_id == "d0"


def test_started_prefill_finishing_soon_is_counted():
    job = QueuedPrefill("x", 1000, decode_id="d0", started_at=-0.99)   # 10 ms left
    clus = cluster([prefill("p0", (job,)), prefill("p1")], [decode("d0", batch=8)])
    # ours runs on p1 and ends at 0.1 s; x joins d0 at 0.01 s -> batch 10 -> 0.11 s
    assert run(clus, "early", uniform_decode_s=100).accepted
    assert run(clus, "predictive", uniform_decode_s=100).reject_cause == "tbt"


def test_decode_side_double_check():
    req = request()
    assert decode_admits(decode("d0", batch=8), req, COSTS, tbt_slo_s=0.1)
    assert not decode_admits(decode("d0", batch=9), req, COSTS, tbt_slo_s=0.1)
    assert not decode_admits(decode("d0", batch=1, max_batch_size=1), req, COSTS, tbt_slo_s=1.0)


def test_unknown_output_length_is_assumed_to_keep_decoding():
    running = tuple(DecodingRequest(f"r{i}", 100, joined_at=-1000.0) for i in range(9))
    clus = cluster([prefill("p0")], [DecodeInstanceState("d0", running=running)])
    assert run(clus, "predictive").reject_cause == "tbt"
    assert run(clus, "predictive", uniform_decode_s=10.0).accepted


def test_repeated_predictions_on_one_state_agree_with_the_first():
    # The first query on a state scans, later ones use a cached sorted profile: same answers.
    from mooncake_lite.scheduler.estimate import decode_load_at
    running = tuple(DecodingRequest(f"r{i}", 100 + i, joined_at=float((i * 7) % 10)) for i in range(10))
    d = DecodeInstanceState("d0", running=running)
    for t in (0.0, 3.5, 5.0, 9.99, 12.0, 30.0, 12.0, 0.0):
        expected = [r.context_tokens for r in running if r.joined_at + 3.0 > t]
        assert decode_load_at(d, COSTS, t, [7], 3.0) == (len(expected) + 1, sum(expected) + 7)


def test_queue_time_cache_follows_now_while_a_job_runs():
    from mooncake_lite.scheduler import prefill_queue_time
    p = prefill("p0", (QueuedPrefill("x", 100, started_at=0.0), QueuedPrefill("y", 50)))
    assert prefill_queue_time(p, COSTS, 0.0) == pytest.approx(0.150)
    assert prefill_queue_time(p, COSTS, 0.04) == pytest.approx(0.110)
    assert prefill_queue_time(p, COSTS, 0.5) == pytest.approx(0.050)
    idle = prefill("p1", queued(30))
    assert prefill_queue_time(idle, COSTS, 0.0) == prefill_queue_time(idle, COSTS, 9.0) == pytest.approx(0.03)
