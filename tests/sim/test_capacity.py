"""Capacity search on a known monotone attainment curve, and probe sharing."""

from __future__ import annotations

import pytest

from mooncake_lite.sim.capacity import ProbeCache, find_capacity


class FakeProbes(ProbeCache):
    """Attainment falls linearly with speed; passes (>= 0.9) below ``limit[tbt]``."""

    def __init__(self, limits):
        self.limits, self.target, self.calls = limits, 0.9, []

    def attainment(self, speed, tbt):
        self.calls.append(speed)
        return 1.0 if speed <= self.limits[tbt] else 0.5


@pytest.mark.parametrize("limit", [0.3, 1.0, 2.7, 5.0])
def test_capacity_found_within_bisection_precision(limit):
    probes = FakeProbes({0.1: limit})
    res = find_capacity("x", probes, 0.1, iterations=3)
    assert res.speed <= limit < res.speed * 2 ** (1 / 8) + 1e-12
    assert all(att in (1.0, 0.5) for _, att in res.probes)


def test_capacity_edges():
    assert find_capacity("x", FakeProbes({0.1: 1e-6}), 0.1).speed == 0.0
    assert find_capacity("x", FakeProbes({0.1: 1e6}), 0.1, max_speed=8.0).speed == 8.0


def test_probe_cache_runs_each_speed_once_for_all_thresholds():
    runs = []

    class Sim:
        def __init__(self):
            from mooncake_lite.sim.recorder import Recorder
            self.events = None
            self.recorder = Recorder(self, 1.0)

        def run(self, trace):
            from mooncake_lite.sim.recorder import SimResult
            runs.append(len(trace))
            return SimResult("fake", {}, [], [], {}, 0.0, 0, extra={"aborted": False})

    from tests.sim.helpers import req
    cache = ProbeCache(Sim, [req(0, 0.0, 10, 2)], 30.0, [0.1, 0.2], 0.9)
    cache.attainment(1.0, 0.1)
    cache.attainment(1.0, 0.2)
    cache.attainment(2.0, 0.1)
    assert runs == [1, 1] and cache.num_probes == 2
