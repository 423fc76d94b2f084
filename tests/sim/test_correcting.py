"""The simulator corrects online as the live conductor does (issue #36, ``sim/correcting.py``):
the same rule (``scheduler/correction.py``) fed by the simulated requests. On a shortest-first
prefill the worst-case overtake allowance over-predicts most requests' TTFT; the learned share
brings the prediction to what the queue does."""

from __future__ import annotations

import random
import statistics

from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from tests.sim.helpers import req, toy_hardware


def _bursts(num_bursts: int = 12, size: int = 8) -> list:
    rng = random.Random(7)
    return [req(b * size + i, b * 20.0, rng.randrange(200, 3000), 4) for b in range(num_bursts) for i in range(size)]


def _run(correct: bool):
    cfg = SimConfig(num_prefill=1, num_decode=1, prefill_queue_overtakes=4, correct=correct, hardware="toy",
                    scheduler=SchedulerConfig(admission="none", ttft_slo_s=1e9, tbt_slo_s=1e9))
    sim = MooncakeSim(cfg, hardware=toy_hardware(prefill_per_token=1e-3))
    sim.decisions = []
    res = sim.run(_bursts())
    predicted = [d.predicted_ttft_s for d in sim.decisions]     # one a request, in arrival (= id) order
    done = sorted(res.requests, key=lambda r: r.request_id)
    errors = [abs(r.ttft / predicted[r.request_id] - 1) for r in done]
    return sim, errors


def test_the_simulator_learns_the_overtake_share_and_predicts_closer():
    plain, before = _run(False)
    sim, after = _run(True)
    assert plain.correcting is None and len(before) == len(after) == 96
    share = sim.correcting.corrections.overtake_share("P0")
    assert 0.0 < share < 0.9                       # jobs met a share of the worst case, not all of it
    assert sim.prefills[0].view.state().overtake_share == share or abs(
        sim.prefills[0].view.state().overtake_share - share) < 1 / 32
    # the first burst is priced alike; past it the corrected predictions are closer
    assert statistics.median(after[8:]) < 0.75 * statistics.median(before[8:])
    # the simulated hardware is the model: no compute factor worth showing
    assert abs(sim.correcting.corrections.compute_scale("P0") - 1.0) < 1 / 32
