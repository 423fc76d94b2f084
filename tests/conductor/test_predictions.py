"""Every prediction checked (issue #36): each completed request's predicted TTFT and TBT against
the measured ones in /metrics, `mooncake status`, the response's headers and the trace span; the
online correction moving the model the scheduler prices with; broken measurements and cost
reports refused without moving it; Retry-After from the predictions."""

from __future__ import annotations

import asyncio
import logging
import math
import re

import openai
import pytest

from mooncake_lite.conductor.flight.checks import Check, Prediction
from mooncake_lite.scheduler.correction import Corrections
from mooncake_lite.scheduler.costs import scaled
from mooncake_lite.scheduler.packing import forward_seconds
from mooncake_lite.scheduler.queue_order import join_allowance
from tests.conductor import fakes
from tests.conductor.test_api import client
from tests.conductor.test_dispatch import _wait_for

SLOW_BOX = 30.0   # --dead-after: a loaded machine must not reap the fakes mid-test


async def _complete(cluster, n: int, max_tokens: int = 4) -> list[dict[str, str]]:
    """``n`` completions one after another; their response headers."""
    c, headers = client(cluster), []
    for i in range(n):
        raw = await c.completions.with_raw_response.create(model="tiny", prompt=f"prompt number {i}",
                                                           max_tokens=max_tokens)
        headers.append(dict(raw.headers))
    await c.close()
    return headers


async def test_each_request_is_checked_in_metrics_status_and_headers(make_cluster):
    cluster = await make_cluster(dead_after=SLOW_BOX)
    p0 = cluster.instances["p0"]
    p0.behaviour.timings = {"queue_s": 0.0, "compute_s": 0.05}
    cluster.instances["d0"].behaviour.token_delay_s = 0.01
    headers = await _complete(cluster, 6)
    for h in headers:
        assert float(h["x-mooncake-predicted-ttft"]) > 0 and float(h["x-mooncake-predicted-tbt"]) > 0
    async with cluster.session.get(cluster.url + "/metrics") as r:
        text = await r.text()
    for instance, metric in (("p0", "ttft"), ("p0", "compute"), ("d0", "tbt"), ("d0", "gap")):
        count = re.search(r'mooncake_conductor_prediction_ratio_count\{instance="%s",metric="%s"\} (\S+)'
                          % (instance, metric), text)
        assert count is not None and float(count.group(1)) == 6, (instance, metric)
    async with cluster.session.get(cluster.url + "/internal/v1/status") as r:
        predictions = (await r.json())["predictions"]
    assert predictions["ttft"]["count"] == 6 and predictions["tbt"]["count"] == 6
    assert predictions["ttft"]["median_error"] >= 0 and predictions["ttft"]["p90_error"] >= \
        predictions["ttft"]["median_error"]
    assert predictions["corrections"]["p0"]["observed"]["compute"] == 6
    assert predictions["corrections"]["p0"]["offsets_s"] == {"compute": 0.0}   # one shape: no fixed cost told


async def test_the_correction_moves_the_model_the_scheduler_prices_with(make_cluster):
    cluster = await make_cluster(dead_after=SLOW_BOX)
    svc = cluster.svc
    before = svc.membership.snapshot().prefills[0].cost      # the cluster default: p0 reported none
    cluster.instances["p0"].behaviour.timings = {"compute_s": 0.2}   # far slower than predicted
    await _complete(cluster, 8)
    scale = svc.predictions.shown_scale("p0")
    assert scale > 2.0 and scale == pytest.approx(svc.predictions.corrections.prefill_scale("p0"), rel=1 / 30)
    shown = svc.membership.snapshot().prefills[0].cost
    assert shown == scaled(before or svc.scheduler.costs.prefill, scale)
    # and the export for the simulator carries the corrected model and the factors
    async with cluster.session.get(cluster.url + "/internal/v1/cost_model") as r:
        profile = await r.json()
    assert profile["corrections"]["p0"]["factors"]["compute"] > 2.0
    exported = scaled(before or svc.scheduler.costs.prefill, svc.predictions.corrections.prefill_scale("p0"))
    assert profile["prefill"]["c1"] == pytest.approx(exported.c1, rel=1e-6)   # no queue term: the sim queues
    assert [i["corrected"] for i in profile["instances"] if i["instance_id"] == "p0"] == [True]
    # each measured TTFT over the one shown is kept (the fake reports its compute, it does not take
    # it), and the export has their upper quantile; admission's bound multiplies the queue by the
    # waits' (Corrections.note_wait), and requests sent one at a time waited for nothing
    corr = svc.predictions.corrections
    ratios, spread = corr.get("p0").ratios["ttft"], corr.spread("p0", "ttft")
    assert len(ratios) >= 8 and min(ratios) * (1 - 1e-9) <= spread <= max(ratios) * (1 + 1e-9)
    assert profile["corrections"]["p0"]["spread"]["ttft"] == pytest.approx(spread, rel=1e-3)
    assert not corr.get("p0").waits and svc.membership.snapshot().prefills[0].queue_spread == 1.0


