"""The conductor's burst window (conductor/flight/arrivals.py over scheduler/arrivals.py): a
burst that meets busy prefills is placed shortest first, whatever order it arrived in."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mooncake_lite.conductor import services as services_module
from mooncake_lite.conductor.flight import flight as flight_module
from mooncake_lite.conductor.flight.arrivals import Arrivals, reprice
from mooncake_lite.conductor.flight.checks import Prediction
from mooncake_lite.scheduler import ClusterState, PrefillCostModel, PrefillInstanceState, QueuedPrefill
from mooncake_lite.scheduler.packing import slo_pack_cap
from tests.conductor import fakes
from tests.conductor.test_api import client
from tests.conductor.test_dispatch import _wait_for

BUSY = ClusterState((PrefillInstanceState("p0", "s0", queue=(QueuedPrefill("r", 10, 0, started_at=0.0),),
                                          overtakes=4),), ())
IDLE = ClusterState((PrefillInstanceState("p0", "s0", overtakes=4),), ())


async def test_a_held_burst_resumes_in_its_decision_order_and_skips_a_request_whose_client_left():
    bursts: list[tuple[list, list]] = []
    gate, resumed = Arrivals(0.05, on_placed=lambda members: bursts.append((list(members), list(resumed)))), []

    async def request(key: int) -> None:
        await gate.turn(lambda: BUSY, lambda: key, member=f"m{key}")
        resumed.append(key)          # what placement would do, before any await

    tasks = [asyncio.create_task(request(k)) for k in (30, 10, 20, 5)]
    await asyncio.sleep(0)
    tasks[3].cancel()                # its client left while held
    await asyncio.gather(*tasks, return_exceptions=True)
    assert resumed == [10, 20, 30]
    # told once every member placed itself, in the decision order
    assert bursts == [(["m10", "m20", "m30"], [10, 20, 30])]
    # an idle prefill: nobody is held (the request starts at once; nobody can pass it)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await gate.turn(lambda: IDLE, lambda: 1)
    await Arrivals(0.0).turn(lambda: BUSY, lambda: 1)
    assert loop.time() - t0 < 0.05


async def test_a_burst_behind_a_busy_prefill_is_placed_shortest_first(make_cluster, monkeypatch):
    """Sent longest first, 20 ms apart, within a 300 ms window: placed shortest first (without
    the window, in the order they came: the later, shorter ones would pass the earlier ones'
    prices). Needs the conductor's request path: the hold sits in Flight.start."""
    placed: list[int] = []
    repriced: list[list[float]] = []
    place, original = flight_module.place, services_module.reprice

    def recording(svc, request_id, req, now, **kw):
        placed.append(len(req.prompt_ids))
        return place(svc, request_id, req, now, **kw)

    def repricing(flights, *args):
        before = [f.prediction.prefill_s for f in flights]
        original(flights, *args)
        repriced.append([f.prediction.prefill_s - b for f, b in zip(flights, before)])
    monkeypatch.setattr(flight_module, "place", recording)
    monkeypatch.setattr(services_module, "reprice", repricing)
    cluster = await make_cluster(dead_after=30.0, burst_window=0.3)
    p0 = cluster.instances["p0"]
    status, body = await fakes.register(cluster.session, cluster.url, p0, queue_overtakes=4, pack_tokens=512)
    assert status == 200, body
    p0.behaviour.result_delay_s = 0.4          # its first job holds it busy while the burst arrives
    c = client(cluster)

    async def send(words: int, after: float):
        await asyncio.sleep(after)
        return await c.completions.create(model="tiny", prompt="word " * words, max_tokens=2)
    first = asyncio.create_task(send(3, 0.0))
    await _wait_for(lambda: len(p0.requests) == 1)
    await asyncio.gather(first, *(send(w, 0.02 * i) for i, w in enumerate((40, 20, 10))))
    await c.close()
    assert placed[1:] == sorted(placed[1:]) and placed[1] < placed[3]
    # packed, the later members joined the first ones' forward: those were priced again, the last not
    assert len(repriced) == 1 and repriced[0][0] > repriced[0][1] > 0 and repriced[0][2] == 0


def test_a_burst_s_members_are_repriced_with_the_pack_the_later_ones_joined():
    """``reprice``: the first two of a burst were priced alone and as a pair; the third joined their
    pack: each one's TTFT and own forward move to that pack's end (the view's model: 1 ms a token)."""
    model = PrefillCostModel(c1=1e-3)
    queue = tuple(QueuedPrefill(rid, n, 0, started_at=0.0 if rid == "run" else None)
                  for rid, n in (("run", 400), ("a", 30), ("b", 50), ("c", 200)))
    inst = SimpleNamespace(view=SimpleNamespace(state=lambda: SimpleNamespace(queue=queue, cost=model)),
                           reg=SimpleNamespace(pack_tokens=512))
    flights = [SimpleNamespace(request_id=rid, decision=SimpleNamespace(prefill_id="p0"),
                               prediction=Prediction(1.0, None, 0.5, own, 0.0)) for rid, own in
               (("a", 0.03), ("b", 0.08), ("c", 0.28))]
    reprice(flights, SimpleNamespace(get=lambda pid: inst if pid == "p0" else None), lambda: model)
    assert [round(f.prediction.prefill_s, 6) for f in flights] == [0.28, 0.28, 0.28]
    assert [round(f.prediction.ttft_s, 6) for f in flights] == [1.25, 1.2, 1.0]


async def test_the_prefill_is_told_the_cap_its_decision_set(make_cluster):
    """A prompt whose TTFT SLO (10x its prefill alone, 1 ms a token here) cannot hold a full
    512-token forward: the prefill request carries the cap ``slo_pack_cap`` gives it, to a prefill
    that registered its chunk; one that did not (older than caps) gets no such field at all."""
    cluster = await make_cluster(dead_after=30.0)
    p0 = cluster.instances["p0"]
    cost = {"c0": 0.0, "c1": 1e-3, "c2": 0.0, "c3": 0.0}
    status, body = await fakes.register(cluster.session, cluster.url, p0, pack_tokens=512, cost=cost, prefill_chunk=512)
    assert status == 200, body
    c = client(cluster)
    raw = await c.completions.with_raw_response.create(model="tiny", prompt="word " * 3, max_tokens=2)
    (sent,) = [r for r in p0.requests if hasattr(r, "pack_cap")]
    n = len(sent.token_ids)
    assert sent.pack_cap == slo_pack_cap(PrefillCostModel(c1=1e-3), 512, 10 * 1e-3 * n, n, 0) == 10 * n
    assert float(raw.headers["X-Mooncake-SLO-TTFT"]) == pytest.approx(10 * 1e-3 * n, abs=1e-6)   # the SLO applied
    assert raw.headers["X-Mooncake-Placed"] == "1"       # the first the conductor placed
    status, body = await fakes.register(cluster.session, cluster.url, p0, pack_tokens=512, cost=cost)
    assert status == 200, body
    await c.completions.create(model="tiny", prompt="word " * 3, max_tokens=2)
    await c.close()
    assert [r.pack_cap for r in p0.requests if hasattr(r, "pack_cap")] == [10 * n, 0]
