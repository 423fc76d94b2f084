"""The simulated decode's check at reservation judges what still decodes when the request's KV is
due (the decision's predicted TTFT), as the live decode does (``admission.held_load_at``)."""

from __future__ import annotations

import pytest

from mooncake_lite.scheduler import DecodeCostModel, SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.nodes import DecodeNode
from tests.sim.helpers import req, toy_hardware

# a step: 5 ms + 5 ms a sequence (10 ms alone); the decode's SLO 31 ms: batch 5 at most
HW = toy_hardware(decode=DecodeCostModel(c0=0.005, c1=0.005))


def run(trace):
    cfg = SimConfig(num_prefill=1, num_decode=1, scheduler=SchedulerConfig(admission="none", tbt_slo_s=0.031))
    return {r.request_id: r for r in MooncakeSim(cfg, hardware=HW).run(trace).requests}


def as_it_was(monkeypatch) -> None:
    """The check as it was: everything held counted as decoding together now."""
    refusal = DecodeNode.refusal
    monkeypatch.setattr(DecodeNode, "refusal", lambda self, r, slo, factor=None, now=0.0, kv_in_s=None:
                        refusal(self, r, slo, factor, now, None))


def refused(res) -> list[int]:
    return sorted(i for i, r in res.items() if r.reject_cause == "reserve-tbt")


def outcomes(res) -> dict:
    return {i: (r.status, r.reject_cause, r.decode_id, r.ttft, r.finish) for i, r in res.items()}


def test_a_burst_prefilled_one_after_another_is_admitted(monkeypatch):
    # ten at once, 1 s of prefill each, then 32 tokens in 0.32 s: never two decoding together
    burst = [req(i, 0.0, 1000, 32) for i in range(10)]
    after = run(burst)
    assert refused(after) == [] and all(r.status == "completed" for r in after.values())
    assert max(r.tbt for r in after.values()) == pytest.approx(0.01)    # each decoded alone
    as_it_was(monkeypatch)
    assert refused(run(burst)) == [5, 6, 7, 8, 9]                        # judged at batch 6 to 10


def test_members_that_overlap_are_counted_together(monkeypatch):
    # 600 tokens: 6 s or more of decode each, so the sixth is due beside the five before it
    burst = [req(i, 0.0, 1000, 600) for i in range(10)]
    assert refused(run(burst)) == [5, 6, 7, 8, 9]
    as_it_was(monkeypatch)
    assert refused(run(burst)) == [5, 6, 7, 8, 9]


def test_the_same_outcomes_where_nothing_waits_beside_another(monkeypatch):
    trace = [req(i, 1.5 * i, 1000 + 10 * i, 20 + i) for i in range(12)]
    after = outcomes(run(trace))
    as_it_was(monkeypatch)
    assert outcomes(run(trace)) == after
