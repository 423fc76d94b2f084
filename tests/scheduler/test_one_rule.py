"""Algorithm 1's cost key is one function (scheduler/rules.py): replacing it changes the live
conductor's placement and the simulator's alike (issue #31, "a change to Algorithm 1's cost key
is a one-file diff"). Runs uncompiled, with fake instances: no model processes."""

from __future__ import annotations

import pytest

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.scheduler import SchedulerConfig, rules, wide
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import get_hardware
from mooncake_lite.trace.format import TraceRequest
from tests.conductor import fakes
from tests.conductor.conftest import make_cluster  # noqa: F401  (the fixture, for this module)
from tests.conductor.test_api import TOK, client


def _largest_ttft_first(transfer_s, queue_s, prefill_s):
    """The key inverted: the instance Algorithm 1 likes least wins."""
    return -(transfer_s + queue_s + prefill_s)


@pytest.mark.parametrize("inverted", [False, True])
async def test_the_live_conductor_follows_the_key(make_cluster, monkeypatch, inverted):  # noqa: F811
    if inverted:
        monkeypatch.setattr(rules, "prefill_cost_key", _largest_ttft_first)
    cluster = await make_cluster(prefill=2, decode=1)
    prompt = "0123456789abcdefghij"                      # 21 tokens = 5 full blocks of 4
    keys = prefix_hash(TOK.encode(prompt), 4, 0)
    await fakes.block_events(cluster.session, cluster.url, "store1:1", stored=keys[:4])   # p1's store
    c = client(cluster)
    raw = await c.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=2)
    # p1 holds the prefix: the smallest TTFT; inverted, the other one fetching it is preferred
    expected = ("p0", "transfer") if inverted else ("p1", "local-hit")
    assert (raw.headers["X-Mooncake-Prefill"], raw.headers["X-Mooncake-Route"]) == expected
    await c.close()


def _trace(n: int) -> list[TraceRequest]:
    # conversations of 4 turns: each turn extends the previous prompt, so prefixes are shared
    out = []
    for i in range(n):
        conversation, turn = divmod(i, 4)
        blocks = [1000 * conversation + b for b in range(4 * (turn + 1))]
        out.append(TraceRequest(i, i * 500.0, 512 * len(blocks), 16, tuple(blocks)))
    return out


def _prefills(monkeypatch, inverted: bool, wide_rows: bool) -> list[tuple[str | None, float | None]]:
    with monkeypatch.context() as m:
        if inverted:
            m.setattr(rules, "prefill_cost_key", _largest_ttft_first)
        if wide_rows:
            m.setattr(wide, "WIDE_MIN_INSTANCES", 1)
        hw = get_hardware("llama2-70b-a800")
        sched = SchedulerConfig(ttft_slo_s=30.0, tbt_slo_s=0.1, block_size=hw.block_size)
        sim = MooncakeSim(SimConfig(num_prefill=4, num_decode=2, scheduler=sched), hw)
        sim.decisions = []
        sim.run(_trace(80))
        return [(d.prefill_id, d.predicted_ttft_s) for d in sim.decisions]


@pytest.mark.parametrize("wide_rows", [False, True])
def test_the_simulator_follows_the_key(monkeypatch, wide_rows):
    plain = _prefills(monkeypatch, False, wide_rows)
    inverted = _prefills(monkeypatch, True, wide_rows)
    assert [p for p, _ in plain] != [p for p, _ in inverted]
    assert all(t > 0 for _, t in plain) and all(t < 0 for _, t in inverted)   # the reported key too
