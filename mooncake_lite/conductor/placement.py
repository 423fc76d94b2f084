"""Placing one request: hash its blocks, snapshot the cluster, ask the scheduler core, and turn
a refusal into the HTTP error the client should see (429 / 503 / 400)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.conductor import tenants
from mooncake_lite.conductor.errors import bad_request, rejected, unavailable
from mooncake_lite.conductor.params import ApiRequest
from mooncake_lite.scheduler import ClusterState, Decision, ScheduleRequest

if TYPE_CHECKING:
    from mooncake_lite.conductor.dispatch import Services

log = logging.getLogger(__name__)


def place(svc: Services, request_id: str, req: ApiRequest, now: float,
          exclude: Collection[str] = ()) -> tuple[Decision, list[bytes]]:
    """An accepted decision and the prompt's block keys, on none of the ``exclude`` instances
    (a retry's failed ones); raises ApiError otherwise."""
    keys = prefix_hash(req.prompt_ids, svc.block_size, svc.hash_seed)
    sreq = ScheduleRequest(request_id, tuple(keys), len(req.prompt_ids), req.sampling.max_tokens)
    t0 = time.perf_counter()
    decision = tenants.schedule(svc.tenants, svc.scheduler, sreq, _snapshot(svc, req, exclude), now,
                                tenants.current())
    svc.metrics.decision.observe(time.perf_counter() - t0)
    if decision.accepted:
        svc.metrics.routes.labels(decision.route).inc()
        svc.metrics.prompt_blocks.inc(len(keys))
        svc.metrics.reused_blocks.inc(decision.reused_prefix_blocks)
        if decision.migration is not None:
            svc.metrics.migrations.inc(len(decision.migration.keys))
        if svc.on_placed is not None:
            svc.on_placed(decision, keys, now)
        log.debug("%s: %s", request_id, decision.reason)
        return decision, keys
    cause = decision.reject_cause
    if cause == "no-prefill" or (cause == "no-decode" and not svc.membership.alive("decode")):
        # Log what the client is told: the scheduler's "no decode instance with room" reads as
        # a full cluster, when in fact none is registered.
        message = f"no live {cause.split('-')[1]} instance is registered; retry later"
        log.info("%s rejected: %s", request_id, message)
        raise unavailable(message)
    log.info("%s %s", request_id, decision.reason)
    if cause == "no-decode":
        _check_fits_some_decode(svc, req)
    svc.metrics.rejections.labels(cause).inc()
    if cause == "priority":   # the tenant's class is shed at this load (conductor/tenants.py)
        raise tenants.refused(tenants.Refusal("priority", decision.reason.removeprefix("rejected: "), 1.0))
    if cause == "no-decode":
        err = rejected("every decode instance is full; retry later", 1)
    else:
        wait = decision.predicted_queue_s if cause == "ttft" else 1.0
        err = rejected(f"the cluster is overloaded: {decision.reason.removeprefix('rejected: ')}",
                       min(60, max(1, math.ceil(wait))))
    err.cause = cause   # type: ignore[attr-defined]  # the per-tenant rejections' reason
    raise err


def _snapshot(svc: Services, req: ApiRequest, exclude: Collection[str]) -> ClusterState:
    """The live cluster, without prefill instances whose KV cache cannot hold this prompt
    (the scheduler core does not know their capacity; none can: 400) or ``exclude``d ones."""
    snap, n = svc.membership.snapshot(), len(req.prompt_ids)
    if exclude:
        snap = ClusterState(tuple(p for p in snap.prefills if p.instance_id not in exclude),
                            tuple(d for d in snap.decodes if d.instance_id not in exclude))
    fits = svc.membership.fitting(snap, n)
    if snap.prefills and not fits.prefills:
        largest = max(svc.membership.instances[p.instance_id].reg.max_context for p in snap.prefills)
        raise bad_request(f"the prompt has {n} tokens but the largest prefill instance holds {largest}", "prompt")
    return fits


def _check_fits_some_decode(svc: Services, req: ApiRequest) -> None:
    """A request larger than every decode instance's KV capacity can never run: 400, not 429."""
    need = len(req.prompt_ids) + req.sampling.max_tokens
    largest = max(i.reg.max_context for i in svc.membership.alive("decode"))
    if need > largest:
        raise bad_request(f"this request needs KV room for {need} tokens (prompt + max_tokens) but the "
                          f"largest decode instance holds {largest}; shorten the prompt or max_tokens",
                          "max_tokens")
