"""A prefill priced at its node's state (issue #36): idle, or beside a busy decode (a job queued
on it, or a decode on its node with requests); each state learning from the requests priced in it,
the busy one starting where the prefill measured it, and both exported to the simulator."""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_lite.conductor.cluster.cost_export import cluster_profile, prefill_states
from mooncake_lite.scheduler.costs import PrefillCostModel
from tests.conductor import fakes
from tests.conductor.test_api import client
from tests.conductor.test_dispatch import _wait_for
from tests.conductor.test_predictions import SLOW_BOX, _complete


async def test_a_prefill_is_priced_at_the_speed_of_its_nodes_state(make_cluster):
    """A forward beside a busy decode runs slower than one alone (the decode holds the CPUs an
    idle one lends, prefill/threads.py): the conductor prices a prefill in its node's state (a
    decode on it with requests: busy), each state's term learns from the requests priced in it,
    and the model shown switches back when the node is idle again."""
    cluster = await make_cluster(dead_after=SLOW_BOX)
    svc, book = cluster.svc, cluster.svc.predictions
    p0, d0 = cluster.instances["p0"], cluster.instances["d0"]
    p0.behaviour.timings = {"queue_s": 0.0, "compute_s": 0.1}
    await _complete(cluster, 6)                        # one at a time: the node idle at each decision
    corr = book.corrections.get("p0")
    assert corr.factors["compute"].num_observed == 6 and "interference" not in corr.factors
    idle_scale = book.shown_scale("p0")
    # a long answer keeps d0 busy while three more requests are placed (it pauses at its 10th
    # token, which their 4 never reach: a pace set by a delay ran out on a slow box); their
    # forwards take 3x
    d0.behaviour.pause_after = 10
    c = client(cluster)
    stream = await c.completions.create(model="tiny", prompt="a long answer", max_tokens=60, stream=True)
    await stream.__anext__()
    p0.behaviour.timings = {"queue_s": 0.0, "compute_s": 0.3}
    await _wait_for(lambda: svc.membership.get("d0").decode_jobs)
    await _complete(cluster, 3)
    corr = book.corrections.get("p0")
    assert corr.factors["interference"].num_observed == 3
    assert corr.factors["compute"].num_observed == 7   # the long answer itself was placed with d0 idle
    busy_scale = book.corrections.prefill_scale("p0", busy=True)
    assert busy_scale > 1.5 * idle_scale
    assert book.shown_scale("p0") == pytest.approx(busy_scale, rel=1 / 30)   # d0 still decoding
    d0.behaviour.resume.set()
    async for _ in stream:
        pass
    await c.close()
    await _wait_for(lambda: not svc.membership.get("d0").decode_jobs)
    book.show_node_states()                            # what the next decision does first
    assert book.shown_scale("p0") == pytest.approx(book.corrections.prefill_scale("p0", busy=False), rel=1 / 30)
    assert book.shown_scale("p0") < busy_scale / 1.5


async def test_a_prefill_s_busy_state_starts_where_it_measured_it(make_cluster):
    """A prefill that borrows idle CPUs times its chunks on its own threads too at start-up
    (``Register.busy_scale``): the conductor prices its busy node's forwards by that until it has
    measured some, its idle ones by its model; a scale out of bounds refuses the registration."""
    cluster = await make_cluster(prefill=0, dead_after=SLOW_BOX)
    book = cluster.svc.predictions
    p0 = await cluster.add("prefill", "p0", store="store0:1", register=False)
    for hostile in (0.5, 100.0, "fast"):               # (the fakes' own Register would refuse to build them)
        raw = {**dataclasses.asdict(p0.register_msg()), "busy_scale": hostile}
        status, _ = await fakes.post(cluster.session, f"{cluster.url}/internal/v1/register", raw, p0.token)
        assert status == 400
    status, body = await fakes.register(cluster.session, cluster.url, p0, busy_scale=1.8)
    assert status == 200, body
    assert book.corrections.prefill_scale("p0", busy=True) == pytest.approx(1.8)
    assert book.corrections.prefill_scale("p0", busy=False) == 1.0
    # the export gives the simulator both speeds, each forward's by its node's state
    inst, costs = cluster.svc.membership.get("p0"), cluster.svc.scheduler.costs
    profile = cluster_profile(cluster.svc.membership, costs, corrected=book.simulated_costs,
                              in_states=book.simulated_states)
    idle, busy = (PrefillCostModel.from_dict(profile[k]) for k in ("prefill_idle", "prefill_busy"))
    assert busy.predict(512) == pytest.approx(1.8 * idle.predict(512))
    assert idle.predict(512) == pytest.approx((inst.costs.prefill or costs.prefill).predict(512))
    assert prefill_states([inst], costs, lambda i: None) == {}       # a prefill without them: neither
    await cluster.add("decode", "d0")
    p0.behaviour.timings = {"queue_s": 0.0, "compute_s": 0.1}
    await _complete(cluster, 3)                        # idle at each decision: the idle state learns
    corr = book.corrections.get("p0")
    assert corr.factors["compute"].num_observed == 3 and corr.factors["interference"].num_observed == 0
    assert book.corrections.prefill_scale("p0", busy=True) == pytest.approx(1.8)
