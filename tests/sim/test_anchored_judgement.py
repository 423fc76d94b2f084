"""A refusal judged on live's own timeline (``bench/fidelity/anchored.py``): the refused request
joins the queue live had when it arrived (the job in progress, the waiting jobs it may pass under
the overtake bound, the later shorter arrivals that pass it), and its own forward is the model's
× live's measured ratio. The seam it exists for: a burst that arrives while a long prompt runs
waits for it, whatever the simulator's timeline says."""

from __future__ import annotations

import pytest

from mooncake_lite.bench.fidelity import admission
from mooncake_lite.bench.fidelity.admission import Outcome
from mooncake_lite.bench.fidelity.anchored import Packing, anchored_ttfts, compute_scale, jobs_of
from mooncake_lite.bench.fidelity.report import admission_lines
from mooncake_lite.trace.format import TraceRequest

LAG = 0.01


def predict(tokens: int, prefix: int = 0) -> float:
    """A model of 0.1 s + 1 ms a token computed."""
    return 0.1 + 1e-3 * (tokens - prefix)


def served(rid: int, send: float, start: float, tokens: int) -> tuple[tuple, list[float]]:
    """An admitted request whose one forward ran from ``start`` for exactly the model's time."""
    end = start + predict(tokens)
    return (rid, send, end + LAG, tokens, 0), [start, end]


def timeline(*jobs):
    return [j for j, _ in jobs], {"p0": [f for _, f in jobs]}


def test_a_request_refused_during_a_long_forward_waits_for_it():
    s, fw = timeline(served(0, 0.0, 0.0, 9000))                 # 9.1 s of forward, from 0
    ttft = anchored_ttfts([(1, 1.0, 50, 0)], s, fw, predict, bound=4)[1]
    assert ttft == pytest.approx(9.1 - 1.0 + predict(50) + LAG)
    ttft = anchored_ttfts([(2, 9.5, 50, 0)], s, fw, predict, bound=4)[2]   # after it: alone
    assert ttft == pytest.approx(predict(50) + LAG)


def test_it_passes_longer_waiting_jobs_but_not_one_with_no_overtake_left():
    # 0 runs; 1 (2,000 tokens) waits. A request of 50 arriving at 0.5 lands before 1.
    s, fw = timeline(served(0, 0.0, 0.0, 1000), served(1, 0.1, 1.1, 2000))
    assert anchored_ttfts([(9, 0.5, 50, 0)], s, fw, predict, 4)[9] == pytest.approx(1.1 - 0.5 + predict(50) + LAG)
    # with FIFO (bound 0) it waits for 1 too
    assert anchored_ttfts([(9, 0.5, 50, 0)], s, fw, predict, 0)[9] == pytest.approx(3.2 - 0.5 + predict(50) + LAG)
    # a later, shorter arrival (2, sent 0.3) that live served after 1: 1 had no overtake left, so
    # the request waits for 1 (and passes 2)
    s2, fw2 = timeline(served(0, 0.0, 0.0, 1000), served(1, 0.1, 1.1, 2000), served(2, 0.3, 3.2, 100))
    assert anchored_ttfts([(9, 0.5, 50, 0)], s2, fw2, predict, 4)[9] == pytest.approx(
        3.2 - 0.5 + predict(50) + LAG)


def test_later_shorter_arrivals_pass_it_up_to_the_bound():
    # 0 runs to 1.1; 1 and 2 (10 tokens each) arrive after the refused one, before it would start
    s, fw = timeline(served(0, 0.0, 0.0, 1000), served(1, 0.6, 1.1, 10), served(2, 0.7, 1.21, 10))
    ends = {1: 1.1 + predict(10), 2: 1.21 + predict(10)}
    assert anchored_ttfts([(9, 0.5, 50, 0)], s, fw, predict, 4)[9] == pytest.approx(
        ends[2] - 0.5 + predict(50) + LAG)
    assert anchored_ttfts([(9, 0.5, 50, 0)], s, fw, predict, 1)[9] == pytest.approx(
        ends[1] - 0.5 + predict(50) + LAG)


