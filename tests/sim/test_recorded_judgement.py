"""A refusal judged on the instance's own record of its waiting list (``bench/fidelity/recorded.py``):
the order is the instance's, not one guessed from the client's send times. The case the record
settles (docs/results/2026-12-01-zen3-admission.md §5): a long job's burst-mate sent just after it
and served before it was placed before it by the conductor (shortest first: no overtake) — the
client's clock cannot tell that from a pass."""

from __future__ import annotations

import pytest

from mooncake_lite.bench.fidelity.anchored import live_anchor
from mooncake_lite.bench.fidelity.recorded import arrival_lag, landed, placed, turn_lead
from mooncake_lite.bench.replay.metrics import RequestRecord
from mooncake_lite.scheduler.waiting import FREE, GRANT, LAND

LAG = 0.01    # a forward's end to the client's first token


def predict(tokens: int, prefix: int = 0) -> float:
    return 0.1 + 1e-3 * (tokens - prefix)


def served_in_turn(events: list, tokens: dict, order: tuple) -> tuple[list, dict]:
    """Serve ``order`` one after another from 0.001 (the first already granted in ``events``): each
    turn and forward appended, each first token ``LAG`` after its forward; (forwards, first tokens)."""
    forwards, firsts, t = [], {}, 0.001
    for k in order:
        if k != order[0]:
            events.append((t, GRANT, f"cmpl-{k}", 0, False))
        forwards.append([t, t + predict(tokens[k])])
        t += predict(tokens[k])
        firsts[k] = t + LAG
        events.append((t, FREE, "", 0, False))
    return forwards, firsts


def _run():
    """Job 0 (1,000 tokens) runs from 0.001; Y (2,000) and a (20), sent just after it, form a burst
    the conductor placed shortest first: a lands first. b (20), sent later, passes Y. Served a, b, Y."""
    sends = {"0": 0.0, "Y": 0.1, "a": 0.1002, "b": 0.3}
    tokens = {"0": 1000, "a": 20, "Y": 2000, "b": 20}
    events = [(0.001, LAND, "cmpl-0", 1000, False), (0.001, GRANT, "cmpl-0", 0, False)]
    events += [(at, LAND, f"cmpl-{k}", tokens[k], False) for k, at in (("a", 0.1012), ("Y", 0.1013), ("b", 0.301))]
    forwards, firsts = served_in_turn(events, tokens, ("0", "a", "b", "Y"))
    ids = {k: i for i, k in enumerate(sends)}
    records = [RequestRecord(ids[k], sends[k], sends[k], chunk_s=(firsts[k], firsts[k] + 0.1), status=200,
                             cached_tokens=0, completion_id=f"cmpl-{k}") for k in sends]
    records.append(RequestRecord(9, 0.5, 0.5, status=429))
    lengths = {ids[k]: n for k, n in tokens.items()} | {9: 50}
    return records, lengths, events, forwards, firsts


def test_the_record_tells_a_burst_mate_that_came_first_from_one_that_passed():
    records, lengths, events, forwards, firsts = _run()
    guessed = live_anchor(records, lengths, {"p": {"forwards": forwards}}, predict, 2)([(9, 50, 0)])[9]
    told = live_anchor(records, lengths, {"p": {"forwards": forwards, "turns": events}}, predict, 2)([(9, 50, 0)])[9]
    # the guess counts both 20-token jobs as passes of Y (sent after it, served before it): bound
    # 2 spent, it waits for Y
    assert guessed == pytest.approx(firsts["Y"] - LAG - 0.5 + predict(50) + LAG)
    # the record: only b passed Y; the refused request passes Y too, behind b
    assert told == pytest.approx(firsts["b"] - LAG - 0.5 + predict(50) + LAG)


def test_its_landing_is_estimated_from_the_admitted_ones():
    records, _, events, forwards, _ = _run()
    ids = {r.completion_id: r.request_id for r in records if r.completion_id}
    sends = {r.request_id: r.send_s for r in records}
    land = landed(events + [(9.0, LAND, "cmpl-a-retry1", 20, False)], ids)   # a retry: its first landing kept
    assert land[ids["cmpl-a"]] == (2, pytest.approx(0.1012), 20)
    assert arrival_lag(land, sends) == pytest.approx(0.001) and turn_lead(events, forwards) == pytest.approx(0.0)
    # in Y's burst: longer than a, shorter than Y: it lands just before Y, whatever its send time
    assert placed(events, land, sends, 0.0995, 100, 0.001, 0.02).index == 3
    assert placed(events, land, sends, 0.0995, 3000, 0.001, 0.02).index == 4    # after Y, the last shorter
    assert placed(events, land, sends, 0.5, 50, 0.001, 0.02).at_s == pytest.approx(0.501)   # alone


