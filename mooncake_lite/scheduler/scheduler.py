"""The conductor's decision: Algorithm 1 (docs/paper.md §2) plus overload admission (§3), then,
for a tenant's request, its priority class (``tenants.py``).

Pure: no IO, no clock. The live conductor and the simulator both build a :class:`ClusterState`
snapshot, call :meth:`Scheduler.schedule` with their ``now``, and execute the returned
:class:`Decision` (dispatch prefill/decode, run the migration, or answer 429).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from mooncake_lite.scheduler.admission import DecodeChoice, bounds, choose_decode, slo_violation, ttft_limit
from mooncake_lite.scheduler.block_index import BlockIndex
from mooncake_lite.scheduler.cache import FROM_SCRATCH, EstimateCache, Estimates
from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.scheduler.costs import CostModels
from mooncake_lite.scheduler.decision import Decision, Migration, RejectCause, make_decision
from mooncake_lite.scheduler.estimate import prefill_model
from mooncake_lite.scheduler.packing import slo_pack_cap
from mooncake_lite.scheduler.prefill_select import PrefillChoice, choose_prefill
from mooncake_lite.scheduler.queue_order import landed_pack_tokens
from mooncake_lite.scheduler.state import ClusterState, ScheduleRequest

if TYPE_CHECKING:
    from mooncake_lite.scheduler.tenants import Tenant

_new = tuple.__new__   # a NamedTuple without its constructor's Python frame (estimate.py)

def _route_reason(req: ScheduleRequest, c: PrefillChoice) -> str:
    n = len(req.block_keys)
    pid = c.instance.instance_id
    if c.route == "transfer":
        return (f"transfer from {c.source_store_id}: {c.reused_blocks - c.local_blocks} blocks to "
                f"{pid} ({c.local_blocks}/{n} local)")
    if c.route == "local-hit":
        return f"local hit: {c.local_blocks}/{n} blocks on {pid}"
    if c.route == "random":
        return f"random: {pid}"
    return f"balance: {pid} queue {c.queue_s:.3g}s"


def _migration(req: ScheduleRequest, c: PrefillChoice) -> Migration | None:
    """Algorithm 1 step 5: when the chosen instance was costed with the best prefix fetched
    from another store, the caller must copy those blocks there (hot-spot replication)."""
    if c.route != "transfer":
        return None
    keys = tuple(req.block_keys[c.local_blocks:c.reused_blocks])
    return Migration(c.source_store_id, c.instance.store_id, keys)


def schedule(req: ScheduleRequest, cluster: ClusterState, *, index: BlockIndex,
             config: SchedulerConfig, costs: CostModels, now: float,
             rng: random.Random | None = None, cache: Estimates | None = None) -> Decision:
    """Place one request. ``rng`` is required (and only used) by strategy ``random``. ``cache``
    keeps what is derived per instance between decisions (None: everything from scratch; the
    decision is the same either way)."""
    return _schedule(req, cluster, index, config, costs, now, rng, cache)


def _schedule(req: ScheduleRequest, cluster: ClusterState, index: BlockIndex, config: SchedulerConfig,
              costs: CostModels, now: float, rng: random.Random | None, cache: Estimates | None) -> Decision:
    """:func:`schedule` by position (Scheduler.schedule's call, once per request: binding seven
    keywords costs more than the call): estimates, then each choice by its rule
    (scheduler/rules.py), then admission."""
    estimates = cache or FROM_SCRATCH
    match = index.match(req.block_keys)
    queues = estimates.prefill_queues(cluster.prefills, costs, now)   # read by both choices
    p = choose_prefill(req, cluster.prefills, match, config, costs, queues, rng)
    if p is None:
        return make_decision(accepted=False, reason="rejected: no live prefill instance", reject_cause="no-prefill")
    d = choose_decode(req, cluster, config, costs, now, p.ttft_s, rng, queues, estimates)
    if d is None:
        return _decision(False, "rejected: no decode instance with room", p, None, bounds(p, None), "no-decode")
    bound = bounds(p, d)   # judged by admission and carried by the decision: computed once
    violation = slo_violation(config, req, costs, p, d, bound)
    if violation is not None:
        return _decision(False, violation[1], p, d, bound, violation[0])
    # (the TBT predicted is the decision's field, formatted where it is logged: a float's
    # formatting here was ~0.3% of a live decision, bin/decision-cost)
    reason = f"{_route_reason(req, p)}; decode {d.instance.instance_id}"
    cap = _pack_cap(config, req, costs, p, bound[0]) if p.instance.pack_tokens > 0 else 0
    return _decision(True, reason, p, d, bound, None, _migration(req, p), cap)


def _pack_cap(cfg: SchedulerConfig, req: ScheduleRequest, costs: CostModels, p: PrefillChoice,
              bound_ttft_s: float) -> int:
    """The cap an admitted request sets on the packs it may be in, on an instance that packs and
    under an SLO (``packing.slo_pack_cap``): what its TTFT limit leaves its forward, after what
    admission judged comes before that forward (its queue and transfer, by their bound). Without
    it the requests queued after a short prompt join its forward until it holds the whole budget,
    and the prompt misses its SLO (10x its own prefill) in a forward of the long ones it never saw.
    Set under admission ``none`` too: it refuses nobody, it only says who may join whom."""
    budget, model, prefix = p.instance.pack_tokens, prefill_model(p.instance, costs), p.reused_blocks * cfg.block_size
    limit = ttft_limit(cfg, req.num_tokens, costs, model)
    cap = slo_pack_cap(model, budget, limit - (bound_ttft_s - p.prefill_s), req.num_tokens, prefix)
    if cap:   # never under the pack it was priced in: the cap must not make its prediction wrong
        cap = max(cap, landed_pack_tokens(p.instance.queue, req.num_tokens, prefix, budget, p.instance.overtakes))
    return cap if cap < budget else 0


def _decision(accepted: bool, reason: str, p: PrefillChoice, d: DecodeChoice | None,
              bound: tuple[float, float | None], reject_cause: RejectCause | None = None,
              migration: Migration | None = None, pack_cap: int = 0) -> Decision:
    """The plan made of both choices (on rejection: the best candidates found, never dispatched)."""
    ttft, tbt = bound
    # The TBT predicted is the paper's (the slowest tenth of gaps): the step foreseen × the decode's
    # learned tail. Admission judges the step (admission.bounds): judged with the tail, the
    # simulator refused 5 more at the live default SLO, all of which would have met it
    # (docs/results/2026-11-29-decode-load.md).
    # Built as make_decision builds it, in Decision's field order, without its call: a frame and
    # 12 keywords bound were ~1k instructions of a live decision (bin/decision-cost).
    return _new(Decision, (accepted, reason, p.instance.instance_id, None if d is None else d.instance.instance_id,
                           p.route, reject_cause, p.ttft_s, None if d is None else d.tbt_s * d.instance.tbt_tail,
                           p.queue_s, p.prefill_s, p.transfer_s, p.reused_blocks, p.local_blocks, p.source_store_id,
                           migration, ttft, tbt, pack_cap))


class Scheduler:
    """Holds the policy, the cost models, the global block index, the rng and the estimate
    cache between calls.

    The owner feeds store events into ``index`` (``index.apply(event)``) and calls
    :meth:`schedule` per request; swapping ``costs`` when instances report new profiles is a
    plain attribute assignment (CostModels is immutable). ``cache`` defaults to an
    :class:`~mooncake_lite.scheduler.cache.EstimateCache`; a ``FromScratch`` one gives the same
    decisions, slower."""

    def __init__(self, config: SchedulerConfig, costs: CostModels, index: BlockIndex | None = None,
                 rng: random.Random | None = None, cache: Estimates | None = None) -> None:
        self.config = config
        self.costs = costs
        self.index = index if index is not None else BlockIndex()
        self.rng = rng if rng is not None else random.Random(0)
        self.cache = cache if cache is not None else EstimateCache()

    def schedule(self, req: ScheduleRequest, cluster: ClusterState, now: float,
                 tenant: Tenant | None = None) -> Decision:
        """With a ``tenant``: decided under its SLOs, and an accepted decision judged by the
        priority rule (``scheduler/tenants.py``), rejected with cause ``priority`` when shed."""
        if tenant is None:
            return _schedule(req, cluster, self.index, self.config, self.costs, now, self.rng, self.cache)
        decision = _schedule(req, cluster, self.index, tenant.config, self.costs, now, self.rng, self.cache)
        return tenant.shed(decision, req, cluster, self.costs, now) if decision.accepted else decision