def test_the_shorter_members_of_its_burst_were_placed_before_it_and_took_the_overtakes():
    """Live z34a-2 (docs/results/2026-12-01-zen3.md §9): a burst's four short prompts, decided
    before a 90-token one within the burst window, took the last overtakes of the long prompts
    waiting; the 90-token one would have waited for them, not passed them."""
    short = [served(1 + i, 0.5001 + 1e-4 * i, 1.1 + 0.2 * i, 10 + 10 * i) for i in range(4)]
    y_start = 1.1 + 0.2 * 4
    s, fw = timeline(served(0, 0.0, 0.0, 1000), served(5, 0.1, y_start, 2000), *short)
    refused = [(9, 0.5, 90, 0)]
    waited = anchored_ttfts(refused, s, fw, predict, 4, window_s=0.02)[9]
    assert waited == pytest.approx(y_start + predict(2000) - 0.5 + predict(90) + LAG)
    # placed as it came (no window): it lands before the long one, behind the four
    alone = anchored_ttfts(refused, s, fw, predict, 4)[9]
    assert alone == pytest.approx(short[-1][0][2] - LAG - 0.5 + predict(90) + LAG)


def test_the_longer_members_of_its_burst_sent_just_before_it_were_placed_after_it():
    """Live 35d-1 (docs/results/2026-12-01-zen3-admission.md §5): two prompts of a burst, longer
    than a 28-token one and sent a millisecond before it, passed a long waiting prompt in live's
    order and took its last overtakes. The conductor placed the burst shortest first: the 28-token
    one passed the long prompt before them."""
    t = 1.1
    early = []
    for i in range(2):                                     # two 20-token arrivals pass the long one first
        early.append(served(2 + i, 0.2 + 0.01 * i, t, 20))
        t = early[-1][1][1] + 0.001
    longer = []
    for i in range(2):                                     # then the burst's two 130-token members
        longer.append(served(4 + i, 0.499 + 1e-4 * i, t, 130))
        t = longer[-1][1][1] + 0.001
    s, fw = timeline(served(0, 0.0, 0.0, 1000), served(1, 0.1, t, 2000), *early, *longer)
    refused = [(9, 0.5, 28, 0)]
    # shortest first: it passes the two longer ones and the long prompt (2 overtakes taken of 4)
    placed_first = anchored_ttfts(refused, s, fw, predict, 4, window_s=0.02)[9]
    assert placed_first == pytest.approx(early[-1][1][1] - 0.5 + predict(28) + LAG)
    # taken in send order (no window), the longer two take the last overtakes: it waits for it
    in_order = anchored_ttfts(refused, s, fw, predict, 4)[9]
    assert in_order == pytest.approx(t + predict(2000) - 0.5 + predict(28) + LAG)


def test_its_own_forward_is_the_model_times_lives_ratio():
    jobs = [(i, 10.0 * i, 10.0 * i + 2 * predict(100) + LAG, 100, 0) for i in range(5)]
    fw = {"p0": [[10.0 * i, 10.0 * i + 2 * predict(100)] for i in range(5)]}   # live 2x the model
    found, lag = jobs_of(jobs, fw)
    assert compute_scale(found, predict) == pytest.approx(2.0) and lag == pytest.approx(LAG)
    assert anchored_ttfts([(9, 55.0, 300, 0)], jobs, fw, predict, 4)[9] == pytest.approx(2 * predict(300) + LAG)
    assert compute_scale(found[:4], predict) == 1.0     # too few to measure


PACKS = Packing(512, 0.1)      # a pack holds 512 uncached tokens; a member saves the model's 0.1 s fixed


def long_then_pack(a: int, b: int):
    """A 2,000-token job from 0 to 2.1 s; prompts of ``a`` and ``b`` tokens, sent at 0.5 and 0.6 s
    while it ran, served after it as one pack (the model's times, its fixed cost once)."""
    long = served(0, 0.0, 0.0, 2000)
    pack_end = 2.1 + predict(a) + predict(b) - 0.1
    s = [long[0], (1, 0.5, pack_end + LAG, a, 0), (2, 0.6, pack_end + LAG, b, 0)]
    return s, {"p0": [long[1], [2.1, pack_end]]}, pack_end


def test_it_leads_the_pack_live_served_next_and_ends_with_it():
    s, fw, pack_end = long_then_pack(200, 150)
    alone = anchored_ttfts([(9, 1.0, 50, 0)], s, fw, predict, 4)[9]
    assert alone == pytest.approx(2.1 - 1.0 + predict(50) + LAG)        # packing left out
    packed = anchored_ttfts([(9, 1.0, 50, 0)], s, fw, predict, 4, packing=PACKS)[9]
    assert packed == pytest.approx(pack_end - 1.0 + predict(50) - 0.1 + LAG)   # live's pack, and its tokens
    # room for one beside it: it leads a pack with the 150 (cut shortest first), priced by the model
    part = anchored_ttfts([(9, 1.0, 100, 0)], s, fw, predict, 4, packing=Packing(300, 0.1))[9]
    assert part == pytest.approx(2.1 - 1.0 + predict(100) + predict(150) - 0.1 + LAG)
    # sent before the two were placed, its decision priced it alone: its cap keeps them out
    early = anchored_ttfts([(9, 0.4, 50, 0)], s, fw, predict, 4, packing=PACKS)[9]
    assert early == pytest.approx(2.1 - 0.4 + predict(50) + LAG)
    # the conductor's placed numbers, where they are known, say who came before it, not the send times
    placed = anchored_ttfts([(9, 0.4, 50, 0)], s, fw, predict, 4, packing=PACKS, numbers={1: 1, 2: 2, 9: 2})[9]
    assert placed == pytest.approx(pack_end - 0.4 + predict(50) - 0.1 + LAG)
    # a prompt over the bound runs alone, chunked
    assert anchored_ttfts([(9, 1.0, 600, 0)], s, fw, predict, 4, packing=PACKS)[9] == pytest.approx(
        anchored_ttfts([(9, 1.0, 600, 0)], s, fw, predict, 4)[9])