def test_a_refusal_lands_where_the_conductor_placed_it_when_it_says():
    """Live 36a-1 at t = 345 s: the conductor took a burst in two (a busy box accepted its HTTP
    requests over more than the window): four admitted prompts took a long waiting job's last
    overtakes, then a shorter one was refused. By send time it would have passed the long job; its
    ``X-Mooncake-Placed`` puts it behind the four, and so behind the long job."""
    sends = {"0": 0.0, "L": 0.01, **{f"a{i}": 0.5 for i in range(4)}}
    tokens = {"0": 1000, "L": 3000, **{f"a{i}": 100 for i in range(4)}}
    events = [(0.001, LAND, "cmpl-0", 1000, False), (0.001, GRANT, "cmpl-0", 0, False),
              (0.011, LAND, "cmpl-L", 3000, False)]
    events += [(0.55, LAND, f"cmpl-a{i}", 100, False) for i in range(4)]
    forwards, firsts = served_in_turn(events, tokens, ("0", "a0", "a1", "a2", "a3", "L"))
    ids = {k: i for i, k in enumerate(sends)}
    records = [RequestRecord(ids[k], sends[k], sends[k], chunk_s=(firsts[k], firsts[k] + 0.1), status=200,
                             cached_tokens=0, completion_id=f"cmpl-{k}", num_placed=n + 1)
               for n, k in enumerate(sends)]
    lengths = {ids[k]: n for k, n in tokens.items()} | {9: 37}
    timelines = {"p": {"forwards": forwards, "turns": events}}
    by_send = [*records, RequestRecord(9, 0.5, 0.5, status=429)]
    assert live_anchor(by_send, lengths, timelines, predict, 4, 0.02)([(9, 37, 0)])[9] == pytest.approx(
        firsts["0"] - 0.5 + predict(37))                               # ahead of the four and of L
    numbered = [*records, RequestRecord(9, 0.5, 0.5, status=429, num_placed=len(sends))]
    assert live_anchor(numbered, lengths, timelines, predict, 4, 0.02)([(9, 37, 0)])[9] == pytest.approx(
        firsts["L"] - 0.5 + predict(37))                               # behind L, which had none left


def test_a_refusal_placed_first_of_a_later_burst_lands_at_its_own_time():
    """Its number says only that it came after request 1, which ran and ended long before it was
    sent: it lands at its own send time (plus the usual lag), on an idle instance."""
    end = 0.001 + predict(1000)
    events = [(0.001, LAND, "cmpl-x", 1000, False), (0.001, GRANT, "cmpl-x", 0, False), (end, FREE, "", 0, False)]
    records = [RequestRecord(0, 0.0, 0.0, chunk_s=(end + LAG, end + 0.1), status=200, cached_tokens=0,
                             completion_id="cmpl-x", num_placed=1),
               RequestRecord(9, 5.0, 5.0, status=429, num_placed=1)]
    timelines = {"p": {"forwards": [[0.001, end]], "turns": events}}
    ttft = live_anchor(records, {0: 1000, 9: 37}, timelines, predict, 4)([(9, 37, 0)])[9]
    assert ttft == pytest.approx(0.001 + predict(37) + LAG)      # the lag to landing, its forward, the lag after


def test_a_refusal_takes_its_place_in_the_conductor_s_order_when_its_burst_arrives_out_of_it():
    """Live 40a-2 at t = 225 s: two long jobs waiting, a burst placed a, b, c, d (short: the four
    passes each long job allows) then e (832 tokens), reaching the instance as a, c, b, e, d; a
    351-token prompt refused right after d. The instance lands them in placed order: d takes the
    last passes, e waits behind the long jobs, and so would the refused one. Landed by event
    order alone, before e and d arrived, it took d's pass."""
    sends = {"0": 0.0, "L": 0.01, "M": 0.012, "a": 0.5, "b": 0.5, "c": 0.5, "d": 0.5, "e": 0.5}
    tokens = {"0": 1000, "L": 2500, "M": 3000, "a": 12, "b": 12, "c": 51, "d": 182, "e": 832}
    number = {k: n + 1 for n, k in enumerate(sends)}
    events = [(0.001, LAND, "cmpl-0", 1000, False, ["c0", 1]), (0.001, GRANT, "cmpl-0", 0, False, None),
              (0.011, LAND, "cmpl-L", 2500, False, ["c0", 2]), (0.013, LAND, "cmpl-M", 3000, False, ["c0", 3])]
    events += [(0.55 + i * 1e-4, LAND, f"cmpl-{k}", tokens[k], False, ["c0", number[k]])
               for i, k in enumerate("acbed")]
    forwards, firsts = served_in_turn(events, tokens, ("0", "a", "b", "c", "d", "L", "M", "e"))
    ids = {k: i for i, k in enumerate(sends)}
    records = [RequestRecord(ids[k], sends[k], sends[k], chunk_s=(firsts[k], firsts[k] + 0.1), status=200,
                             cached_tokens=0, completion_id=f"cmpl-{k}", num_placed=number[k]) for k in sends]
    records.append(RequestRecord(9, 0.5, 0.5, status=429, num_placed=number["d"]))
    lengths = {ids[k]: n for k, n in tokens.items()} | {9: 351}
    timelines = {"p": {"forwards": forwards, "turns": events}}
    ttft = live_anchor(records, lengths, timelines, predict, 4, 0.02)([(9, 351, 0)])[9]
    assert ttft == pytest.approx(firsts["M"] - LAG - 0.5 + predict(351) + LAG)    # behind L and M, before e
