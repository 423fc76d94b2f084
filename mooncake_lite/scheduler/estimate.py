"""Estimators built on the cost models: queue time, prefill time per instance, decode TBT now
and at a future time (the prediction of REFERENCE.md §3)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from mooncake_lite.scheduler.costs import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.state import (ClusterState, DecodeInstanceState, PrefillInstanceState,
                                           QueuedPrefill)


def prefill_model(p: PrefillInstanceState, costs: CostModels) -> PrefillCostModel:
    """The instance's self-profiled model if it reported one, else the cluster default."""
    return p.cost or costs.prefill


def decode_model(d: DecodeInstanceState, costs: CostModels) -> DecodeCostModel:
    return d.cost or costs.decode


def queued_finish_times(p: PrefillInstanceState, costs: CostModels,
                        now: float) -> Iterator[tuple[QueuedPrefill, float]]:
    """Each queued job with its predicted finish time, running them back to back from ``now``;
    a started job only has its predicted remainder (never negative) left."""
    model = prefill_model(p, costs)
    t = now
    for job in p.queue:
        duration = model.predict(job.num_tokens, job.num_prefix_tokens)
        if job.started_at is not None:
            duration = max(0.0, duration - (now - job.started_at))
        t += duration
        yield job, t


def prefill_queue_time(p: PrefillInstanceState, costs: CostModels, now: float) -> float:
    """EstimatePrefillQueueTime: the sum of predicted prefill times of the work ahead."""
    end = now
    for _, end in queued_finish_times(p, costs, now):
        pass
    return end - now


def decode_has_room(d: DecodeInstanceState, num_tokens: int, max_output_tokens: int,
                    batch_size: int, context_tokens: int) -> bool:
    """Capacity check for adding one request to a batch of the given size/context."""
    if d.max_batch_size is not None and batch_size + 1 > d.max_batch_size:
        return False
    if d.max_context_tokens is not None and \
            context_tokens + num_tokens + max_output_tokens > d.max_context_tokens:
        return False
    return True


def decode_load_now(d: DecodeInstanceState) -> tuple[int, int]:
    """(batch size, context tokens) of the running batch."""
    return len(d.running), sum(r.context_tokens for r in d.running)


def decode_tbt(d: DecodeInstanceState, costs: CostModels, batch_size: int, context_tokens: int) -> float:
    return decode_model(d, costs).predict(batch_size, context_tokens)


def arrivals_by(cluster: ClusterState, costs: CostModels, now: float,
                t: float) -> dict[str, list[int]]:
    """Per decode id, the prompt lengths of queued prefills predicted to finish by ``t``
    (step 1 of the §3 prediction: those requests will have joined their decode batch)."""
    arrivals: dict[str, list[int]] = defaultdict(list)
    for p in cluster.prefills:
        for job, end in queued_finish_times(p, costs, now):
            if end > t:
                break  # jobs run in order: the rest end later
            if job.decode_id is not None:
                arrivals[job.decode_id].append(job.num_tokens)
    return arrivals


def decode_load_at(d: DecodeInstanceState, costs: CostModels, t: float,
                   arriving_tokens: list[int], uniform_decode_s: float | None) -> tuple[int, int]:
    """(batch size, context tokens) predicted for time ``t`` (§3): requests whose decode would
    have ended by ``t`` — joined_at + t_d <= t — leave; the arriving prefills join.

    With ``uniform_decode_s`` None, t_d is estimated per request as its max_output_tokens times
    the instance's current TBT."""
    tbt_now = None
    batch, context = 0, 0
    for r in d.running:
        t_d = uniform_decode_s
        if t_d is None:
            if tbt_now is None:
                tbt_now = decode_tbt(d, costs, *decode_load_now(d))
            t_d = r.max_output_tokens * tbt_now
        if r.joined_at + t_d > t:
            batch += 1
            context += r.context_tokens
    return batch + len(arriving_tokens), context + sum(arriving_tokens)
