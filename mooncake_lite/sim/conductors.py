"""Several conductors in the simulator, each with a heartbeat-delayed view (issue #38 item 3).

A round-robin balancer deals the requests to ``conductors`` conductors in turn. Each runs the
same scheduler (the live code, unchanged) on its own view of the instances: what it dispatched
itself is in its view at once (the live conductor counts its own dispatches at once); what the
others dispatched appears only at the next heartbeat (every ``heartbeat_s``, all instances at
once: between two, those jobs are missing from its view; the live conductor shows them from each
heartbeat as stand-in jobs, ``conductor/cluster/others.py``). Each conductor also lists the
instances in its own random order, as the live ones break exact ties in a salted order. One
conductor is :class:`MooncakeSim` exactly. :func:`compare` runs one trace with 1, 2 and 3.
An interpreted subclass, like ``sim/tenants.py``'s: it runs on the interpreted simulator only
(``sim/compiled.py`` leaves it out).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mooncake_lite.scheduler import ClusterState, Decision, ScheduleRequest
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import Hardware
from mooncake_lite.sim.metrics import summarize
from mooncake_lite.sim.request import SimRequest
from mooncake_lite.trace.format import TraceRequest


class ConductorsSim(MooncakeSim):
    def __init__(self, cfg: SimConfig, hardware: Hardware | None = None, *, conductors: int = 2,
                 heartbeat_s: float = 0.2, seed: int = 0) -> None:
        super().__init__(cfg, hardware)
        self.conductors, self.heartbeat_s = conductors, heartbeat_s
        self.turn, self.beat = 0, -1
        self.hidden: list[set[str]] = [set() for _ in range(conductors)]   # jobs each has not heard of yet
        rng = random.Random(seed)
        self.orders = [rng.random() for _ in range(conductors)]   # each one's tie order (a salt; crc32: seeded runs repeat)

    def _decide(self, now: float, req: SimRequest, sreq: ScheduleRequest) -> Decision:
        k, self.turn = self.turn % self.conductors, self.turn + 1
        beat = int(now // self.heartbeat_s)
        if beat != self.beat:          # a heartbeat: every conductor hears of every job
            self.beat = beat
            for hidden in self.hidden:
                hidden.clear()
        decision = self.scheduler.schedule(sreq, self._view(k), now)
        if decision.accepted:
            for j, hidden in enumerate(self.hidden):
                if j != k:
                    hidden.add(sreq.request_id)
        return decision

    def _view(self, k: int) -> ClusterState:
        state, hidden = self.cluster_state(), self.hidden[k]
        if self.conductors == 1:
            return state
        salt = self.orders[k]
        prefills = [replace(p, queue=tuple(j for j in p.queue if j.request_id not in hidden)) if hidden else p
                    for p in state.prefills]
        decodes = [replace(d, running=tuple(r for r in d.running if r.request_id not in hidden),
                           incoming=tuple(r for r in d.incoming if r.request_id not in hidden)) if hidden else d
                   for d in state.decodes]
        return ClusterState(tuple(sorted(prefills, key=lambda p: zlib.crc32(f"{salt}{p.instance_id}".encode()))),
                            tuple(sorted(decodes, key=lambda d: zlib.crc32(f"{salt}{d.instance_id}".encode()))))


def compare(cfg: SimConfig, trace: Sequence[TraceRequest], counts: Sequence[int] = (1, 2, 3),
            heartbeat_s: float = 0.2, hardware: Hardware | None = None) -> dict[str, dict[str, Any]]:
    """TTFT and goodput of the same trace with each number of conductors."""
    out = {}
    for n in counts:
        sim = ConductorsSim(cfg, hardware, conductors=n, heartbeat_s=heartbeat_s)
        s = summarize(sim.run(trace), cfg.scheduler.ttft_slo_s, cfg.scheduler.tbt_slo_s, sim.slo_limits)
        out[str(n)] = {"ttft_p50_s": s["ttft_s"].get("p50"), "ttft_mean_s": s["ttft_s"].get("mean"),
                       "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
                       "rejected": s["rejected"]}
    return out
