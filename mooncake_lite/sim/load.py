"""The simulated cluster's load as the paper plots it (Fig. 9/10), sampled by its recorder: each
function reads a ``sim.cluster.MooncakeSim`` (``sim``), which imports this module."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake_lite.scheduler.estimate import queues_at

if TYPE_CHECKING:
    from mooncake_lite.sim.request import SimRequest


def load_sample(sim, now: float) -> dict[str, float]:
    """Load as the paper plots it (Fig. 9/10): prefill = mean predicted queue time over the
    TTFT SLO; decode = mean step time (TBT) over the TBT SLO; ``decode_held_load`` = the same
    with everything the decodes hold (running and reserved: what their own check judges);
    cumulative rejections by stage; plus raw counts. Relative SLOs: each instance's time over
    the limit of the mean prompt it holds (:func:`held_limits`)."""
    # prefill_queue_time of each, through the scheduler's cache (the same values: tested)
    queue = queues_at(sim.scheduler.cache.backlogs(sim.cluster_state().prefills, sim.costs), now).queue_s
    tbts = [d.batch.step_time() for d in sim.decodes]
    held = [d.held_step_time() for d in sim.decodes]
    if sim.ttft_slo_s is None or sim.tbt_slo_s is None:
        ttfts, tbt_lims = held_limits(sim)
        queue = [q / lim for q, lim in zip(queue, ttfts)]
        tbts = [t / lim for t, lim in zip(tbts, tbt_lims)]
        held = [t / lim for t, lim in zip(held, tbt_lims)]
        ttft_slo = tbt_slo = 1.0
    else:
        ttft_slo, tbt_slo = sim.ttft_slo_s, sim.tbt_slo_s
    return {"prefill_load": sum(queue) / len(queue) / ttft_slo,
            "decode_load": sum(tbts) / len(tbts) / tbt_slo,
            "decode_load_max": max(tbts) / tbt_slo,
            "decode_held_load": sum(held) / len(held) / tbt_slo,
            "refused_conductor": float(sim.refused["conductor"]),
            "refused_decode": float(sim.refused["decode"]),
            "prefill_queued": float(sum(p.num_jobs() for p in sim.prefills)),
            "decode_running": float(sum(len(d.batch) for d in sim.decodes))}


def held_limits(sim) -> tuple[list[float], list[float]]:
    """Each prefill's TTFT limit and each decode's TBT limit for the mean prompt it holds
    (queued or prefilling; running, waiting to join or for its KV): what its load is judged
    against under relative SLOs (an instance holding nothing has no load to judge)."""
    def mean_prompt(reqs: list[SimRequest]) -> int:
        return max(1, sum(r.input_length for r in reqs) // len(reqs)) if reqs else 1
    ttft = [sim.slo_limits(mean_prompt([*p.waiting, *p.packed, *([p.current] if p.current else [])]),
                           p.instance_id)[0] for p in sim.prefills]
    tbt = [sim.slo_limits(mean_prompt([*d.batch.running.values(), *d.pending, *d.committed.values()]))[1]
           for d in sim.decodes]
    return ttft, tbt
