"""Placing one request: hash its blocks, snapshot the cluster, ask the scheduler core, and turn
a refusal into the HTTP error the client should see (429 / 503 / 400)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.protocol import PrefillRequest, Register, Sampling
from mooncake_lite.conductor import tenants
from mooncake_lite.conductor.api.errors import Rejected, bad_request, unavailable
from mooncake_lite.conductor.api.params import ApiRequest
from mooncake_lite.conductor.services import Services
from mooncake_lite.scheduler import ClusterState, Decision, ScheduleRequest, schedule
from mooncake_lite.scheduler.admission import slo_limits
from mooncake_lite.scheduler.explain import wait_parts

log = logging.getLogger(__name__)


def place(svc: Services, request_id: str, req: ApiRequest, now: float, *, tenant: str,
          exclude: Collection[str] = (), is_continuation: bool = False) -> tuple[Decision, list[bytes]]:
    """An accepted decision for ``tenant``'s request and the prompt's block keys, on none of the
    ``exclude`` instances (a retry's failed ones); raises ApiError otherwise (a 429: Rejected, its
    cause the scheduler's). A continuation's client is reading already: only a lack of room refuses it."""
    keys = prefix_hash(req.prompt_ids, svc.block_size, svc.hash_seed)
    # Prompt logprobs need every position's logits: the prefill loads no cached prefix for them
    # (as vLLM), so none is priced, reused or migrated. Nor for a request's own logprobs: cached
    # blocks may come from int8-activation steps (a decode's write-back), whose KV would move its
    # values past the 1e-3 of transformers' that its float activations keep (docs/conductor.md).
    reusable = tuple(keys) if req.sampling.prompt_logprobs is None and req.sampling.logprobs is None else ()
    sreq = ScheduleRequest(request_id, reusable, len(req.prompt_ids),
                           req.sampling.max_tokens - req.sampling.num_generated, req.sampling.n)
    t0 = time.perf_counter()
    svc.predictions.show_node_states()   # each prefill priced at the speed its node's state gives it
    snap, s = _snapshot(svc, req, exclude), svc.scheduler
    decision = schedule(sreq, snap, index=s.index, config=replace(s.config, admission="none"), costs=s.costs,
                        now=now, rng=s.rng, cache=s.cache) if is_continuation else \
        tenants.schedule(svc.tenants, s, sreq, snap, now, tenant=tenant)
    svc.metrics.decision.observe(time.perf_counter() - t0)
    if decision.accepted:
        svc.num_placed += 1
        svc.metrics.routes.labels(decision.route).inc()
        svc.metrics.prompt_blocks.inc(len(keys))
        svc.metrics.reused_blocks.inc(decision.reused_prefix_blocks)
        if decision.migration is not None:
            svc.metrics.migrations.inc(len(decision.migration.keys))
        if svc.on_placed is not None:
            svc.on_placed(decision, keys, now)
        log.debug("%s: %s TBT %.3gs", request_id, decision.reason, decision.bound_tbt_s)   # the step judged
        return decision, keys
    cause = decision.reject_cause
    if cause == "no-prefill" or (cause == "no-decode" and not svc.membership.alive("decode")):
        # Log what the client is told: the scheduler's "no decode instance with room" reads as
        # a full cluster, when in fact none is registered.
        message = f"no live {cause.split('-')[1]} instance is registered; retry later"
        log.info("%s rejected: %s", request_id, message)
        raise unavailable(message)
    if cause == "no-decode":   # (not logged: a continuation waiting for a decode polls this)
        _check_fits_some_decode(svc, req, exclude)
    log.info("%s %s%s", request_id, decision.reason, _wait_told(svc, snap, decision, sreq.num_tokens, now))
    svc.metrics.rejections.labels(cause).inc()
    if cause == "priority":   # the tenant's class is shed at this load (conductor/tenants.py)
        raise tenants.refused(tenants.Refusal("priority", decision.reason.removeprefix("rejected: "), 1.0))
    if cause == "no-decode":
        raise Rejected("every decode instance is full; retry later", 1, cause)
    limits = applied_slos(svc, decision, sreq.num_tokens)
    raise Rejected(f"the cluster is overloaded: {decision.reason.removeprefix('rejected: ')}",
                   min(60, max(1, math.ceil(retry_after_s(svc, decision, limits[0], now)))), cause,
                   headers={**refusal_headers(decision), **slo_headers(limits), **placed_header(svc.num_placed)})


def placed_header(num_placed: int) -> dict[str, str]:
    """``X-Mooncake-Placed``: how many requests the conductor had placed with this one (admitted:
    its own number, from its attempt; refused: the last one's before it). A refusal's place in
    the conductor's order, which ``bench fidelity`` lands it at in the prefill's record of turns;
    a count, naming no other client's request."""
    return {"X-Mooncake-Placed": str(num_placed)}


def applied_slos(svc: Services, decision: Decision, num_tokens: int) -> tuple[float, float]:
    """The (TTFT, TBT) limits admission held a prompt of ``num_tokens`` to at ``decision``: by
    the chosen instances' models as they stood (a relative SLO moves as they are refined)."""
    prefill, decode = svc.membership.get(decision.prefill_id or ""), svc.membership.get(decision.decode_id or "")
    return slo_limits(svc.scheduler.config, num_tokens, svc.scheduler.costs,
                      prefill.view.state().cost if prefill is not None else None,
                      decode.view.state().cost if decode is not None else None)


def refusal_headers(decision: Decision) -> dict[str, str]:
    """A refusal's central predictions (``X-Mooncake-Predicted-TTFT`` / ``-TBT``) and what
    admission judged against the SLO (``X-Mooncake-Bound-TTFT`` / ``-TBT``: the prediction with
    the measured spread of its queue): a refusal whose central prediction was under its SLO was
    made on the spread alone, which a client counting wrong refusals (``bench fidelity``) tells
    apart from one the central prediction made."""
    values = {"Predicted-TTFT": decision.predicted_ttft_s, "Predicted-TBT": decision.predicted_tbt_s,
              "Bound-TTFT": decision.bound_ttft_s, "Bound-TBT": decision.bound_tbt_s}
    return {f"X-Mooncake-{k}": f"{v:.6f}" for k, v in values.items() if v is not None and math.isfinite(v)}


def slo_headers(limits: tuple[float, float]) -> dict[str, str]:
    """``X-Mooncake-SLO-TTFT`` / ``-TBT`` (seconds; none for an SLO that is off): what the
    request was judged by, so a client (``bench fidelity``) judges its outcome by the same."""
    return {f"X-Mooncake-SLO-{k}": f"{v:.6f}" for k, v in zip(("TTFT", "TBT"), limits) if math.isfinite(v)}


def retry_after_s(svc: Services, decision: Decision, ttft_limit: float, now: float) -> float:
    """When a request refused on its predicted TTFT or TBT is predicted to fit, by the same
    (corrected) predictions: a TTFT bound (``admission.bounds``) over its limit by x seconds fits
    once x seconds of the queue ahead, as the bound counts it, have drained (at most all of it); a TBT, once the chosen decode's first running request is predicted to
    leave (joined + max_tokens × its TBT)."""
    if decision.reject_cause == "ttft":
        bound = decision.bound_ttft_s or decision.predicted_ttft_s or 0.0
        return min(bound - ttft_limit, bound - (decision.predicted_ttft_s or 0.0) + decision.predicted_queue_s)
    decode = svc.membership.get(decision.decode_id or "")
    if decode is None:
        return 1.0
    state = decode.view.state()
    tbt = state.tbt_s or decision.bound_tbt_s or 0.0     # a step (the TBT predicted holds the tail)
    leaves = [r.joined_at + r.max_output_tokens * tbt for r in state.running if r.max_output_tokens is not None]
    return min(leaves) - now if leaves else 1.0


def sent_cap(decision: Decision, reg: Register) -> int:
    """``decision.pack_cap`` for a prefill that registered its chunk (one of the release that
    brought both), else 0, left off the wire: an older prefill would refuse the field, and the
    conductor is upgraded first (docs/operations.md)."""
    return decision.pack_cap if reg.prefill_chunk else 0


def prefill_request(decision: Decision, block_keys: list[bytes], upstream_id: str, transfer_id: str,
                    prompt_ids: tuple[int, ...], kv_dest: str, sampling: Sampling, pack_cap: int,
                    placed: tuple[str, int] | None = None) -> PrefillRequest:
    """The prefill call ``decision`` asks for: reuse its prefix blocks, and pull the migrated ones
    from their store first; the KV goes to ``kv_dest`` (decode's data address, or a sink);
    ``pack_cap``: :func:`sent_cap`; ``placed``: (this conductor's name, the request's number in its
    order), for a prefill that reads it (``Register.reads_placed``)."""
    m = decision.migration
    placer, number = placed if placed is not None else ("", 0)
    return PrefillRequest(upstream_id, transfer_id, prompt_ids, kv_dest, sampling,
                          prefix_keys=tuple(k.hex() for k in block_keys[:decision.reused_prefix_blocks]),
                          migrate_from=str(m.source_store_id) if m else None,
                          migrate_keys=tuple(k.hex() for k in m.keys) if m else (),
                          pack_cap=pack_cap, placed=number, placer=placer)


def _wait_told(svc: Services, snap: ClusterState, decision: Decision, num_tokens: int, now: float) -> str:
    """A TTFT refusal's wait taken apart (``scheduler/explain.py``), for its log line: what it
    waited for, when the record later says it would have met its SLO."""
    if decision.reject_cause != "ttft":
        return ""
    state = next((p for p in snap.prefills if p.instance_id == decision.prefill_id), None)
    if state is None:
        return ""
    prefix = decision.reused_prefix_blocks * svc.block_size
    return "; " + wait_parts(state, svc.scheduler.costs, num_tokens, prefix, now).describe()


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


def _check_fits_some_decode(svc: Services, req: ApiRequest, exclude: Collection[str]) -> None:
    """A request larger than every decode instance's KV capacity can never run: 400, not 429;
    one whose every live decode failed it (``exclude``) is a 503."""
    alive = svc.membership.alive("decode")   # never empty here: place() said so already
    if all(i.instance_id in exclude for i in alive):
        raise unavailable("no live decode instance other than the one that failed; retry later")
    need = len(req.prompt_ids) + req.sampling.max_tokens - req.sampling.num_generated
    largest = max(i.reg.max_context for i in alive)
    if need > largest:
        raise bad_request(f"this request needs KV room for {need} tokens (prompt + max_tokens) but the "
                          f"largest decode instance holds {largest}; shorten the prompt or max_tokens",
                          "max_tokens")


def decision_attributes(d: Decision) -> dict[str, Any]:
    """A schedule span's attributes: what Algorithm 1 chose, why, and what it predicted."""
    m = d.migration
    return {"prefill": d.prefill_id, "decode": d.decode_id, "route": d.route, "reason": d.reason,
            "predicted_ttft_s": d.predicted_ttft_s, "predicted_tbt_s": d.predicted_tbt_s,
            "predicted_queue_s": d.predicted_queue_s, "predicted_prefill_s": d.predicted_prefill_s,
            "predicted_transfer_s": d.predicted_transfer_s, "reused_prefix_blocks": d.reused_prefix_blocks,
            "local_prefix_blocks": d.local_prefix_blocks,
            "migrated_blocks": len(m.keys) if m is not None else None}

