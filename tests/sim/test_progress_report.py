"""The simulator's prefill reports its running job's end after the first chunk, as the live one's
heartbeat does (scheduler/progress.py): a decision made then prices that job by its true end,
not by the conductor's model of it."""

from __future__ import annotations

import pytest

from mooncake_lite.scheduler import PrefillCostModel, SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from tests.sim.helpers import req, toy_hardware


def _second_decision(chunk: int) -> tuple[float, float]:
    """A 3,000-token prompt at 0 (3 s on the hardware), a 100-token one at 1 s; the conductor's
    model prices tokens twice what they cost. Returns the second's (predicted TTFT, TTFT)."""
    cfg = SimConfig(num_prefill=1, num_decode=1, prefill_chunk=chunk, hardware="toy",
                    scheduler=SchedulerConfig(admission="none", ttft_slo_s=1e9, tbt_slo_s=1e9))
    sim = MooncakeSim(cfg, hardware=toy_hardware(prefill_per_token=1e-3))
    view = sim.prefills[0].view
    view.set_instance(view.state().store_id, None, PrefillCostModel(c1=2e-3))
    view.set_overtake_share(0.0, 0.0)
    sim.decisions = []
    res = sim.run([req(0, 0.0, 3000, 2), req(1, 1.0, 100, 2)])
    second = next(r for r in res.requests if r.request_id == 1)
    return sim.decisions[1].predicted_ttft_s, second.ttft


def test_a_job_run_chunk_by_chunk_is_priced_by_its_reported_end():
    predicted, ttft = _second_decision(chunk=512)
    assert ttft == pytest.approx(2.0 + 0.1)                   # 2 s of the long one left, then its own
    assert predicted == pytest.approx(2.0 + 0.2)              # the rest as reported, its own by the model
    # one pass (no chunk to report after): the model's 6 s less the 1 s run
    predicted, ttft = _second_decision(chunk=8192)
    assert ttft == pytest.approx(2.1) and predicted == pytest.approx(5.0 + 0.2)