async def test_a_broken_measurement_is_refused_logged_and_moves_nothing(make_cluster, caplog):
    cluster = await make_cluster(dead_after=SLOW_BOX)
    cluster.instances["p0"].behaviour.timings = {"queue_s": -5.0, "compute_s": 1e9}
    caplog.set_level(logging.WARNING, "mooncake_lite.conductor.flight.predictions")
    await _complete(cluster, 2)
    corr = cluster.svc.predictions.corrections.get("p0")
    assert "queue" not in corr.factors and "compute" not in corr.factors
    assert cluster.svc.predictions.corrections.prefill_scale("p0") == 1.0 == cluster.svc.predictions.shown_scale("p0")
    assert "compute measurement refused by the online correction" in caplog.text
    async with cluster.session.get(cluster.url + "/metrics") as r:
        text = await r.text()
    assert 'mooncake_conductor_prediction_refused_total{instance="p0",term="compute"} 2.0' in text
    assert 'mooncake_conductor_prediction_refused_total{instance="p0",term="queue"} 2.0' in text


@pytest.mark.parametrize("cost", ['{"prefill": {"c0": 1e9}}', '{"prefill": {"c1": -1}}',
                                  '{"bandwidth_bytes_per_s": 1e-9}', '{"c0": 1e300}'])
