"""The decode's own TBT check judges the sequences still decoding when the new request's KV is due
(``admission.held_load_at``), by the conductor's rule for the decode load at t (``loads_at``).

Decode step (tests/scheduler/clusters.py): 10 ms + 10 ms a sequence, so alone 20 ms."""

import pytest

from mooncake_lite.scheduler import DecodeInstanceState, DecodingRequest, IncomingRequest
from mooncake_lite.scheduler.admission import held_load_at, tbt_refusal
from mooncake_lite.scheduler.estimate import backlog_of, decode_load_at, prefill_ends, queues_at
from tests.scheduler.clusters import COSTS, prefill, queued

MODEL = COSTS.decode


def burst(num: int, prompt: int, max_output: int) -> tuple[DecodeInstanceState, dict[str, float], object]:
    """``num`` requests prefilled one after another (``prompt`` ms each) and committed to one
    decode: the decode as the conductor sees it, when each prefill ends, and the queues at 0."""
    jobs = queued(*[prompt] * num)
    queues = queues_at([backlog_of(prefill("p0", jobs), COSTS.prefill)], 0.0)
    d = DecodeInstanceState("d0", incoming=tuple(IncomingRequest(j.request_id, prompt, max_output) for j in jobs))
    return d, prefill_ends(queues, 0.0), queues


def test_a_burst_prefilled_one_after_another_is_not_counted_together():
    # 9 reserved, joining at 0.5 s, 1.0 s, ...; 10 tokens at 20 ms each: gone 0.2 s after joining
    d, ends, _ = burst(9, 500, 10)
    held = [(ends[r.request_id], 10, 500) for r in d.incoming]
    assert held_load_at(held, MODEL, 0.0, 5.0) == (0, 0)         # the tenth joins at 5 s: alone
    assert held_load_at(held, MODEL, 0.0, 4.6) == (1, 500)       # the ninth decodes 4.5 s to 4.7 s
    assert held_load_at(held, MODEL, 0.0, 0.1) == (0, 0)         # none has joined yet
    # when the new request joins is unknown: everything held, as if all decoded together now
    assert held_load_at(held, MODEL, 0.0, None) == (9, 4500)
    assert tbt_refusal(MODEL, 9, 4500, 500, 0.05) is not None
    assert tbt_refusal(MODEL, *held_load_at(held, MODEL, 0.0, 5.0), 500, 0.05) is None


def test_members_that_overlap_are_counted():
    d, ends, _ = burst(9, 500, 100)                               # 100 tokens: 2 s each, at least
    held = [(ends[r.request_id], 100, 500) for r in d.incoming]
    assert held_load_at(held, MODEL, 0.0, 5.05) == (3, 1500)      # joined at 3.5, 4.0, 4.5 s
    # a sequence that joins by now decodes from now, priced at the step of all that have joined
    running = [(-3.0, 5, 100), (0.0, 5, 100), (0.0, 5, 100)]      # 40 ms a step: 5 tokens, 0.2 s
    assert held_load_at(running, MODEL, 0.0, 0.19) == (3, 300)
    assert held_load_at(running, MODEL, 0.0, 0.21) == (0, 0)
    late = [(-1.0, 10, 100)]                                      # its KV was due 1 s ago: joins now
    assert held_load_at(late, MODEL, 0.0, 0.19) == (1, 100)


def test_one_still_to_join_decodes_beside_those_still_there_at_t():
    # three running, 40 ms a step, gone at 0.2 s; one joining at 0.3 s decodes alone (20 ms a
    # step): 10 tokens, gone at 0.5 s, not at 0.7 s as at the step of the batch now
    held = [(0.0, 5, 100)] * 3 + [(0.3, 10, 100)]
    assert held_load_at(held, MODEL, 0.0, 0.45) == (1, 100)
    assert held_load_at(held, MODEL, 0.0, 0.55) == (0, 0)


@pytest.mark.parametrize("t", [0.0, 0.3, 0.55, 1.0, 1.2, 2.6, 4.51, 5.0, 7.5, 30.0])
def test_the_same_rule_as_the_conductors_load_at_t(t):
    # Running requests that joined now, and a burst committed with its prefills queued: the decode's
    # triples give what loads_at predicts for the same requests at every t.
    d, ends, queues = burst(9, 500, 30)
    running = tuple(DecodingRequest(f"r{i}", 100 + 10 * i, 0.0, 20 + 20 * i) for i in range(3))
    d = DecodeInstanceState("d0", running=running, incoming=d.incoming)
    held = [(0.0, r.max_output_tokens, r.context_tokens) for r in running]
    held += [(ends[r.request_id], r.max_output_tokens, r.context_tokens) for r in d.incoming]
    assert held_load_at(held, MODEL, 0.0, t) == decode_load_at(d, COSTS, 0.0, t, queues, None)


def test_n_choices_join_together_and_are_judged_as_n():
    held = [(1.0, 40, 100)] * 3                                   # one request of 3 choices, due at 1 s
    assert held_load_at(held, MODEL, 0.0, 1.5) == (3, 300)
    # n more sequences, against the SLO factor x the n alone (the conductor's relative SLO)
    assert tbt_refusal(MODEL, 0, 0, 100, None, 2.0, n=4) is None  # 50 ms alone: batch 4 is it
    assert tbt_refusal(MODEL, 3, 300, 100, None, 2.0, n=4) is None    # 80 ms <= 2 x 50 ms
    reason = tbt_refusal(MODEL, 6, 600, 100, None, 2.0, n=4)          # 110 ms
    assert reason is not None and "with batch 10 exceeds the TBT SLO 100.00 ms" in reason
