"""Running one request through the cluster: schedule, reserve decode, prefill, relay tokens.

The order is the protocol's (``common/protocol.py``): ``POST /v1/generate`` on the decode
instance first (it reserves room, may refuse with 429, and answers with an NDJSON stream of
TokenEvents from the second token on), then ``POST /v1/prefill`` on the prefill instance
(which streams the KV to decode's data address and answers with the first token). Everything
that can happen to a request in flight — prefill result, decode tokens, decode's end line,
an HTTP failure, an instance declared dead — lands on one queue, so the relay loop is a plain
``await queue.get()`` and the order of events on the wire does not matter.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from mooncake_lite.common import tracing
from mooncake_lite.common.protocol import PrefillResult
from mooncake_lite.conductor.api.errors import ApiError, rejected, shutting_down, upstream_failed
from mooncake_lite.conductor.membership import DecodeJob, Instance, Membership, PrefillJob
from mooncake_lite.conductor.cluster.metrics import ConductorMetrics
from mooncake_lite.conductor.flight.output_lengths import OutputHistory
from mooncake_lite.conductor.api.params import ApiRequest
from mooncake_lite.conductor.flight.placement import place
from mooncake_lite.conductor.tenants import TenantGate
from mooncake_lite.conductor.flight.upstream import SHUTDOWN, Failure, post_abort
from mooncake_lite.conductor.flight.workers import UpstreamWorkers
from mooncake_lite.scheduler import Decision, Scheduler
from mooncake_lite.scheduler.links import observe_migration

log = logging.getLogger(__name__)
DECODE_END_GRACE_S = 2.0


@dataclass
class Services:
    """What a request needs from the app (one per conductor)."""

    session: aiohttp.ClientSession
    membership: Membership
    scheduler: Scheduler
    metrics: ConductorMetrics
    block_size: int
    hash_seed: int
    cluster_token: str | None = None
    upstream_timeout_s: float = 300.0
    kv_timeout_s: float = 30.0
    max_retries: int = 2          # re-dispatches of a request that failed before its first token
    background: set[asyncio.Task] = field(default_factory=set)
    outputs: OutputHistory = field(default_factory=OutputHistory)   # predicted output lengths
    tenants: TenantGate | None = None   # per-tenant limits, SLOs and priorities (conductor/tenants.py)
    # told each accepted placement (decision, block keys, now): hot-block heat (conductor/hot_replication.py)
    on_placed: Callable[[Decision, list[bytes], float], None] | None = None

    def spawn(self, coro: Any) -> None:
        """Fire-and-forget work (aborts) that must outlive a cancelled handler."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


