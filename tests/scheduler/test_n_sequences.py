"""A request of n choices (OpenAI's ``n``, ``ScheduleRequest.num_sequences``) is priced on its
decode as the n sequences it becomes: n more in the batch, each attending to the prompt, the
prompt's KV once and each one's output; the relative TBT SLO is that of the n alone. Decode steps
here cost 10 ms + 10 ms per sequence (tests/scheduler/clusters.py), the prompt is 100 tokens."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mooncake_lite.scheduler import BlockIndex, schedule
from tests.scheduler.clusters import COSTS, cfg, cluster, decode, prefill, request


def run(clus, n: int, **kw):
    req = dataclasses.replace(request(), num_sequences=n)
    return schedule(req, clus, index=BlockIndex(), config=cfg(**kw), costs=COSTS, now=0.0,
                    rng=random.Random(0))


@pytest.mark.parametrize("admission", ["early", "predictive"])
def test_n_sequences_join_the_batch_as_n(admission):
    clus = cluster([prefill("p0")], [decode("d0", batch=5)])
    assert run(clus, 1, admission=admission).predicted_tbt_s == pytest.approx(0.07)
    four = run(clus, 4, admission=admission)
    assert four.accepted and four.predicted_tbt_s == pytest.approx(0.10)
    five = run(clus, 5, admission=admission)   # 5 + 5 sequences: 0.11 s > the 0.1 s SLO
    assert not five.accepted and five.reject_cause == "tbt"


@pytest.mark.parametrize("strategy", ["kvcache-centric", "random"])
def test_room_counts_n_sequences_and_their_outputs_over_one_shared_prompt(strategy):
    small = decode("small", max_batch_size=3)              # room for 3 sequences
    busy = decode("busy", batch=2, context_each=10)
    clus = cluster([prefill("p0")], [small, busy])
    assert run(clus, 1, strategy=strategy, admission="none").decode_id in ("small", "busy")
    assert run(clus, 4, strategy=strategy, admission="none").decode_id == "busy"
    # 100 prompt tokens + 16 output each: one sequence needs 116, four 164 (not 4 x 116)
    tight = cluster([prefill("p0")], [decode("d0", max_context_tokens=170)])
    assert run(tight, 4, strategy=strategy, admission="none").accepted
    assert run(tight, 5, strategy=strategy, admission="none").reject_cause == "no-decode"


def test_the_relative_tbt_slo_is_that_of_the_n_sequences_alone():
    idle = cluster([prefill("p0")], [decode("d0")])
    d = run(idle, 4, tbt_slo_s=None, tbt_slo_factor=1.5)
    # alone: 4 sequences, 0.05 s a step; without counting them the limit was 1.5 x 0.02 s
    assert d.accepted and d.predicted_tbt_s == pytest.approx(0.05)
