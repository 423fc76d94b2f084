"""Early vs prediction-based admission (docs/paper.md §3) on hand-built states."""

from dataclasses import replace

import pytest

from mooncake_lite.scheduler import (BlockIndex, DecodeInstanceState, DecodingRequest,
                                     IncomingRequest, QueuedPrefill, decode_admits, schedule)
from tests.scheduler.clusters import COSTS, bound, cfg, cluster, decode, prefill, queued, request


def run(clus, admission, now=0.0, **kw):
    return schedule(request(), clus, index=BlockIndex(), config=cfg(admission=admission, **kw),
                    costs=COSTS, now=now)


def test_committed_requests_count_before_their_kv_arrives():
    # Decode's batch is empty, but 9 queued prefills are committed to d0 and finish before the
    # new request (each 50 ms, then ours 100 ms): at t = 0.55 s the batch is 9 + 1 -> TBT
    # 0.11 s. Early counts them too (committed load now); without them both would accept.
    jobs = queued(*[50] * 9)
    clus = cluster([prefill("p0", jobs)], [decode("d0", incoming=bound(*jobs))])
    for admission in ("early", "predictive"):
        d = run(clus, admission)
        assert not d.accepted and d.reject_cause == "tbt"
        assert d.predicted_tbt_s == pytest.approx(0.11)
    assert d.reason == "rejected: predicted TBT 0.11s > SLO 0.1s"
    assert run(cluster([prefill("p0", jobs)], [decode("d0")]), "early").accepted


def test_predictive_ignores_prefills_that_finish_later_or_go_elsewhere():
    later = queued(5000, tag="late")                 # ends at 5 s, after ours
    elsewhere = queued(*[1] * 9, tag="else")         # committed to d1
    clus = cluster([prefill("p0"), prefill("p1", later), prefill("p2", elsewhere)],
                   [decode("d0", incoming=bound(*later)), decode("d1", incoming=bound(*elsewhere))])
    d = run(clus, "predictive", ttft_slo_s=100)
    assert d.accepted and d.decode_id == "d0" and d.predicted_tbt_s == pytest.approx(0.02)
    # Early counts the late one as committed now: batch 2.
    d = run(clus, "early", ttft_slo_s=100)
    assert d.accepted and d.decode_id == "d0" and d.predicted_tbt_s == pytest.approx(0.03)


def test_incoming_whose_prefill_is_done_joins_now():
    # In no prefill queue = prefill finished, KV in transit: predictive counts it from now for t_d.
    clus = cluster([prefill("p0")], [decode("d0", batch=8, incoming=(IncomingRequest("x", 100),))])
    assert run(clus, "predictive", uniform_decode_s=100).reject_cause == "tbt"   # 8 + 1 + 1
    assert run(clus, "early").reject_cause == "tbt"


@pytest.mark.parametrize("admission", ["none", "early", "predictive"])
def test_burst_before_any_kv_arrives_spreads_over_decodes(admission):
    # Six requests at t=0, each committed (queued on p0, incoming on its decode) before the next
    # decision, none has reached decode yet. d1 already runs 2. Each goes to the smallest
    # committed batch (ties: earlier instance): d0, d2, d0, d2, d0, d1.
    queue, incoming = [], {"d0": [], "d1": [], "d2": []}
    chosen = []
    for i in range(6):
        decodes = [decode(name, batch=2 if name == "d1" else 0, incoming=tuple(incoming[name]))
                   for name in ("d0", "d1", "d2")]
        req = request(rid=f"b{i}")
        d = schedule(req, cluster([prefill("p0", tuple(queue))], decodes), index=BlockIndex(),
                     config=cfg(admission=admission), costs=COSTS, now=0.0)
        assert d.accepted, d.reason
        chosen.append(d.decode_id)
        queue.append(QueuedPrefill(req.request_id, req.num_tokens))
        incoming[d.decode_id].append(IncomingRequest(req.request_id, req.num_tokens))
    assert chosen == ["d0", "d2", "d0", "d2", "d0", "d1"]


