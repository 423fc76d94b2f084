"""The scheduler's view of the conductor's instance table: each live instance's
:class:`PrefillInstanceState` / :class:`DecodeInstanceState`, built from the records
:class:`~mooncake_lite.conductor.membership.Membership` keeps.

Records a state shows (queued jobs, batch members, incoming requests) are built once per job
and reused by every later state; the shown queue, batch and incoming tuples are edited by the
Membership at its events, so a rebuild here only fills in what is missing. A rebuilt state
inherits the scheduler's estimates from the previous one (``carry_*_estimates``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake_lite.scheduler import (DecodeInstanceState, DecodingRequest, IncomingRequest,
                                     PrefillInstanceState, QueuedPrefill, carry_queue_estimates,
                                     carry_running_estimates, context_lag_bound)

if TYPE_CHECKING:
    from mooncake_lite.conductor.membership import DecodeJob, Instance, PrefillJob


def build_state(inst: Instance) -> PrefillInstanceState | DecodeInstanceState:
    inst.state = _prefill_state(inst) if inst.reg.role == "prefill" else _decode_state(inst)
    inst.is_stale = False
    return inst.state


def queued_record(job: PrefillJob) -> QueuedPrefill:
    q = job.queued
    if q is None or q.started_at != job.started_at:
        q = job.queued = QueuedPrefill(job.request_id, job.num_tokens, job.num_prefix_tokens, job.started_at)
    return q


def incoming_record(job: PrefillJob) -> IncomingRequest:
    if job.incoming is None:   # the context it brings: prompt + first token, as add_decode will record
        job.incoming = IncomingRequest(job.request_id, job.num_tokens + 1, job.max_output_tokens)
    return job.incoming


def _prefill_limits(inst: Instance) -> tuple:
    """(store id, inbound bandwidth) as the prefill state shows them, kept in ``inst.limits``
    until a heartbeat changes them."""
    # No store: a unique id no block event names, so nothing counts as cached there.
    store_id = inst.reg.store if inst.reg.store else f"(no store):{inst.instance_id}"
    bandwidth = inst.costs.bandwidth_bytes_per_s or inst.load.get("bandwidth_bytes_per_s") or None
    inst.limits = (store_id, bandwidth)
    return inst.limits


def _prefill_state(inst: Instance) -> PrefillInstanceState:
    store_id, bandwidth = inst.limits or _prefill_limits(inst)
    if inst.queue is None:
        inst.queue = tuple(map(queued_record, inst.prefill_jobs.values()))
    state = PrefillInstanceState(inst.reg.instance_id, store_id, inst.queue, bandwidth, inst.costs.prefill)
    if inst.state is not None:
        carry_queue_estimates(inst.state, state)
    return state


def shown_record(job: DecodeJob, refresh: bool) -> DecodingRequest:
    """The job as a state shows it: built when it joins; a rebuild for another reason (a
    request joining or leaving) reuses it, lag and all (a record costs about a microsecond);
    a rebuild for the batch's lag refreshes every record, so the lag starts again from zero."""
    shown = job.shown
    if shown is None or (refresh and shown.context_tokens != job.context_tokens):
        shown = job.shown = DecodingRequest(job.request_id, job.context_tokens, job.joined_at,
                                            job.max_output_tokens)
    return shown


def unshow(inst: Instance, job: DecodeJob) -> None:
    """Take a leaving job's shown context and lag out of its instance's totals."""
    if job.shown is not None:
        inst.shown_context -= job.shown.context_tokens
        inst.context_lag -= job.context_tokens - job.shown.context_tokens


def _decode_limits(inst: Instance) -> tuple:
    """(max batch size, max context tokens) as the decode state shows them, kept in
    ``inst.limits`` until a heartbeat changes them."""
    # Register.max_context of a decode instance is its KV capacity in tokens.
    max_context = _int_or_none(inst.load.get("max_context_tokens")) or _int_or_none(inst.reg.max_context)
    inst.limits = (_int_or_none(inst.load.get("max_batch_size")), max_context)
    return inst.limits


def _show_batch(inst: Instance, refresh: bool) -> None:
    """Rebuild the shown batch (refreshed records when ``refresh``) and recount its totals."""
    jobs = inst.decode_jobs.values()
    inst.running = tuple(shown_record(j, refresh) for j in jobs)
    inst.shown_context = sum(r.context_tokens for r in inst.running)
    inst.context_lag = sum(j.context_tokens for j in jobs) - inst.shown_context


def _decode_state(inst: Instance) -> DecodeInstanceState:
    refresh, inst.is_context_stale = inst.is_context_stale, False
    if inst.running is None or refresh:
        _show_batch(inst, refresh)
        if inst.context_lag > context_lag_bound(inst.shown_context):
            _show_batch(inst, True)   # e.g. lag carried over a re-registration or a replaced job
        inst.batch_edits = None       # new records: the estimates cannot be edited by a few
    if inst.incoming is None:
        inst.incoming = tuple(map(incoming_record, inst.incoming_jobs.values()))
    max_batch, max_context = inst.limits or _decode_limits(inst)
    state = DecodeInstanceState(inst.reg.instance_id, inst.running, max_batch, max_context, inst.costs.decode,
                                inst.incoming)
    if inst.state is not None:
        carry_running_estimates(inst.state, state, inst.batch_edits)
    inst.batch_edits = []
    return state


def _int_or_none(value: float | None) -> int | None:
    return int(value) if value is not None and value > 0 else None
