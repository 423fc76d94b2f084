"""The hypervisor's steal a prefill reports beside its compute (``steal_s``, and its threads'
``cpu_s`` and ``runqueue_s``): on the conductor's check line and span, and a malformed report
shown as none, the request unharmed."""

from __future__ import annotations

import logging
import math

import pytest

from mooncake_lite.conductor.flight.checks import Check, Prediction, reported_seconds
from tests.conductor.test_api import client

SLOW_BOX = 30.0   # --dead-after: a loaded machine must not reap the fakes mid-test


def test_a_check_says_what_the_host_stole_beside_its_compute():
    p = Prediction(ttft_s=0.5, tbt_s=0.02, queue_s=0.3, prefill_s=0.2, transfer_s=0.0)
    quiet = Check("r1", "p0", "d0", p, ttft_s=1.0, tbt_s=0.04, mean_gap_s=0.03, queue_s=0.6, compute_s=0.3,
                  transfer_s=None)
    assert "steal" not in quiet.describe() and quiet.attributes()["measured_steal_s"] is None   # not said
    stolen = Check("r1", "p0", "d0", p, ttft_s=1.0, tbt_s=0.04, mean_gap_s=0.03, queue_s=0.6, compute_s=0.3,
                   transfer_s=None, steal_s=0.12)
    assert "compute 0.2s→0.3s (x1.50) (host steal 0.12s)," in stolen.describe()
    assert stolen.attributes()["measured_steal_s"] == 0.12
    ran = Check("r1", "p0", "d0", p, ttft_s=1.0, tbt_s=0.04, mean_gap_s=0.03, queue_s=0.6, compute_s=0.3,
                transfer_s=None, steal_s=0.0, cpu_s=0.21, runqueue_s=0.08)
    assert "compute 0.2s→0.3s (x1.50) (host steal 0s, on CPU 0.21s, run queue 0.08s)," in ran.describe()
    assert (ran.attributes()["measured_cpu_s"], ran.attributes()["measured_runqueue_s"]) == (0.21, 0.08)


def test_only_a_finite_non_negative_number_is_taken_as_seconds():
    assert reported_seconds(0) == 0.0 and reported_seconds(0.25) == 0.25
    for bad in ("lots", None, -1.0, math.nan, math.inf, [1], {"s": 1}):
        assert reported_seconds(bad) is None


@pytest.mark.parametrize("steal, shown", [(0.01, "(host steal 0.01s, run queue 0.02s)"), ("lots", "(run queue 0.02s)"),
                                         (-3, "(run queue 0.02s)")])
async def test_a_prefills_steal_report_reaches_the_line_or_is_left_out(make_cluster, caplog, steal, shown):
    caplog.set_level(logging.INFO, logger="mooncake_lite.conductor.flight.predictions")
    cluster = await make_cluster(dead_after=SLOW_BOX)
    cluster.instances["p0"].behaviour.timings = {"queue_s": 0.001, "compute_s": 0.05, "steal_s": steal,
                                                    "runqueue_s": 0.02}
    c = client(cluster)
    resp = await c.completions.create(model="tiny", prompt="word " * 8, max_tokens=2)
    await c.close()
    assert resp.choices[0].text is not None
    lines = [r.getMessage() for r in caplog.records if "predicted→measured" in r.getMessage()]
    assert len(lines) == 1
    assert shown in lines[0] and ("host steal" in shown) == ("host steal" in lines[0])