def test_burst_herds_when_the_caller_records_no_incoming():
    # The failure the incoming field fixes: seen by arrived KV only, d0 looks least loaded
    # every time (d0/d2 tie at 0, d1 runs 2).
    queue, chosen = [], []
    for i in range(4):
        decodes = [decode("d0"), decode("d1", batch=2), decode("d2")]
        req = request(rid=f"b{i}")
        d = schedule(req, cluster([prefill("p0", tuple(queue))], decodes), index=BlockIndex(),
                     config=cfg(admission="early"), costs=COSTS, now=0.0)
        chosen.append(d.decode_id)
        queue.append(QueuedPrefill(req.request_id, req.num_tokens))
    assert chosen == ["d0"] * 4


def test_capacity_counts_incoming_but_the_decode_double_check_does_not():
    req = request()
    full = decode("d0", batch=1, max_batch_size=2, incoming=(IncomingRequest("x", 100),))
    assert run(cluster([prefill("p0")], [full]), "early").reject_cause == "no-decode"
    # The decode instance itself judges its running batch: the incoming one is not there yet.
    assert decode_admits(full, req, COSTS, tbt_slo_s=1.0)
    busy = decode("d0", batch=8, incoming=tuple(IncomingRequest(f"x{i}", 100) for i in range(5)))
    assert decode_admits(busy, req, COSTS, tbt_slo_s=0.1)


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
    # d0 is busy now but drains before we arrive; d1 has 1 running + 5 committed (6 < 7 now).
    jobs = queued(*[10] * 5)
    clus = cluster([prefill("p0", jobs)], [decode("d0", batch=7, joined_at=-10.0),
                                           decode("d1", batch=1, incoming=bound(*jobs))])
    assert run(clus, "early", uniform_decode_s=10.0).decode_id == "d1"
    assert run(clus, "predictive", uniform_decode_s=10.0).decode_id == "d0"


def test_started_prefill_finishing_soon_is_counted():
    # ours runs on p1 and ends at 0.1 s; x (committed to d0) with 10 ms left joins d0 first ->
    # batch 10 -> 0.11 s; with 500 ms left it joins after us and predictive does not count it.
    for started_at, predictive_ok in ((-0.99, False), (-0.5, True)):
        job = QueuedPrefill("x", 1000, started_at=started_at)
        clus = cluster([prefill("p0", (job,)), prefill("p1")],
                       [decode("d0", batch=8, incoming=bound(job))])
        assert run(clus, "predictive", uniform_decode_s=100).accepted is predictive_ok
        assert run(clus, "early", uniform_decode_s=100).reject_cause == "tbt"   # committed now


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
    d = DecodeInstanceState("d0", running=running, incoming=(IncomingRequest("x", 7),))
    for t in (0.0, 3.5, 5.0, 9.99, 12.0, 30.0, 12.0, 0.0):
        expected = [r.context_tokens for r in running if r.joined_at + 3.0 > t]
        assert decode_load_at(d, COSTS, t, t, None, 3.0) == (len(expected) + 1, sum(expected) + 7)   # x joins now
        x_queued = _queues_at(t, x=1000)                    # x's prefill ends 1 s after t
        assert decode_load_at(d, COSTS, t, t, x_queued, 3.0) == (len(expected), sum(expected))


def test_queue_time_cache_follows_now_while_a_job_runs():
    from mooncake_lite.scheduler import prefill_queue_time
    p = prefill("p0", (QueuedPrefill("x", 100, started_at=0.0), QueuedPrefill("y", 50)))
    assert prefill_queue_time(p, COSTS, 0.0) == pytest.approx(0.150)
    assert prefill_queue_time(p, COSTS, 0.04) == pytest.approx(0.110)
    assert prefill_queue_time(p, COSTS, 0.5) == pytest.approx(0.050)
    idle = prefill("p1", queued(30))
    assert prefill_queue_time(idle, COSTS, 0.0) == prefill_queue_time(idle, COSTS, 9.0) == pytest.approx(0.03)


