"""The ``conductor`` case of ``mooncake bench conductor --parts decision``: decisions timed the
way the live conductor makes them, on its own bookkeeping in a steady state.

The synthetic cluster of :func:`mooncake_lite.bench.conductor.build_cluster` is loaded into a
real :class:`~mooncake_lite.conductor.cluster.membership.Membership` (registered instances, queued
prefill jobs, running decode jobs). Each iteration then does what the conductor does around one
request, and only the first step is timed — the same span the conductor's
``decision_seconds`` histogram measures:

1. ``membership.snapshot()`` + ``scheduler.schedule()``;
2. dispatch: the request is queued on the chosen prefill and committed to the chosen decode (a
   random pair when it was refused, so the cluster changes at the same rate either way);
3. meanwhile elsewhere: one queued prefill ends and its request joins its decode batch, one
   running request finishes, and each decode instance runs 0 to 2 × ``tokens_per_decision``
   steps (on average about arrival interval / decode step time; instances step on their own
   clocks, so they do not all cross the context-lag bound at the same decision).

Queue lengths and batch sizes therefore stay where they started, while every kind of change
the conductor sees keeps invalidating instance states between decisions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mooncake_lite.common.cost_report import CostReport
from mooncake_lite.common.protocol import Register
from mooncake_lite.conductor.cluster.membership import DecodeJob, Membership, PrefillJob
from mooncake_lite.instance.refine import cost_report
from mooncake_lite.scheduler import (ClusterState, DecodeCostModel, PrefillCostModel, ScheduleRequest,
                                     Scheduler)

MODEL = "bench"
ARRIVAL_INTERVAL_S = 0.1     # simulated time between decisions


def _register(m: Membership, role: str, iid: str, store: str | None, block_size: int,
              cost: PrefillCostModel | DecodeCostModel | None) -> None:
    m.register(Register(role=role, instance_id=iid, http=f"127.0.0.1:{len(m.instances) + 1}",
                        data="127.0.0.1:0" if role == "decode" else None, store=store, model=MODEL,
                        block_size=block_size, hash_seed=0, kv_bytes_per_token=1,
                        max_context=1 << 40, cost=cost_report(cost) or CostReport()), now=0.0)


def build_membership(cluster: ClusterState, block_size: int) -> Membership:
    """A Membership with the instances of the synthetic ``cluster`` registered (its jobs:
    :class:`SteadyConductor`)."""
    m = Membership(MODEL, block_size, 0, dead_after_s=1e9)
    for p in cluster.prefills:
        _register(m, "prefill", p.instance_id, str(p.store_id), block_size, p.cost)
    for d in cluster.decodes:
        _register(m, "decode", d.instance_id, None, block_size, d.cost)
    return m


class SteadyConductor:
    """Drives a Membership through decisions and the churn between them (see module doc),
    starting with exactly the jobs of the synthetic ``cluster``. It keeps the jobs its instances
    hold itself, as they would: Membership's jobs are its views', and reading them between
    decisions would build the states the next timed snapshot builds."""

    def __init__(self, m: Membership, sched: Scheduler, tokens_per_decision: int, seed: int,
                 cluster: ClusterState) -> None:
        self.m, self.sched, self.tokens = m, sched, tokens_per_decision
        self.rng = random.Random(seed)
        self.now = 0.0
        self.count = 0
        self.prefill_ids = [i.instance_id for i in m.alive("prefill")]
        self.decode_ids = [i.instance_id for i in m.alive("decode")]
        self.queued: dict[str, dict[str, PrefillJob]] = {i: {} for i in self.prefill_ids}   # FIFO
        self.running: dict[str, dict[str, None]] = {i: {} for i in self.decode_ids}
        bound_for = {r.request_id: d.instance_id for d in cluster.decodes for r in d.incoming}
        for p in cluster.prefills:
            for q in p.queue:
                self._dispatch(p.instance_id, PrefillJob(q.request_id, q.num_tokens, q.num_prefix_tokens,
                                                         bound_for[q.request_id], max_output_tokens=256))
        for d in cluster.decodes:
            for r in d.running:
                self._join(d.instance_id, DecodeJob(r.request_id, r.context_tokens, r.joined_at,
                                                    r.max_output_tokens or 512))

    def _dispatch(self, pid: str, job: PrefillJob) -> None:
        self.m.add_prefill(pid, job, self.now)
        self.queued[pid][job.request_id] = job

    def _join(self, did: str, job: DecodeJob) -> None:
        self.m.add_decode(did, job)
        self.running[did][job.request_id] = None

    def decide(self, req: ScheduleRequest):
        # As conductor/placement.py: the snapshot, less prefills too small for the prompt.
        return self.sched.schedule(req, self.m.fitting(self.m.snapshot(), req.num_tokens), self.now)

    def after(self, req: ScheduleRequest, decision) -> None:
        self.count += 1
        pid = decision.prefill_id if decision.accepted else self.rng.choice(self.prefill_ids)
        did = decision.decode_id if decision.accepted else self.rng.choice(self.decode_ids)
        self._dispatch(pid, PrefillJob(f"{req.request_id}#{self.count}", req.num_tokens,
                                       decision.reused_prefix_blocks * self.m.block_size, did,
                                       max_output_tokens=req.max_output_tokens))
        self.now += ARRIVAL_INTERVAL_S
        self._finish_one_prefill()
        self._finish_one_decode()
        self._generate()

    def _finish_one_prefill(self) -> None:
        pid = self.rng.choice([i for i in self.prefill_ids if self.queued[i]])
        job = self.queued[pid].pop(next(iter(self.queued[pid])))
        self.m.prefill_done(pid, job.request_id, self.now)
        self._join(job.decode_id, DecodeJob(job.request_id, job.num_tokens + 1, self.now,
                                            job.max_output_tokens or 256))

    def _finish_one_decode(self) -> None:
        did = self.rng.choice([i for i in self.decode_ids if self.running[i]])
        rid = self.rng.choice(list(self.running[did]))
        del self.running[did][rid]
        self.m.release(rid, (did,), self.now)

    def _generate(self) -> None:
        for did in self.decode_ids:
            steps = self.rng.randint(0, 2 * self.tokens)
            for rid in list(self.running[did]):
                self.m.decode_progress(did, rid, steps)


def time_each(iterations: int, timed: Callable[[int], Any],
              before: Callable[[int], None] | None = None,
              after: Callable[[int, Any], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(wall µs, thread-CPU µs) of ``timed(i)`` for each i; ``before(i)`` and ``after(i, result)``
    run around it, untimed. CPU time is reported too because on a shared machine the
    wall-clock tail is mostly preemption by other processes."""
    wall, cpu = np.empty(iterations), np.empty(iterations)
    for i in range(iterations):
        if before is not None:
            before(i)
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        result = timed(i)
        cpu[i] = time.thread_time_ns() - start_cpu
        wall[i] = time.perf_counter_ns() - start
        if after is not None:
            after(i, result)
    return wall / 1e3, cpu / 1e3


def time_steady_decisions(cluster: ClusterState, sched: Scheduler, requests: list[ScheduleRequest],
                          iterations: int, tokens_per_decision: int, block_size: int,
                          seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(wall µs, thread-CPU µs) per decision, snapshot included."""
    driver = SteadyConductor(build_membership(cluster, block_size), sched, tokens_per_decision, seed, cluster)
    return time_each(iterations, lambda i: driver.decide(requests[i % len(requests)]),
                     after=lambda i, decision: driver.after(requests[i % len(requests)], decision))