class Flight(UpstreamWorkers):
    """One request in flight. ``await start()`` (raises ApiError: 429/502/503), then iterate
    :meth:`tokens`, then always ``await close()``. Its calls to the instances (the decode
    reservation and the workers that feed the attempt's queue) are in ``workers.py``.

    A request is dispatched in *attempts*: one placement, one decode reservation, one prefill.
    An attempt that fails before the first token reached the client is torn down and the
    request placed again (at most ``Services.max_retries`` times) without the instances that
    failed it; each attempt has its own upstream request id and transfer id, so nothing from a
    torn-down attempt can reach the next one. Once a token is out, a failure ends the request."""

    def __init__(self, svc: Services, req: ApiRequest, request_id: str | None = None) -> None:
        self.svc = svc
        self.req = req
        self.request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        self.num_retries = 0
        self._excluded: set[str] = set()     # instances a failed attempt ran on
        self.prefill_result: PrefillResult | None = None
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.expected_output = req.sampling.max_tokens
        self._is_closed = False
        # The request's trace (None when tracing is off): a child of the client's traceparent if it sent one.
        self.span = tracing.start_span("conductor.request", kind="server", request_id=self.request_id,
                                       prompt_tokens=len(req.prompt_ids), max_tokens=req.sampling.max_tokens)
        self._new_attempt(self.request_id)

    def _new_attempt(self, upstream_id: str) -> None:
        self.upstream_id = upstream_id     # what prefill, decode and the membership know it by
        self.transfer_id = uuid.uuid4().hex
        self.decision: Decision | None = None
        self.block_keys: list[bytes] = []
        self.prefill: Instance | None = None
        self.decode: Instance | None = None
        self._queue: asyncio.Queue[tuple] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._decode_resp: aiohttp.ClientResponse | None = None
        self._is_prefill_done = False
        self._is_decode_done = False
        self._decode_span = None           # conductor → decode, open while decode streams tokens

    # ---- start ---------------------------------------------------------------------------
    async def start(self) -> None:
        failure = await self._start_attempt()
        while failure is not None:
            failure = await self._retry(failure)

    async def _start_attempt(self) -> Failure | None:
        """Place the request, reserve decode, start prefill; a Failure if decode failed."""
        span = tracing.start_span("conductor.schedule", self.span, attempt=self.num_retries + 1,
                                  excluded=sorted(self._excluded) or None)
        try:
            d, self.block_keys = place(self.svc, self.upstream_id, self.req, _now(), self._excluded)
        except ApiError as exc:
            tracing.end_span(span, exc.message, status=exc.status)
            raise
        self.decision = d
        if span is not None:
            tracing.end_span(span, **decision_attributes(d))
        svc = self.svc
        self.prefill = svc.membership.get(d.prefill_id)
        self.decode = svc.membership.get(d.decode_id)
        now = _now()
        for inst in (self.prefill, self.decode):
            svc.membership.watch(inst.instance_id, self.upstream_id, self._death_watch(inst.instance_id))
        # predictive admission sizes this request's decode time with its predicted output
        self.expected_output = svc.outputs.expected(self.block_keys, len(self.req.prompt_ids),
                                                    self.req.sampling.max_tokens)
        svc.membership.add_prefill(self.prefill.instance_id, PrefillJob(
            self.upstream_id, len(self.req.prompt_ids), d.reused_prefix_blocks * svc.block_size,
            self.decode.instance_id, max_output_tokens=self.expected_output), now)
        try:
            failure = await self._reserve_unless_ended()
        except BaseException:
            self._is_decode_done = self._is_prefill_done = True  # nothing to abort
            self._withdraw_prefill()
            self._release()
            raise
        if failure is not None:
            self._is_prefill_done = True     # prefill never heard of this attempt
            self._withdraw_prefill()
        else:
            loop = asyncio.get_running_loop()
            self._tasks.append(loop.create_task(self._read_decode(self._queue)))
            self._tasks.append(loop.create_task(self._run_prefill(self._queue)))
        return failure

    async def _reserve_unless_ended(self) -> Failure | None:
        """:meth:`_reserve_decode`, unless a watcher ends the attempt first (its instance declared
        dead, or the drain ending every request): before the workers start only a watcher puts
        anything on the attempt's queue, and its failure must not wait for a decode slow to answer
        (the drain's end would miss the request, left to aiohttp's shutdown: a closed connection).
        The reservation is then cancelled; the decode, told nothing yet, is aborted by the caller."""
        reserve = asyncio.ensure_future(self._reserve_decode())
        ended = asyncio.ensure_future(self._queue.get())
        try:
            await asyncio.wait((reserve, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()       # a cancelled get leaves its item on the queue
            if not reserve.done():
                reserve.cancel()
                await asyncio.gather(reserve, return_exceptions=True)
        if reserve.cancelled():
            return ended.result()[1]           # ("fail", Failure)
        if ended.done() and not ended.cancelled():
            self._queue.put_nowait(ended.result())   # both at once: the relay meets it as usual
        return reserve.result()

    async def _retry(self, failure: Failure) -> Failure | None:
        """Tear the failed attempt down and start another without the instances that failed;
        raises the failure as a 502 (503: the conductor's shutdown) when no retry is left or no other
        instance can take it."""
        self._end_attempt()
        self._excluded.add(failure.instance_id)
        if not failure.retry or self.num_retries >= self.svc.max_retries:
            raise _client_error(failure)
        self.num_retries += 1
        self._new_attempt(f"{self.request_id}-retry{self.num_retries}")
        try:
            d_failure = await self._start_attempt()
        except ApiError as exc:
            if exc.status == 429:
                raise
            raise upstream_failed(f"{failure.message}; not retried: {exc.message}") from None
        log.info("%s: %s; retried on %s + %s (attempt %d)", self.request_id, failure.message,
                 self.decision.prefill_id, self.decision.decode_id, self.num_retries + 1)
        self.svc.metrics.retries.labels(failure.reason).inc()
        return d_failure

    def _end_attempt(self) -> None:
        """Stop the current attempt's workers, abort what still runs upstream, forget it."""
        for task in self._tasks:
            task.cancel()
        tracing.end_span(self._decode_span, "attempt torn down")
        if self.prefill is not None and not self._is_prefill_done:
            self._abort(self.prefill)
        if self.decode is not None and not self._is_decode_done:
            self._abort(self.decode)
        self._is_prefill_done = self._is_decode_done = True
        self._release()

    # ---- relay ---------------------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        """More upstream events are already waiting (the relay can batch its writes)."""
        return not self._queue.empty()

    async def tokens(self) -> AsyncIterator[int]:
        """Token ids in order: the first (from prefill), then decode's. Ends with
        ``finish_reason`` set; raises ApiError if anything upstream fails or refuses. A failure
        before the first token is retried on other instances (:meth:`_retry`)."""
        early: deque[tuple] = deque()   # decode events that raced ahead of the prefill result
        while True:
            if self.prefill_result is not None and early:
                item = early.popleft()
            else:
                item = await self._queue.get()
            if item[0] == "fail" and self.num_tokens == 0:
                early.clear()           # the failed attempt's; the next one starts afresh
                failure = item[1]
                while failure is not None:
                    failure = await self._retry(failure)
                continue
            if item[0] == "first":
                self._on_first(item[1])
                token = item[1].first_token
            elif item[0] in ("token", "end"):
                if self.prefill_result is None:
                    early.append(item)
                    continue
                token = self._on_decode_event(item)
                if token is None:       # decode's end line: finish_reason is set
                    return
            else:
                self._raise(item)
            # Counted before it is handed out: the consumer may stop on it (a stop string) and
            # never resume us, and usage must still count every token the answer used.
            is_last = self._count(token)
            yield token
            if is_last:
                return

    def _on_first(self, result: PrefillResult) -> None:
        self.prefill_result = result
        mig, links = self.decision.migration, self.svc.scheduler.costs.links
        if mig is not None and links is not None:   # the prefill timed the migration: the link's speed
            observe_migration(links, mig.source_store_id, mig.target_store_id, result.timings)
        tracing.add_event(self.span, "first_token", prefix_tokens=result.num_prefix_tokens,
                          computed_tokens=result.num_computed_tokens)
        self._is_prefill_done = True
        now, m = _now(), self.svc.membership
        m.prefill_done(self.prefill.instance_id, self.upstream_id, now)
        m.add_decode(self.decode.instance_id, DecodeJob(self.upstream_id, len(self.req.prompt_ids) + 1, now,
                                                        self.expected_output))

    def _on_decode_event(self, item: tuple) -> int | None:
        if item[0] == "token":
            self.svc.membership.decode_progress(self.decode.instance_id, self.upstream_id)
            return item[1]
        _, reason, error = item
        if error is not None or reason not in ("stop", "length"):
            raise upstream_failed(f"decode instance {self.decode.instance_id} ended the request "
                                  f"({reason}): {error or 'no reason given'}")
        self.finish_reason = reason
        return None

    def _count(self, token: int) -> bool:
        """Count one relayed token; True when the request is complete on our side too (the
        conductor enforces max_tokens and stop ids itself rather than trust every instance)."""
        self.num_tokens += 1
        s = self.req.sampling
        if token in s.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_tokens >= s.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _raise(self, item: tuple) -> None:
        if item[0] == "refused":
            self.svc.metrics.rejections.labels("prefill-refused").inc()
            raise rejected(item[1], 1)
        raise _client_error(item[1])

    # ---- close ---------------------------------------------------------------------------
    async def close(self, *, abort: bool) -> None:
        """Release bookkeeping. ``abort``: the client left, something failed or a stop string
        ended the text — tell every instance still working on the request to drop it and free
        its KV. Otherwise the request completed; decode's end line may still be in flight, so
        give it a moment before aborting (the conductor counts max_tokens and stop ids itself)."""
        if self._is_closed:
            return
        self._is_closed = True
        tracing.end_span(self.span, "aborted" if abort and self.finish_reason is None else None,
                         output_tokens=self.num_tokens, finish_reason=self.finish_reason,
                         retries=self.num_retries)
        if self.num_tokens:   # the output length the client took (ended, or it stopped reading)
            self.svc.outputs.finished(self.block_keys, len(self.req.prompt_ids), self.num_tokens, self.expected_output)
        reader = self._tasks[0] if self._tasks else None
        for task in self._tasks[1:]:
            task.cancel()
        if self.prefill is not None and not self._is_prefill_done:
            self._abort(self.prefill)
        if self.decode is not None and not self._is_decode_done:
            if abort or reader is None:
                if reader is not None:
                    reader.cancel()
                self._abort(self.decode)
            else:
                self.svc.spawn(self._await_decode_end(reader, self.decode, self.upstream_id))
        self._release()

    async def _await_decode_end(self, reader: asyncio.Task, decode: Instance, upstream_id: str) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(reader), DECODE_END_GRACE_S)
        except asyncio.TimeoutError:
            reader.cancel()
        if not self._is_decode_done:
            await post_abort(self.svc, decode, upstream_id)

    def _withdraw_prefill(self) -> None:
        """The prefill never heard of this attempt: its queue entry goes, and the overtakes it
        took in the conductor's view of that queue are given back (the instance counted none)."""
        self.svc.membership.withdraw_prefill(self.prefill.instance_id, self.upstream_id, _now())

    def _release(self) -> None:
        ids = tuple(i.instance_id for i in (self.prefill, self.decode) if i is not None)
        self.svc.membership.release(self.upstream_id, ids, _now())

    def _abort(self, inst: Instance) -> None:
        if not inst.is_alive:
            return
        self.svc.spawn(post_abort(self.svc, inst, self.upstream_id))


def _client_error(failure: Failure) -> ApiError:
    """What the client is told of a failure that ends its request: the conductor's own shutdown
    (its drain ran out) is a 503 to retry, a failure upstream a 502 (the instance's fault)."""
    if failure.reason == SHUTDOWN:
        return shutting_down(failure.message)
    return upstream_failed(failure.message)


def decision_attributes(d: Decision) -> dict[str, Any]:
    """A schedule span's attributes: what Algorithm 1 chose, why, and what it predicted."""
    m = d.migration
    return {"prefill": d.prefill_id, "decode": d.decode_id, "route": d.route, "reason": d.reason,
            "predicted_ttft_s": d.predicted_ttft_s, "predicted_tbt_s": d.predicted_tbt_s,
            "predicted_queue_s": d.predicted_queue_s, "predicted_prefill_s": d.predicted_prefill_s,
            "predicted_transfer_s": d.predicted_transfer_s, "reused_prefix_blocks": d.reused_prefix_blocks,
            "local_prefix_blocks": d.local_prefix_blocks,
            "migrated_blocks": len(m.keys) if m is not None else None}


def _now() -> float:
    return asyncio.get_running_loop().time()

