"""Several conductors in the simulator (``sim/conductors.py``): each sees the others' dispatches
only from the next heartbeat on; one conductor is the plain simulation."""

from __future__ import annotations

from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.conductors import ConductorsSim, compare
from mooncake_lite.sim.config import SimConfig
from tests.sim.helpers import req, toy_hardware

CFG = SimConfig(scheduler=SchedulerConfig(admission="none", ttft_slo_s=30.0, tbt_slo_s=1.0),
                num_prefill=1, num_decode=1)


def _predicted(sim, trace) -> list[float]:
    sim.decisions = []
    sim.run(trace)
    return [d.predicted_ttft_s for d in sim.decisions]


def test_a_conductor_sees_the_others_dispatch_only_after_a_heartbeat():
    hw = toy_hardware()
    same_beat = [req(0, 0.0, 1000, 4), req(1, 0.001, 1000, 4)]        # 1 s of prefill each, one prefill
    one = _predicted(MooncakeSim(CFG, hw), same_beat)
    assert one[1] > one[0] + 0.9                                      # the second waits behind the first
    two = _predicted(ConductorsSim(CFG, hw, conductors=2, heartbeat_s=1.0), same_beat)
    assert abs(two[1] - two[0]) < 0.01, two                           # the other's job not heard of yet
    later = _predicted(ConductorsSim(CFG, hw, conductors=2, heartbeat_s=0.0005), same_beat)
    assert later[1] > later[0] + 0.9                                  # a heartbeat in between: seen


def test_one_conductor_is_the_plain_simulation_and_compare_runs_each_count():
    hw = toy_hardware()
    trace = [req(i, 0.05 * i, 600 + 50 * (i % 5), 8) for i in range(40)]
    cfg = SimConfig(scheduler=CFG.scheduler, num_prefill=2, num_decode=2)
    plain = [r.ttft for r in MooncakeSim(cfg, hw).run(trace).requests]
    assert [r.ttft for r in ConductorsSim(cfg, hw, conductors=1).run(trace).requests] == plain
    out = compare(cfg, trace, hardware=hw)
    assert set(out) == {"1", "2", "3"} and all(v["ttft_p50_s"] > 0 for v in out.values())
