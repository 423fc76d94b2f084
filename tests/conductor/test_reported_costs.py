"""What the membership makes of an instance's cost report (``conductor/costs.instance_costs``):
the scheduler's models, a flat report read with the registered role, a heartbeat's replacing
only what it carries."""

import pytest

from mooncake_lite.common.cost_report import CostReport, DecodeCost, FlatCost, PrefillCost
from mooncake_lite.common.protocol import Heartbeat, Register
from mooncake_lite.conductor.cluster.membership import Membership, RegistrationError
from mooncake_lite.scheduler import DecodeCostModel, PrefillCostModel


def _reg(role: str, cost) -> Register:
    return Register(role=role, instance_id=f"{role[0]}0", http="h:1", data="h:2" if role == "decode" else None,
                    store=None, model="tiny", block_size=16, hash_seed=0, kv_bytes_per_token=64,
                    max_context=4096, cost=cost)


def test_reports_become_the_schedulers_models_and_a_heartbeat_replaces_what_it_carries():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", CostReport(prefill=PrefillCost(0.1, 1e-3), bandwidth_bytes_per_s=1e9)), 0.0)
    costs = m.instances["p0"].costs
    assert (costs.prefill, costs.decode, costs.bandwidth_bytes_per_s) == (PrefillCostModel(0.1, 1e-3), None, 1e9)
    m.heartbeat(Heartbeat("p0", cost=FlatCost(c0=0.2)), 1.0)          # an older instance's flat form
    costs = m.instances["p0"].costs
    assert (costs.prefill, costs.bandwidth_bytes_per_s) == (PrefillCostModel(c0=0.2), 1e9)
    m.register(_reg("decode", FlatCost(c0=0.05, c1=1e-3)), 0.0)
    assert m.instances["d0"].costs.decode == DecodeCostModel(0.05, 1e-3)
    m.heartbeat(Heartbeat("d0", cost=CostReport(decode=DecodeCost(c2=1e-6))), 1.0)
    assert m.instances["d0"].costs.decode == DecodeCostModel(c2=1e-6)


def test_a_flat_report_that_does_not_fit_the_role_is_refused_whole():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    with pytest.raises(RegistrationError, match=r"decode instance d0: cost: unknown coefficient\(s\) \['c3'\]") as info:
        m.register(_reg("decode", FlatCost(c0=0.05, c3=0.0)), 0.0)
    assert info.value.status == 400 and "d0" not in m.instances
    m.register(_reg("decode", CostReport(decode=DecodeCost(0.05))), 0.0)
    with pytest.raises(RegistrationError, match="decode instance d0 heartbeat: cost: unknown coefficient") as info:
        m.heartbeat(Heartbeat("d0", cost=FlatCost(c3=1.0)), 1.0)
    assert info.value.status == 400 and m.instances["d0"].costs.decode == DecodeCostModel(0.05)


def test_a_heartbeat_prices_the_running_job_to_end_when_its_prefill_says():
    """scheduler/progress.py: the prefill's report of its job in progress reaches the view as
    that job's end, on the conductor's clock; where the view shows another job started, it
    follows the instance (PrefillView.report_end); a job it does not hold (another conductor's)
    is ignored."""
    from mooncake_lite.common.protocol import RunningPrefill
    from mooncake_lite.conductor.cluster.membership import PrefillJob
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", CostReport(prefill=PrefillCost(0.0, 1e-3))), 0.0)
    m.add_prefill("p0", PrefillJob("a", 4000, 0, "d0"), 10.0)       # the head: started on arrival
    m.add_prefill("p0", PrefillJob("b", 100, 0, "d0"), 10.0)
    m.heartbeat(Heartbeat("p0", running=RunningPrefill("zz", 0.5)), 11.0)   # another conductor's job
    assert [j.ends_at for j in m.instances["p0"].view.state().queue] == [None, None]
    m.heartbeat(Heartbeat("p0", running=RunningPrefill("a", 0.5)), 11.0)
    head = m.instances["p0"].view.state().queue[0]
    assert (head.request_id, head.started_at, head.ends_at, head.reported_s()) == ("a", 10.0, 11.5, 1.5)
    m.heartbeat(Heartbeat("p0", running=RunningPrefill("b", 0.25)), 12.0)   # the instance runs b, not a
    queue = m.instances["p0"].view.state().queue
    assert [(j.request_id, j.started_at, j.ends_at) for j in queue] == [("b", 12.0, 12.25), ("a", None, None)]
