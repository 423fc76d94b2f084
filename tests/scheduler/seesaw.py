"""A scripted overload scenario in discrete steps, driving the real Scheduler (pure, deterministic).

Several prefill instances, one decode instance, a steady stream of identical requests arriving
faster than decode can serve them. Ground truth uses the same cost models the scheduler
predicts with and every decode lasts exactly t_d, so the admission modes differ only in *when*
they read the decode load. A request whose KV reaches a full decode instance is refused there
(``decode_admits``) and its prefill is wasted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake_lite.scheduler import (BlockIndex, ClusterState, CostModels, DecodeCostModel,
                                     DecodeInstanceState, DecodingRequest, IncomingRequest,
                                     PrefillCostModel,
                                     PrefillInstanceState, QueuedPrefill, ScheduleRequest,
                                     Scheduler, SchedulerConfig, decode_admits)

PROMPT_TOKENS = 1000
COSTS = CostModels(prefill=PrefillCostModel(c1=4e-3),          # 4 s per request
                   decode=DecodeCostModel(c0=0.02, c1=0.01),   # TBT <= 0.1 s  <=>  batch <= 8
                   kv_bytes_per_token=1)
DECODE_S = 10.0                                                # t_d: 8 slots / 10 s = 0.8 req/s
NUM_PREFILL = 8                                                # 8 / 4 s = 2 req/s of prefill


@dataclass
class Trace:
    prefill_busy: list[int] = field(default_factory=list)    # instances with work, per step
    decode_batch: list[int] = field(default_factory=list)
    admitted: int = 0
    rejected: int = 0
    wasted_prefills: int = 0
    completed: int = 0


def run_scenario(admission: str, *, duration_s: float = 300.0, dt: float = 0.25,
                 arrivals_per_s: float = 4.0, decode_spread_s: float = 0.0) -> Trace:
    """``decode_spread_s`` > 0 makes real decode times differ from the t_d the scheduler
    assumes: request k decodes for t_d + spread * ((k * 7) % 11 / 10 - 0.5) seconds."""
    config = SchedulerConfig(strategy="kvcache-centric", admission=admission, ttft_slo_s=30.0,
                             tbt_slo_s=0.1, block_size=512, uniform_decode_s=DECODE_S)
    sched = Scheduler(config, COSTS, BlockIndex())
    queues: list[list[QueuedPrefill]] = [[] for _ in range(NUM_PREFILL)]
    running: list[DecodingRequest] = []
    trace, seq, owed = Trace(), 0, 0.0
    for step in range(int(duration_s / dt)):
        now = step * dt
        trace.completed += sum(_leaves(r, decode_spread_s) <= now for r in running)
        running = [r for r in running if _leaves(r, decode_spread_s) > now]
        finished = sorted(f for q in queues for f in _advance(q, now))
        for end, job in finished:   # in completion order, so earlier KV gets the free slots
            req = ScheduleRequest(job.request_id, (), job.num_tokens, 1)
            if decode_admits(DecodeInstanceState("d0", tuple(running)), req, COSTS, config.tbt_slo_s):
                running.append(DecodingRequest(job.request_id, job.num_tokens, end, 1))
            else:
                trace.wasted_prefills += 1
        owed += arrivals_per_s * dt
        while owed >= 1.0:
            owed -= 1.0
            seq += 1
            _arrive(sched, ScheduleRequest(f"r{seq}", (), PROMPT_TOKENS, 100), queues, running, now, trace)
        trace.prefill_busy.append(sum(1 for q in queues if q))
        trace.decode_batch.append(len(running))
    return trace


def _leaves(r: DecodingRequest, spread_s: float) -> float:
    k = int(r.request_id[1:])
    return r.joined_at + DECODE_S + spread_s * ((k * 7) % 11 / 10 - 0.5)


def _arrive(sched: Scheduler, req: ScheduleRequest, queues: list[list[QueuedPrefill]],
            running: list[DecodingRequest], now: float, trace: Trace) -> None:
    # Every queued prefill is committed to the one decode instance: the caller says so.
    incoming = tuple(IncomingRequest(job.request_id, job.num_tokens, 1) for q in queues for job in q)
    cluster = ClusterState(
        tuple(PrefillInstanceState(f"p{i}", f"s{i}", tuple(q)) for i, q in enumerate(queues)),
        (DecodeInstanceState("d0", tuple(running), incoming=incoming),))
    decision = sched.schedule(req, cluster, now)
    if not decision.accepted:
        trace.rejected += 1
        return
    trace.admitted += 1
    q = queues[int(decision.prefill_id[1:])]
    q.append(QueuedPrefill(req.request_id, req.num_tokens, started_at=None if q else now))


def _advance(queue: list[QueuedPrefill], now: float) -> list[tuple[float, QueuedPrefill]]:
    """Pop the jobs of one instance that finished by ``now`` (back to back) with end times."""
    done = []
    while queue and queue[0].started_at is not None:
        job = queue[0]
        end = job.started_at + COSTS.prefill.predict(job.num_tokens)
        if end > now:
            break
        queue.pop(0)
        done.append((end, job))
        if queue:
            nxt = queue[0]
            queue[0] = QueuedPrefill(nxt.request_id, nxt.num_tokens, nxt.num_prefix_tokens, end)
    return done
