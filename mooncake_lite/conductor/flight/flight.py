"""Running one request through the cluster: place it, run an attempt, relay its tokens, retry it
elsewhere when it fails before its first token, close it.

A :class:`Flight` owns its attempts (``attempt.py``: one placement, one decode reservation, one
prefill, and their calls to the instances). It reads the current attempt's events (``events.py``)
in one loop, matching them by type, so the relay is a plain ``await queue.get()`` whatever order they arrive in.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator

from mooncake_lite.common import tracing
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.protocol import PrefillResult, TokenLogprob
from mooncake_lite.common.tbt import paper_tbt
from mooncake_lite.conductor.api.errors import ApiError, Rejected, upstream_failed
from mooncake_lite.conductor.api.params import ApiRequest
from mooncake_lite.conductor.cluster.membership import Instance
from mooncake_lite.conductor.flight.attempt import Attempt, loop_now
from mooncake_lite.conductor.flight.continuation import (Continuation, continued_request, is_continuable,
                                                         still_registered)
from mooncake_lite.conductor.flight.events import Failed, Finished, FirstToken, PrefillRefused, Token, client_error
from mooncake_lite.conductor.flight.placement import applied_slos, decision_attributes, place, slo_headers
from mooncake_lite.conductor.flight.checks import Check, Prediction, reported_seconds
from mooncake_lite.conductor.flight.wait import placed_within, wait_limit
from mooncake_lite.conductor.services import Services
from mooncake_lite.scheduler import Decision, ScheduleRequest
from mooncake_lite.scheduler.arrivals import uncached_now

log = logging.getLogger(__name__)


class Flight:
    """One request in flight, for tenant ``tenant``. ``await start()`` (raises ApiError:
    400/429/502/503), then iterate :meth:`tokens`, then always ``await close()``.

    A request is dispatched in *attempts* (:class:`Attempt`). An attempt that fails before the
    first token reached the client is torn down and the request placed again (at most
    ``Services.max_retries`` times) without the instances that failed it; each attempt has its
    own upstream request id and transfer id, so nothing from a torn-down attempt can reach the
    next one. Once a token is out, a failure of its decode is *continued* (``continuation.py``):
    the request is placed again as prompt + the tokens already relayed, at most
    ``Services.migration_limit`` times, and its tokens go on from the new attempt; the relay
    above never sees the seam."""

    def __init__(self, svc: Services, req: ApiRequest, tenant: str, request_id: str | None = None) -> None:
        self.svc = svc
        self.req = req
        self.tenant = tenant
        self.request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        self.attempt: Attempt | None = None   # the current one (None until the first is placed)
        self.num_retries = 0
        self.num_continuations = 0
        self._choice: int | None = None      # the choice a continuation's attempt runs (its index 0); None: all
        self.block_keys: list[bytes] = []    # the prompt's (a continuation's attempt has longer ones)
        self._has_first = False              # the current attempt's first token (prefill's) is in
        self._failed_on: list[Instance] = []  # the registrations failed attempts ran on (still_registered)
        self.prefill_result: PrefillResult | None = None
        # Each choice's end ("stop", "length"), None while it runs; its tokens so far.
        self.finish_reasons: list[str | None] = [None] * req.sampling.n
        self.choice_tokens = [0] * req.sampling.n
        self.relayed: list[list[int]] = [[] for _ in range(req.sampling.n)]   # each choice's tokens handed out
        self.num_tokens = 0                  # every choice's together
        self.expected_output = req.sampling.max_tokens
        self._is_closed = False
        # Checking the prediction (predictions.py): the placed attempt's, on the loop's clock.
        self.prediction: Prediction | None = None
        self.slos: tuple[float, float] | None = None   # the (TTFT, TBT) limits admission applied
        self._placed_at = self._last_token_at = self._held_s = 0.0
        self._measured_ttft_s: float | None = None
        self._gaps: list[float] = []
        self._decode_busy = False
        # The request's trace (None when tracing is off): a child of the client's traceparent if it sent one.
        self.span = tracing.start_span("conductor.request", kind="server", request_id=self.request_id,
                                       prompt_tokens=len(req.prompt_ids), max_tokens=req.sampling.max_tokens)

    def _instance(self, failed: Failed) -> Instance:
        """The current attempt's instance that ``failed``."""
        a = self.attempt
        return a.decode if failed.instance_id == a.decode.instance_id else a.prefill

    @property
    def decision(self) -> Decision | None:
        """The current attempt's placement."""
        return self.attempt.decision if self.attempt is not None else None

    # ---- start ---------------------------------------------------------------------------
    async def start(self) -> None:
        arrived = loop_now()
        await self.svc.arrivals.turn(self.svc.membership.snapshot, self._uncached_now, self)
        self._held_s = loop_now() - arrived   # placed with its burst (arrivals.py): the client waited that too
        failed = await self._start_attempt(self.request_id)
        if failed is not None:
            await self._retry(failed)

    def _uncached_now(self) -> int:
        """The prompt's tokens not cached on the store with its longest prefix: the key a burst is
        placed by (``arrivals.py``)."""
        svc, ids = self.svc, self.req.prompt_ids
        sreq = ScheduleRequest(self.request_id, tuple(prefix_hash(ids, svc.block_size, svc.hash_seed)), len(ids), 1)
        return uncached_now(svc.scheduler.index, sreq, svc.block_size)

    async def _start_attempt(self, upstream_id: str, cont: ApiRequest | None = None) -> Failed | None:
        """Place the request (``cont``: its continuation) and start an attempt there; a Failed if
        its decode failed."""
        req, excluded = cont or self.req, still_registered(self._failed_on, self.svc.membership.instances)
        span = tracing.start_span("conductor.schedule", self.span, attempt=self.num_retries + 1,
                                  continuation=self.num_continuations or None, excluded=sorted(excluded) or None)
        try:
            d, keys = place(self.svc, upstream_id, req, loop_now(), tenant=self.tenant, exclude=excluded,
                            is_continuation=cont is not None)
        except ApiError as exc:
            tracing.end_span(span, exc.message, status=exc.status)
            raise
        if span is not None:
            tracing.end_span(span, **decision_attributes(d))
        if cont is None:
            self.prediction, self._placed_at = self.svc.predictions.predicted(
                d, len(req.prompt_ids), d.reused_prefix_blocks * self.svc.scheduler.config.block_size), loop_now()
            self.slos = applied_slos(self.svc, d, len(req.prompt_ids))
            # predictive admission sizes this request's decode time with its predicted output
            self.expected_output = self.svc.outputs.expected(keys, len(req.prompt_ids), req.sampling.max_tokens)
            self.block_keys = keys
        expected = max(1, self.expected_output - req.sampling.num_generated)   # what is left of it
        self._has_first = False
        self.attempt = Attempt(self.svc, req, upstream_id, d, keys, self.span, None if cont is None else self._choice)
        return await self.attempt.start(expected)

    async def _retry(self, failed: Failed) -> None:
        """Tear the failed attempt down and start another without the instances that failed (again
        while those fail at once); raises the failure as a 502 (503: the conductor's shutdown) when
        no retry is left or no other instance can take it. A decode's failure waits for one as a
        continuation does (``wait.py``: the only decode may be restarting); a prefill's does not."""
        self.attempt.end()
        self._failed_on.append(inst := self._instance(failed))
        if not failed.retry or self.num_retries >= self.svc.max_retries:
            raise client_error(failed)
        self.num_retries += 1
        wait_s = wait_limit(self.svc.membership.dead_after_s) if inst.role == "decode" else 0.0
        try:
            next_failed = await placed_within(
                functools.partial(self._start_attempt, f"{self.request_id}-retry{self.num_retries}"), wait_s)
        except Rejected:
            raise
        except ApiError as exc:
            raise upstream_failed(f"{failed.message}; not retried: {exc.message}") from None
        log.info("%s: %s; retried on %s + %s (attempt %d)", self.request_id, failed.message,
                 self.attempt.decision.prefill_id, self.attempt.decision.decode_id, self.num_retries + 1)
        self.svc.metrics.retries.labels(failed.reason).inc()
        if next_failed is not None:
            await self._retry(next_failed)

    async def _continue(self, failed: Failed) -> None:
        """The decode failed after tokens went out: fence the failed attempt off and place the request
        again as prompt + the tokens already relayed (``continuation.py``), without the instance
        that failed; raises the failure as the client's error when it may not be continued (the
        conductor's shutdown, ``--migration-limit`` reached, or no instance can take it). A request
        of n > 1 choices goes on one unfinished choice at a time (:meth:`_start_choice`)."""
        self.attempt.end(fence=True)   # its late tokens, if it comes back, reach no one
        self._failed_on.append(self._instance(failed))
        number, limit = self.num_continuations + 1, self.svc.migration_limit
        if not is_continuable(failed):
            raise client_error(failed)
        if number > limit:
            why = f"--migration-limit {limit} reached"
            self._note(failed, number, "limit", why)
            raise upstream_failed(failed.message if limit == 0 else f"{failed.message}; not continued: {why}")
        self.num_continuations = number
        span = tracing.start_span("conductor.continuation", self.span, cause=failed.reason, number=number,
                                  from_decode=failed.instance_id, relayed_tokens=self.num_tokens)
        wait_s = wait_limit(self.svc.membership.dead_after_s)
        try:
            next_failed = await placed_within(self._start_choice, wait_s)
        except ApiError as exc:
            tracing.end_span(span, exc.message, status=exc.status)
            self._note(failed, number, "refused", exc.message)
            within = f" within {wait_s:g}s" if exc.status == 503 else ""
            raise upstream_failed(f"{failed.message}; it could not be continued{within}: {exc.message}") from None
        d = self.attempt.decision
        tracing.end_span(span, prefill=d.prefill_id, decode=d.decode_id)
        self._note(failed, number, "continued")
        if next_failed is not None:   # the new decode failed at once: that is a failure to continue too
            await self._continue(next_failed)

    async def _start_choice(self) -> Failed | None:
        """Start the continuation's attempt for the first choice not yet complete: that choice
        alone (n = 1, its own seed stream ``seed + index``), as prompt + its own tokens relayed.
        Choices go one at a time because each has its own prefix (a prefill takes one prompt);
        :meth:`tokens` starts the next one when this one ends."""
        i = self.finish_reasons.index(None)
        self._choice = i
        suffix = f"-c{i}" if self.req.sampling.n > 1 else ""
        return await self._start_attempt(f"{self.request_id}-cont{self.num_continuations}{suffix}",
                                         continued_request(self.req, self.relayed[i], i))

    async def _next_choice(self) -> None:
        """The continued choice is complete and another is not: its attempt ends (its decode is
        done) and the next choice's starts, part of the same continuation."""
        self.attempt.end()
        try:
            failed = await self._start_choice()
        except ApiError as exc:
            raise upstream_failed(f"choice {self._choice} could not be continued: {exc.message}") from None
        if failed is not None:
            await self._continue(failed)

    def _note(self, failed: Failed, number: int, outcome: str, detail: str | None = None) -> None:
        """A continuation's log line (with its cause), counter and record for ``mooncake status``."""
        d = self.attempt.decision if outcome == "continued" else None
        record = Continuation(self.request_id, failed.reason, failed.instance_id, self.num_tokens, number, outcome,
                              d and d.prefill_id, d and d.decode_id, detail)
        self.svc.metrics.continuations.labels(failed.reason, outcome).inc()
        self.svc.continuations.append(record.as_json())
        if d is not None:
            log.warning("%s: %s; continued on %s + %s after %d token(s) (continuation %d of at most %d)",
                        self.request_id, failed.message, d.prefill_id, d.decode_id, self.num_tokens, number,
                        self.svc.migration_limit)
        else:
            log.warning("%s: %s; not continued (%s): %s", self.request_id, failed.message, outcome, detail)

    # ---- relay ---------------------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        """More upstream events are already waiting (the relay can batch its writes)."""
        return self.attempt is not None and not self.attempt.events.empty()

    @property
    def finish_reason(self) -> str | None:
        """Choice 0's end (a request of one choice: the request's)."""
        return self.finish_reasons[0]

    @property
    def is_done(self) -> bool:
        return all(r is not None for r in self.finish_reasons)

    def stop(self, index: int) -> None:
        """Choice ``index`` ended on a stop string (the relay saw it): nothing more of it is relayed."""
        self.finish_reasons[index] = self.finish_reasons[index] or "stop"

    async def tokens(self) -> AsyncIterator[Token]:
        """Each choice's tokens in order (:class:`Token`): every choice's token 1 (prefill's), then
        decode's. Ends once every choice has its ``finish_reasons`` entry; raises ApiError if anything
        upstream fails or refuses. A failure before the first token is retried (:meth:`_retry`)."""
        early: deque[Token | Finished] = deque()   # decode events that raced ahead of the prefill result
        while True:
            if self._has_first and early:
                event = early.popleft()
            else:
                event = await self.attempt.events.get()
            match event:
                case Failed() if self.num_tokens == 0:
                    early.clear()           # the failed attempt's; the next one starts afresh
                    await self._retry(event)
                    continue
                case FirstToken(result=result):
                    tokens = self._on_first(result) if self.num_continuations == 0 else self._on_resumed(result)
                case Token() | Finished() if not self._has_first:
                    early.append(event)
                    continue
                case Token():
                    self._on_token(event.index)
                    tokens = [event]
                case Failed() | Finished(finish_reason="abort"):   # (an abort: the decode gave up, in its drain say)
                    early.clear()           # the failed attempt's: the continuation makes them again
                    await self._continue(event if isinstance(event, Failed) else self._aborted(event))
                    continue
                case Finished():
                    self._finish(event)     # decode's end line of a choice: its finish reason is set
                    tokens = []
                case PrefillRefused(message=message):
                    self.svc.metrics.rejections.labels("prefill-refused").inc()
                    raise Rejected(message, 1, "upstream-refused")
            for token in tokens:
                if self.finish_reasons[token.index] is not None:
                    continue   # a choice the conductor already ended (max_tokens, stop id or string)
                self._count(token)   # before it is handed out: the consumer may stop on it, never resuming us
                yield token
            if self.is_done:
                return
            if self._choice is not None and self.finish_reasons[self._choice] is not None:
                early.clear()
                await self._next_choice()

    def _on_first(self, result: PrefillResult) -> list[Token]:
        """The prefill's answer: every choice's token 1."""
        self._last_token_at = now = loop_now()
        self._measured_ttft_s = now - self._placed_at
        self.prefill_result = result
        self._has_first = True
        self.attempt.prefill_finished(result)
        # (once this request's own prefill job has left its queue)
        self._decode_busy = self.svc.predictions.busy_beside(self.attempt.decode.instance_id)
        if (check := self._check()) is not None:   # the TTFT side corrects now, not after the decode
            self.svc.predictions.settle_first(check, now)
        tracing.add_event(self.span, "first_token", prefix_tokens=result.num_prefix_tokens,
                          computed_tokens=result.num_computed_tokens)
        return [Token(t, i, lp) for i, (t, lp) in enumerate(_firsts(result))]

    def _on_resumed(self, result: PrefillResult) -> list[Token]:
        """A continuation's prefill answered: its token is the next one of the choice it continues
        (the request's own ``prefill_result``, its usage and echo, stay the first attempt's)."""
        self._has_first = True
        self.attempt.prefill_finished(result)
        self._on_token()    # the gap since the last token relayed: the seam, as the client saw it
        tracing.add_event(self.span, "continued_token", prefix_tokens=result.num_prefix_tokens,
                          computed_tokens=result.num_computed_tokens)
        token, logprob = _firsts(result)[0]
        return [Token(token, self._choice, logprob)]

    def _on_token(self, index: int = 0) -> None:
        """A token from decode (choice ``index``'s): its progress there, and the gap since the last one."""
        self.attempt.decode_progress(index)
        now = loop_now()
        self._gaps.append(now - self._last_token_at)
        self._last_token_at = now

    def _aborted(self, end: Finished) -> Failed:
        """Decode's abort line, not asked for by the conductor (which stops reading when it aborts)."""
        did = self.attempt.decode.instance_id
        return Failed(f"decode instance {did} aborted the request mid-stream ({end.error or 'no reason given'})",
                      did, "decode-abort")

    def _finish(self, end: Finished) -> None:
        if end.error is not None or end.finish_reason not in ("stop", "length") \
                or not 0 <= end.index < len(self.finish_reasons):
            raise upstream_failed(f"decode instance {self.attempt.decode.instance_id} ended the request "
                                  f"({end.finish_reason}): {end.error or 'no reason given'}")
        self.finish_reasons[end.index] = self.finish_reasons[end.index] or end.finish_reason

    def _count(self, token: Token) -> None:
        """Count one relayed token, and end its choice when it is complete on our side too (the
        conductor enforces max_tokens and stop ids itself rather than trust every instance)."""
        self.num_tokens += 1
        self.choice_tokens[token.index] += 1
        self.relayed[token.index].append(token.token)
        s = self.req.sampling
        if token.token in s.stop_token_ids:
            self.finish_reasons[token.index] = "stop"
        elif self.choice_tokens[token.index] >= s.max_tokens:
            self.finish_reasons[token.index] = "length"

    # ---- close ---------------------------------------------------------------------------
    async def close(self, *, abort: bool) -> None:
        """Release bookkeeping. ``abort``: the client left, something failed or a stop string
        ended the text — tell every instance still working on the request to drop it and free
        its KV. Otherwise the request completed (:meth:`Attempt.close` waits a moment for
        decode's end line)."""
        if self._is_closed:
            return
        self._is_closed = True
        check = self._check() if not abort and self.finish_reason is not None else None
        if check is not None:
            self.svc.predictions.settle(check, loop_now())
        tracing.end_span(self.span, "aborted" if abort and self.finish_reason is None else None,
                         output_tokens=self.num_tokens, finish_reason=self.finish_reason,
                         retries=self.num_retries, continuations=self.num_continuations, **(check.attributes() if check is not None else {}))
        if self.attempt is None:
            return
        if self.num_tokens:   # the output length the client took (ended, or it stopped reading): its longest choice's
            self.svc.outputs.finished(self.block_keys, len(self.req.prompt_ids), max(self.choice_tokens),
                                      self.expected_output)
        self.attempt.close(abort=abort)

    def _check(self) -> Check | None:
        """The completed request's prediction against what was measured (None: no first token)."""
        result, d = self.prefill_result, self.decision
        if result is None or self._measured_ttft_s is None or self.prediction is None or self.num_continuations:
            return None     # (a continued request's gaps and instances are not what was predicted)
        t = result.timings
        compute = t.get("compute_s")
        if compute is not None and t.get("load_wait_s") is not None:
            compute += t["load_wait_s"]   # the model's prefill time includes loading the prefix
        return Check(self.request_id, d.prefill_id, d.decode_id, self.prediction, self._measured_ttft_s,
                     paper_tbt(self._gaps), sum(self._gaps) / len(self._gaps) if self._gaps else None,
                     t.get("queue_s"), compute, t.get("migrate_s"),
                     decode_busy=self._decode_busy or self.svc.predictions.busy_beside(d.decode_id),
                     forward=(result.num_prefix_tokens + result.num_computed_tokens, result.num_prefix_tokens,
                              t.get("forward_tokens", 0.0), t.get("forward_jobs", 1.0)), passed=t.get("passed"),
                     steal_s=reported_seconds(t.get("steal_s")), cpu_s=reported_seconds(t.get("cpu_s")),
                     runqueue_s=reported_seconds(t.get("runqueue_s")))

    def prediction_headers(self) -> dict[str, str]:
        """The placed attempt's predicted TTFT (from arrival: a held burst's wait too), TBT, and SLOs (s)."""
        p = self.prediction
        times = {} if p is None else {"TTFT": self._held_s + p.ttft_s, "TBT": p.tbt_s}
        return {**{f"X-Mooncake-Predicted-{k}": f"{v:.6f}" for k, v in times.items() if v is not None},
                **(slo_headers(self.slos) if self.slos else {})}


def _firsts(result: PrefillResult) -> list[tuple[int, TokenLogprob | None]]:
    """Every choice's token 1 and its logprobs (when asked for), from the prefill's answer."""
    tokens = result.first_tokens or (result.first_token,)
    logprobs = result.first_logprobs or (None,) * len(tokens)
    return list(zip(tokens, logprobs))