async def test_a_hostile_cost_report_is_refused_logged_and_moves_nothing(make_cluster, caplog, cost):
    cluster = await make_cluster(dead_after=SLOW_BOX)
    caplog.set_level(logging.WARNING, "mooncake_lite.common.cost_report")
    before = cluster.svc.membership.instances["p0"].costs
    body = b'{"instance_id": "p0", "cost": %s}' % cost.encode()
    async with cluster.session.post(cluster.url + "/internal/v1/heartbeat", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and "Heartbeat.cost" in (await r.json())["error"]["message"]
    assert cluster.svc.membership.instances["p0"].costs is before
    assert "cost report refused" in caplog.text


async def test_retry_after_is_when_the_prediction_says_the_request_fits(make_cluster, caplog):
    caplog.set_level(logging.INFO, logger="mooncake_lite.conductor.flight.placement")
    cluster = await make_cluster(prefill=0, decode=1, admission="early", ttft_slo=4.5, dead_after=SLOW_BOX)
    p0 = await cluster.add("prefill", "p0", store="s0:1", cost={"prefill": {"c0": 1.0, "c1": 0.01}})
    p0.behaviour.hang = True          # short prefills of a predicted second each pile up
    c = client(cluster)
    pending = []
    for i in range(3):   # admitted: predicted TTFT within the SLO
        pending.append(asyncio.create_task(c.completions.create(model="tiny", prompt=f"q{i}", max_tokens=2)))
        await _wait_for(lambda: len(p0.requests) == len(pending))
    with pytest.raises(openai.RateLimitError) as info:   # ~3 s of queue + its own ~3.5 s
        await c.completions.create(model="tiny", prompt="x" * 250, max_tokens=2)
    predicted = float(re.search(r"predicted TTFT (\S+)s", info.value.message).group(1))
    said = next(r.getMessage() for r in caplog.records if "rejected: predicted TTFT" in r.getMessage())
    # explain.py's parts: the head, started at once, priced to the end its decision gave it
    assert re.search(r"left of the running job \(own end\) \+ 2 job\(s\) ahead", said), said
    # ~2 s of the ~3 s queue ahead must drain before this request would meet its SLO (not all of
    # it: the queue's own figure would say 4); the queue's remainder shrinks while the test runs
    retry = int(info.value.response.headers["Retry-After"])
    assert -0.01 <= retry - (predicted - 4.5) < 1.01 and retry <= 3
    assert float(info.value.response.headers["X-Mooncake-SLO-TTFT"]) == 4.5   # what it was refused by
    # where it fell in the conductor's order: after the three placed (bench fidelity lands it there)
    assert info.value.response.headers["X-Mooncake-Placed"] == "3"
    # the refusal's central prediction and the bound judged (no spread measured yet: the same), so
    # a client tells a refusal on the spread alone from one on the central prediction
    headers = info.value.response.headers
    assert float(headers["X-Mooncake-Predicted-TTFT"]) == pytest.approx(predicted, rel=5e-3)
    assert float(headers["X-Mooncake-Bound-TTFT"]) == pytest.approx(predicted, rel=5e-3)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await c.close()


def test_a_check_says_what_it_compared():
    p = Prediction(ttft_s=0.5, tbt_s=0.02, queue_s=0.3, prefill_s=0.2, transfer_s=0.0)
    check = Check("r1", "p0", "d0", p, ttft_s=1.0, tbt_s=0.04, mean_gap_s=0.03, queue_s=0.6, compute_s=0.3,
                  transfer_s=None)
    assert check.ratios() == pytest.approx({"ttft": 2.0, "tbt": 2.0, "gap": 1.5, "queue": 2.0, "compute": 1.5})
    attrs = check.attributes()
    assert attrs["predicted_ttft_s"] == 0.5 and attrs["measured_ttft_s"] == 1.0 and attrs["ttft_ratio"] == 2.0
    assert attrs["transfer_ratio"] is None
    assert "ttft 0.5s→1s (x2.00)" in check.describe()
    # a TBT predicted with a tail of 2 was made of a step of 0.01 s: the mean gap is compared to that
    tailed = Check("r1", "p0", "d0", Prediction(0.5, 0.02, 0.3, 0.2, 0.0, decode_tail=2.0), ttft_s=1.0, tbt_s=0.04,
                   mean_gap_s=0.03, queue_s=0.6, compute_s=0.3, transfer_s=None)
    assert tailed.ratios()["gap"] == pytest.approx(3.0) and tailed.ratios()["tbt"] == pytest.approx(2.0)


async def test_a_decode_learns_its_tail_and_the_tbt_predicted_carries_it(make_cluster):
    """Every fourth token comes late (as beside a prefill's forward): the paper's TBT, the slowest
    tenth of the gaps, is ~2.3x the mean gap. The decode's tail learns it, its state shows it, and
    the TBT the next request is shown is the step foreseen × it, while the decode term (which
    sizes every decode's time) learns the mean gap over the step, not over the step × the tail."""
    cluster = await make_cluster(dead_after=SLOW_BOX)
    d0 = cluster.instances["d0"].behaviour
    d0.token_delay_s, d0.slow_token_every, d0.slow_token_delay_s = 0.005, 4, 0.02
    await _complete(cluster, 8, max_tokens=21)
    svc = cluster.svc
    corr = svc.predictions.corrections
    tail = corr.tail("d0")
    assert tail > 1.5 and corr.get("d0").factors["tail"].num_observed == 8
    state = svc.membership.snapshot().decodes[0]
    assert abs(math.log(state.tbt_tail / tail)) < 1 / 32
    headers = await _complete(cluster, 1, max_tokens=21)
    shown = float(headers[0]["x-mooncake-predicted-tbt"])
    step = state.cost.predict(1, 1)      # the least step on the model shown (the decode term in it)
    assert shown >= 0.99 * step * state.tbt_tail
    # the decode term is learned against the step the TBT was made of: a mean gap equal to it moves
    # nothing, though the TBT predicted (the step × a tail of 2) was twice the mean gap
    fresh = Corrections()
    svc.predictions.corrections = fresh
    check = Check("r", "p0", "d0", Prediction(0.5, 0.04, 0.0, 0.5, 0.0, decode_tail=2.0), ttft_s=0.5, tbt_s=0.04,
                  mean_gap_s=0.02, queue_s=None, compute_s=None, transfer_s=None)
    svc.predictions.settle(check, 0.0)
    assert fresh.get("d0").factors["decode"].log == 0.0 and fresh.tail("d0") > 1.0


async def test_the_ttft_side_corrects_at_the_first_token_not_after_the_decode(make_cluster):
    cluster = await make_cluster(dead_after=SLOW_BOX)
    cluster.instances["p0"].behaviour.timings = {"queue_s": 0.0, "compute_s": 0.2}
    cluster.instances["d0"].behaviour.token_delay_s = 0.05
    c, book = client(cluster), cluster.svc.predictions
    stream = await c.completions.create(model="tiny", prompt="a prompt", max_tokens=40, stream=True)
    await stream.__anext__()                     # token 1 in, 39 still to come
    assert book.corrections.get("p0").factors["compute"].num_observed == 1
    assert "decode" not in book.corrections.get("d0").factors
    async for _ in stream:
        pass
    await c.close()
    await _wait_for(lambda: "decode" in book.corrections.get("d0").factors)
    # settled once: the TTFT side at token 1, the TBT side at the end
    assert book.corrections.get("p0").factors["compute"].num_observed == 1
    async with cluster.session.get(cluster.url + "/metrics") as r:
        text = await r.text()
    assert 'mooncake_conductor_prediction_ratio_count{instance="p0",metric="ttft"} 1.0' in text
    assert 'mooncake_conductor_prediction_ratio_count{instance="d0",metric="tbt"} 1.0' in text


async def test_a_refined_profile_is_not_counted_twice(make_cluster):
    """The instance refines its own model to the slowdown the correction has learned too: the
    factor moves back by as much, so the model the scheduler prices with stays where it was."""
    cluster = await make_cluster(prefill=0, dead_after=SLOW_BOX)
    p1 = await cluster.add("prefill", "p1", store="s1:1", cost={"prefill": {"c0": 0.01, "c1": 1e-4}})
    p1.behaviour.timings = {"queue_s": 0.0, "compute_s": 0.2}
    await _complete(cluster, 10)
    book = cluster.svc.predictions
    before_scale, before = book.shown_scale("p1"), cluster.svc.membership.snapshot().prefills[0].cost
    assert before_scale > 2.0
    body = b'{"instance_id": "p1", "cost": {"prefill": {"c0": 0.02, "c1": 2e-4}}}'   # twice as slow
    async with cluster.session.post(cluster.url + "/internal/v1/heartbeat", data=body,
                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200
    assert book.shown_scale("p1") == pytest.approx(before_scale / 2, rel=1e-6)
    after = cluster.svc.membership.snapshot().prefills[0].cost
    assert after.predict(500) == pytest.approx(before.predict(500), rel=1e-6)


async def test_a_shortest_first_queue_learns_the_share_of_overtakes_its_jobs_meet(make_cluster):
    """A job that waits is priced with a share of an allowance for later, shorter arrivals (at
    most 4x its own prefill): 0 at first (the queue as it stands, ``correction.show_start``), and
    learned from what the jobs meet. A job sent alone starts at once: priced for no overtakes, it
    teaches nothing. Sent at once, the jobs behind the first wait, and the instance reports each
    waited far longer than the queue ahead of it: they teach the share up, and the queue factor
    stays untouched (the fake does not say who passed whom). Prompts grow, so each is likely to be
    passed (shorter ones came before it)."""
    cluster = await make_cluster(dead_after=SLOW_BOX)
    p0 = cluster.instances["p0"]
    status, body = await fakes.register(cluster.session, cluster.url, p0, queue_overtakes=4)
    assert status == 200, body
    p0.behaviour.timings = {"queue_s": 0.0, "compute_s": 0.05}
    c = client(cluster)
    book = cluster.svc.predictions
    for i in range(3):
        await c.completions.create(model="tiny", prompt="word " * (4 + 6 * i), max_tokens=2)
    assert book.corrections.overtake_share("p0") == 0.0
    assert cluster.svc.membership.snapshot().prefills[0].overtake_share == 0.0
    p0.behaviour.timings = {"queue_s": 5.0, "compute_s": 0.05}
    await asyncio.gather(*(c.completions.create(model="tiny", prompt="word " * (4 + 6 * i), max_tokens=2)
                           for i in range(8)))
    await c.close()
    share = book.corrections.overtake_share("p0")
    assert share > 0.5 and "queue" not in book.corrections.get("p0").factors
    state = cluster.svc.membership.snapshot().prefills[0]
    assert state.overtake_share == pytest.approx(share, abs=1 / 32) and len(state.recent_uncached) == 11
    # the jobs priced to wait kept their waits (each with its allowance), admission's bound their spread
    waits, spread = book.corrections.get("p0").waits, book.corrections.spread("p0", "wait")
    assert waits and all(w.overtake_full_s > 0 for w in waits) and state.queue_spread == pytest.approx(spread, rel=1 / 30)
    assert book.export()["p0"]["overtake_share"] == pytest.approx(share, abs=1e-4)


async def test_a_shortest_first_wait_priced_too_long_scales_the_wait_not_the_forward(make_cluster):
    """Jobs sent at once, each reported to have waited less than the queue priced ahead of it, and
    passed by nobody: no share of an overtake allowance explains a wait under the queue (it stops
    at 0), so the queue factor learns it, and the scheduler is shown it as the wait's own scale:
    the next job's queue is priced shorter while each job's own forward is priced as the compute
    factor alone says."""
    cluster = await make_cluster(dead_after=SLOW_BOX)
    p0 = cluster.instances["p0"]
    status, body = await fakes.register(cluster.session, cluster.url, p0, queue_overtakes=4)
    assert status == 200, body
    p0.behaviour.timings = {"queue_s": 0.001, "compute_s": 0.05, "passed": 0.0}
    c, book = client(cluster), cluster.svc.predictions
    for _ in range(3):
        await asyncio.gather(*(c.completions.create(model="tiny", prompt="word " * (4 + 6 * i), max_tokens=2)
                               for i in range(8)))
    await c.close()
    corr = book.corrections
    assert corr.overtake_share("p0") == 0.0 and corr.get("p0").factor("queue") < 0.9
    state = cluster.svc.membership.snapshot().prefills[0]
    assert state.queue_scale == pytest.approx(corr.queue_scale("p0"), rel=1 / 30) and state.queue_scale < 0.9
    # the wait's scale is no part of the model's: each forward is priced at its state's speed alone
    assert corr.prefill_scale("p0", False) == pytest.approx(corr.get("p0").factor("compute"))


async def test_a_fifo_queue_factor_scales_the_wait_and_is_judged_on_the_scale_it_was_shown(make_cluster):
    """FIFO, each job reported to have waited far less than the queue priced ahead of it: the
    queue factor learns it and the view shows it as the wait's scale, never the model's. Every
    prediction keeps the scale it was priced with, so the next residual is judged against the
    unscaled queue (recorded as 1, a factor shown at 0.5 would be told 0.5 too long again)."""
    from mooncake_lite.scheduler import Decision
    cluster = await make_cluster(dead_after=SLOW_BOX)
    p0 = cluster.instances["p0"]
    p0.behaviour.timings = {"queue_s": 0.0005, "compute_s": 0.05}
    c, book = client(cluster), cluster.svc.predictions
    for _ in range(3):
        await asyncio.gather(*(c.completions.create(model="tiny", prompt="word " * (4 + 6 * i), max_tokens=2)
                               for i in range(8)))
    await c.close()
    corr, view = book.corrections, cluster.svc.membership.get("p0").view
    assert corr.get("p0").factor("queue") < 0.9
    assert view.queue_scale == pytest.approx(corr.queue_scale("p0"), rel=1 / 30)
    assert corr.prefill_scale("p0", False) == pytest.approx(corr.get("p0").factor("compute"))
    shown = book.predicted(Decision(True, "", "p0", "d0", predicted_queue_s=1.0))
    assert shown.queue_scale == view.queue_scale


async def test_a_forward_joined_by_later_arrivals_is_no_slowdown_but_a_join_share(make_cluster):
    """A packing prefill reports the forward each job ran in (8 jobs): its time is the job's
    forward as run, not a slowdown of the one priced (the compute factor learns the speed of
    the forward that ran: exactly 1 here), and what the joiners added goes to the join share,
    which the next prediction's queue then holds (queue_order.join_allowance)."""
    cluster = await make_cluster(dead_after=SLOW_BOX)
    p0 = cluster.instances["p0"]
    status, body = await fakes.register(cluster.session, cluster.url, p0, queue_overtakes=4, pack_tokens=512)
    assert status == 200, body
    model, c = cluster.svc.predictions.defaults().prefill, client(cluster)     # p0 reported none
    n = 4 * 5        # the fakes' prompt tokens for "w w w ... " below (no cached prefix)
    forward = forward_seconds(model, n, 0, 8.0 * n, 8.0)
    p0.behaviour.timings = {"queue_s": 0.0, "compute_s": forward, "forward_tokens": 8.0 * n, "forward_jobs": 8.0}
    for _ in range(6):
        await c.completions.create(model="tiny", prompt=[7] * n, max_tokens=2)
    raw = await c.completions.with_raw_response.create(model="tiny", prompt=[7] * n, max_tokens=2)
    await c.close()
    corr = cluster.svc.predictions.corrections
    assert corr.get("p0").factor("compute") == pytest.approx(1.0, abs=1e-6)
    used = (forward - model.predict(n)) / join_allowance(model, 512, n, 0, 1.0)   # 7 joiners of the room's worst case
    assert corr.join_share("p0") == pytest.approx(used * (1 - 0.75 ** 7), rel=1e-6)    # 7 moves of alpha 0.25
    state = cluster.svc.membership.snapshot().prefills[0]
    assert state.join_share == pytest.approx(corr.join_share("p0"), abs=1 / 32)
    assert float(raw.headers["x-mooncake-predicted-ttft"]) > model.predict(n) + 0.5 * (forward - model.predict(n))