def test_admission_judges_what_others_add_times_the_instances_measured_spread():
    # p0: 50 tokens queued (0.05 s) then ours (0.1 s): TTFT 0.15 s; d0: 4 running, ours at batch 5
    # steps 0.06 s, alone 0.02 s
    jobs = queued(50)
    d = run(cluster([prefill("p0", jobs, queue_spread=1.6)]), "predictive", ttft_slo_s=0.2)
    assert d.accepted and d.predicted_ttft_s == pytest.approx(0.15) and d.bound_ttft_s == pytest.approx(0.18)
    d = run(cluster([prefill("p0", jobs, queue_spread=2.2)]), "predictive", ttft_slo_s=0.2)
    assert not d.accepted and d.reject_cause == "ttft" and d.bound_ttft_s == pytest.approx(0.21)
    assert d.reason == "rejected: predicted TTFT 0.15s (bound by its measured spread 0.21s) > SLO 0.2s"
    # a spread below 1 (waits lately under the corrected model) admits nothing the central prediction
    # refuses: that prediction holds the queue's learned bias already (admission.bounds)
    assert not run(cluster([prefill("p0", jobs)]), "predictive", ttft_slo_s=0.14).accepted
    d = run(cluster([prefill("p0", jobs, queue_spread=0.6)]), "predictive", ttft_slo_s=0.14)
    assert not d.accepted and d.bound_ttft_s == d.predicted_ttft_s == pytest.approx(0.15)
    # the TBT's spread is measured but not judged (module doc of admission.bounds: measured, it refused
    # the wrong requests): the TBT bound is the prediction
    d = run(cluster([prefill("p0")], [decode("d0", batch=4, tbt_spread=2.5)]), "predictive", ttft_slo_s=1.0)
    assert d.accepted and d.predicted_tbt_s == pytest.approx(0.06) and d.bound_tbt_s == d.predicted_tbt_s
    # alone on idle instances a request is judged on its prediction whatever the spreads (never
    # locked out: one never admitted never measures the spread down); "none" judges nothing
    d = run(cluster([prefill("p0", queue_spread=16.0)], [decode("d0", tbt_spread=16.0)]), "predictive",
            ttft_slo_factor=1.0, tbt_slo_factor=1.0, ttft_slo_s=None, tbt_slo_s=None)
    assert d.accepted and d.bound_ttft_s == d.predicted_ttft_s and d.bound_tbt_s == pytest.approx(d.predicted_tbt_s)
    assert run(cluster([prefill("p0", jobs, queue_spread=9.0)], [decode("d0", 4, tbt_spread=9.0)]), "none").accepted


def test_the_tbt_predicted_is_the_step_times_the_tail_and_admission_judges_the_step():
    """A decode's tail (its TBT, the slowest tenth of gaps, over its mean gap: learned) turns the
    step foreseen into the TBT predicted; admission judges the step (scheduler._decision's note:
    judged with the tail, the simulator refused requests that would have met their SLO)."""
    plain = run(cluster([prefill("p0")], [decode("d0", batch=4)]), "predictive", ttft_slo_s=1.0, tbt_slo_s=0.07)
    tailed = run(cluster([prefill("p0")], [decode("d0", batch=4, tbt_tail=1.5)]), "predictive", ttft_slo_s=1.0,
                 tbt_slo_s=0.07)
    assert plain.accepted and tailed.accepted                 # a step of 0.06 s within 0.07 s either way
    assert plain.predicted_tbt_s == pytest.approx(0.06) and tailed.predicted_tbt_s == pytest.approx(0.09)
    assert tailed.bound_tbt_s == plain.bound_tbt_s == pytest.approx(0.06)
    assert not run(cluster([prefill("p0")], [decode("d0", batch=4, tbt_tail=1.5)]), "predictive", ttft_slo_s=1.0,
                   tbt_slo_s=0.05).accepted


def _queues_at(now: float, **num_tokens: int):
    """One FIFO prefill queue of unstarted jobs (1 ms per token, COSTS), as a decision reads it at ``now``."""
    from mooncake_lite.scheduler.estimate import queues_at
    from mooncake_lite.scheduler.cache import FromScratch
    jobs = tuple(QueuedPrefill(rid, n) for rid, n in num_tokens.items())
    return queues_at(FromScratch.backlogs([prefill("p0", jobs)], COSTS), now)