def test_it_joins_a_pack_that_formed_after_it_came_with_room_for_it():
    s, fw, pack_end = long_then_pack(30, 40)      # both shorter than it: they land ahead of it
    # without packing it waits for the pack of the two shorter ones, then runs alone
    alone = anchored_ttfts([(9, 1.0, 100, 0)], s, fw, predict, 4)[9]
    assert alone == pytest.approx(pack_end - 1.0 + predict(100) + LAG)
    joined = anchored_ttfts([(9, 1.0, 100, 0)], s, fw, predict, 4, packing=PACKS)[9]
    assert joined == pytest.approx(pack_end - 1.0 + predict(100) - 0.1 + LAG)    # in it: sooner
    # sent after that pack formed, it could not join it
    late = anchored_ttfts([(9, 2.2, 100, 0)], s, fw, predict, 4, packing=PACKS)[9]
    assert late == pytest.approx(pack_end - 2.2 + predict(100) + LAG)


def _trace():
    return [TraceRequest(0, 0.0, 200, 4, (1,)), TraceRequest(1, 1000.0, 50, 4, (2,)),
            TraceRequest(2, 2000.0, 50, 4, (3,))]


def test_judge_counts_a_refusal_by_both_judges_and_the_spread_alone():
    limits = lambda t: (1.0, 1.0)        # noqa: E731
    live = {0: Outcome("ok", 0.5, 0.01),
            1: Outcome("rejected", predicted_ttft_s=0.8, bound_ttft_s=1.2),     # on the spread alone
            2: Outcome("rejected", predicted_ttft_s=3.0, bound_ttft_s=3.6)}
    simulated = lambda reqs: {t.request_id: Outcome("ok", 0.3, 0.01) for t in reqs}   # noqa: E731 (idle)
    waited = lambda refused: {i: (0.9 if i == 1 else 2.5) for i, _, _ in refused}       # noqa: E731
    out = admission.judge(_trace(), live, limits, simulated, waited)
    assert out["refused_would_meet_ids"] == [1, 2]                 # the simulator's: both
    assert out["refused_would_meet_anchored_ids"] == [1]           # live's timeline: 2 waited
    a = out["refused_would_meet_anchored"]
    assert (a["met"], a["of"], a["goal_met"]) == (1, 2, False)
    assert out["refused_on_spread"] == {"of": 2, "ids": [1], "would_meet": 1}
    text = "\n".join(admission_lines(out))
    assert "TTFT on live's timeline): 1/2" in text and "spread alone (central TTFT under its SLO): 1 of 2" in text
    # the simulator's TBT still judges: a TBT miss there is a miss by both
    slow = lambda reqs: {t.request_id: Outcome("ok", 0.3, 5.0) for t in reqs}   # noqa: E731
    assert admission.judge(_trace(), live, limits, slow, waited)["refused_would_meet_anchored_ids"] == []


def test_the_live_anchor_reads_the_clients_records_and_the_instances_timelines():
    from mooncake_lite.bench.fidelity.anchored import live_anchor
    from mooncake_lite.bench.replay.metrics import RequestRecord
    end = predict(9000)
    records = [RequestRecord(0, 0.0, 0.0, chunk_s=(end + LAG, end + 0.1), status=200, cached_tokens=0),
               RequestRecord(1, 1.0, 1.0, status=429)]
    timelines = {"http://p0": {"forwards": [[0.0, end]]}, "http://d0": {"steps": [[end, 0.05, 1, 9000, 1, 9000]]}}
    anchor = live_anchor(records, {0: 9000, 1: 50}, timelines, predict, 4)
    assert anchor([(1, 50, 0)]) == {1: pytest.approx(end - 1.0 + predict(50) + LAG)}
