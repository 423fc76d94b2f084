"""A burst's forwards priced as the burst left them (``scheduler.arrivals.burst_shifts``, in the
simulator's ``_reprice``): members decided early share their pack with the later ones, and are
predicted to end with it."""

from __future__ import annotations

import random

from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from tests.sim.helpers import req, toy_hardware


def _run(correct: bool = False):
    """Each 20 s: a long prompt that starts alone, then a burst of six short ones 0.1 s later (the
    prefill busy: held 20 ms, decided shortest first, packed up to 512 tokens)."""
    rng = random.Random(3)
    trace = []
    for b in range(6):
        trace.append(req(b * 7, b * 20.0, 1000, 4))
        trace += [req(b * 7 + i, b * 20.0 + 0.1, rng.randrange(30, 160), 4) for i in range(1, 7)]
    cfg = SimConfig(num_prefill=1, num_decode=1, prefill_queue_overtakes=4, prefill_batch_tokens=512,
                    burst_window_s=0.02, correct=correct, hardware="toy",
                    scheduler=SchedulerConfig(admission="none", ttft_slo_s=1e9, tbt_slo_s=1e9))
    sim = MooncakeSim(cfg, hardware=toy_hardware(prefill_per_token=1e-3))
    if not correct:   # no allowance for arrivals after the burst (there are none): priced exactly
        sim.prefills[0].view.set_overtake_share(0.0, 0.0)
    sim.decisions = []
    res = sim.run(trace)
    held, shift = res.extra["held_s"], res.extra["burst_shift_s"]
    by_id = {r.request_id: r for r in res.requests}
    rows = [(by_id[t.request_id].ttft, d.predicted_ttft_s + held.get(t.request_id, 0.0), shift.get(t.request_id, 0.0))
            for t, d in zip(trace, sim.decisions) if t.request_id in held]
    return sim, rows


def test_a_burst_s_members_packed_together_are_predicted_to_end_with_their_pack():
    sim, rows = _run()
    assert sum(1 for *_, s in rows if s > 0) >= 12            # early members whose pack the later ones joined
    for ttft, predicted, shift in rows:     # the simulated hardware is the model: the prediction is exact
        assert abs(ttft - (predicted + shift)) < 1e-6
    assert max(abs(ttft - predicted) for ttft, predicted, _ in rows) > 0.05   # without the shift it was not


def test_the_correction_sees_the_shifted_forward_and_learns_no_join_share_from_the_burst():
    sim, _ = _run(correct=True)
    c = sim.correcting.corrections
    assert c.join_share("P0") < 0.02 and abs(c.prefill_scale("P0") - 1.0) < 1 / 32