def test_an_incoming_request_counts_only_while_it_decodes():
    """§3's load at t: an incoming request joins when its prefill is predicted to end and leaves
    t_d later. A burst's earlier member, prefilled and decoded before t, is not in t's batch —
    counting it put a burst's tenth member's predicted TBT at a batch of ten."""
    from mooncake_lite.scheduler.estimate import decode_load_at
    stay = tuple(DecodingRequest(f"r{i}", 0, 0.0) for i in range(8))     # no max_tokens: there at any t
    d = DecodeInstanceState("d0", running=stay, incoming=(IncomingRequest("a", 50, max_output_tokens=10),
                                                          IncomingRequest("b", 70, max_output_tokens=10)),
                            tbt_s=0.09)               # beside the 8: a step of 0.1 s, t_d = 10 × 0.1 s = 1 s
    queues = _queues_at(0.0, a=1000, b=1500)          # a decodes over [1, 2), b over [2.5, 3.5)
    expected = {0.5: (0, 0), 1.0: (1, 50), 1.9: (1, 50), 2.0: (0, 0), 2.6: (1, 70), 3.5: (0, 0)}
    for t, (batch, context) in expected.items():
        assert decode_load_at(d, COSTS, 0.0, t, queues, None) == (8 + batch, context), t
    assert decode_load_at(d, COSTS, 0.0, 0.5, None, None) == (10, 120)    # in no queue: both joined now
    assert decode_load_at(d, COSTS, 0.0, 1.5, None, 3.0) == (10, 120)     # a uniform t_d of 3 s
    unknown = replace(d, incoming=(IncomingRequest("a", 50),))            # no max_tokens: never leaves
    assert decode_load_at(unknown, COSTS, 0.0, 100.0, queues, None) == (9, 50)
    # a request of n choices: choice 1 ("a#1") is queued under the request's id, so it joins with it
    second = replace(d, incoming=(IncomingRequest("a#1", 50, max_output_tokens=10),))
    assert decode_load_at(second, COSTS, 0.0, 0.5, queues, None) == (8, 0)
    assert decode_load_at(second, COSTS, 0.0, 1.5, queues, None) == (9, 50)
    # an idle decode (TBT 0): t_d is sized with the request's own step alone (COSTS: 0.02 s), 0.2 s
    idle = replace(d, running=(), tbt_s=0.0)
    assert decode_load_at(idle, COSTS, 0.0, 1.1, queues, None) == (1, 50)
    assert decode_load_at(idle, COSTS, 0.0, 1.25, queues, None) == (0, 0)


def test_an_incoming_request_decodes_beside_those_still_there_not_those_gone_by_then():
    """An incoming request's t_d is sized at the step of the running requests still decoding at
    t, not of the batch now: a long prompt's last few tokens, gone before a burst's short prompts
    joined, priced them a step 2-3x the one they ran at and refused them on the TBT (Zen 5, run 25b)."""
    from mooncake_lite.scheduler.estimate import decode_load_at
    leaving = tuple(DecodingRequest(f"r{i}", 0, 0.0, max_output_tokens=5) for i in range(8))   # gone at 0.45 s
    d = DecodeInstanceState("d0", running=leaving, incoming=(IncomingRequest("a", 50, max_output_tokens=10),),
                            tbt_s=0.09)
    queues = _queues_at(0.0, a=500)                   # a joins at 0.5 s
    # Now's step (0.09 s) would keep it to 1.4 s; alone (0.02 s a step) it is gone at 0.7 s.
    assert decode_load_at(d, COSTS, 0.0, 0.6, queues, None) == (1, 50)
    assert decode_load_at(d, COSTS, 0.0, 0.8, queues, None) == (0, 0)
    staying = replace(d, running=tuple(replace(r, max_output_tokens=None) for r in leaving))
    assert decode_load_at(staying, COSTS, 0.0, 1.4, queues, None) == (9, 50)   # beside the 8: 0.1 s a step
