"""One attempt of a flight: one placement, one decode reservation, one prefill, and their calls.

The order is the protocol's (``common/protocol.py``): ``POST /v1/generate`` on the decode
instance first (it reserves room, may refuse with 429, and answers with an NDJSON stream of
TokenEvents from the second token on), then ``POST /v1/prefill`` on the prefill instance (which
streams the KV to decode's data address and answers with the first token). Everything that can
happen to the attempt once decode has reserved room — the prefill's answer, decode's tokens and
end line, an HTTP failure, an instance declared dead — is an event (``events.py``) on the
attempt's own queue, so nothing from a torn-down attempt can reach the next one, and the order
of events on the wire does not matter to the flight that reads them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Callable

import aiohttp

from mooncake_lite.common import tracing
from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import (MAX_KV_IN_S, GenerateRequest, PrefillResult, ProtocolError, dumps,
                                           error_text, parse_prefill_result, parse_token_event)
from mooncake_lite.conductor.api.errors import Rejected
from mooncake_lite.conductor.api.params import ApiRequest
from mooncake_lite.conductor.flight.events import (SHUTDOWN, Event, Failed, Finished, FirstToken, PrefillRefused,
                                                   Token)
from mooncake_lite.conductor.flight.placement import prefill_request, sent_cap
from mooncake_lite.conductor.flight.upstream import how, is_connection_failure, post_abort
from mooncake_lite.conductor.cluster.membership import DecodeJob, Instance, PrefillJob
from mooncake_lite.conductor.services import Services
from mooncake_lite.scheduler import Decision
from mooncake_lite.scheduler.links import observe_migration
from mooncake_lite.scheduler.view import sequence_id

log = logging.getLogger(__name__)
DECODE_END_GRACE_S = 2.0


class Attempt:
    """The upstream side of one placement. :meth:`start` watches both instances, queues the
    prefill job and reserves decode; then its two workers (decode's token stream, the prefill
    call) put their events on :attr:`events`. :meth:`end` tears it down for a retry;
    :meth:`close` ends it with the request. Each attempt has its own upstream request id and
    transfer id."""

    def __init__(self, svc: Services, req: ApiRequest, upstream_id: str, decision: Decision,
                 block_keys: list[bytes], span: object, choice: int | None = None) -> None:
        self.svc, self.req, self.span = svc, req, span   # span: the request's trace (None: tracing off)
        self.choice = choice               # a continuation of choice ``choice`` alone: its events carry that index
        self.upstream_id = upstream_id     # what prefill, decode and the membership know it by
        self.transfer_id = uuid.uuid4().hex
        self.decision = decision
        self.num_placed = svc.num_placed   # its number in the conductor's order (placement.placed_header)
        self.block_keys = block_keys
        self.prefill: Instance = svc.membership.get(decision.prefill_id)
        self.decode: Instance = svc.membership.get(decision.decode_id)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []     # decode's reader first, then the prefill call
        self._decode_resp: aiohttp.ClientResponse | None = None
        self.is_prefill_done = False
        self.is_decode_done = False
        self._decode_span = None           # conductor → decode, open while decode streams tokens
        self.expected_output = req.sampling.max_tokens   # what start() is told (predictive admission)

    # ---- start ---------------------------------------------------------------------------
    async def start(self, expected_output: int) -> Failed | None:
        """Queue the prefill job, reserve decode, start the workers; a Failed if decode failed
        (the attempt is then over). ``expected_output``: the predicted output length that
        predictive admission sizes the request's decode time with."""
        svc, d = self.svc, self.decision
        self.expected_output = expected_output
        now = loop_now()
        for inst in (self.prefill, self.decode):
            svc.membership.watch(inst.instance_id, self.upstream_id, self._death_watch(inst.instance_id))
        svc.membership.add_prefill(self.prefill.instance_id, PrefillJob(
            self.upstream_id, len(self.req.prompt_ids), d.reused_prefix_blocks * svc.block_size,
            self.decode.instance_id, max_output_tokens=expected_output, num_sequences=self.req.sampling.n,
            pack_cap=sent_cap(d, self.prefill.reg), priced_s=d.predicted_prefill_s), now)
        try:
            failed = await self._reserve_unless_ended()
        except BaseException:
            self.is_decode_done = self.is_prefill_done = True  # nothing to abort
            self._withdraw_prefill()
            self._release()
            raise
        if failed is not None:
            self.is_prefill_done = True     # prefill never heard of this attempt
            self._withdraw_prefill()
        else:
            loop = asyncio.get_running_loop()
            self._tasks.append(loop.create_task(self._read_decode()))
            self._tasks.append(loop.create_task(self._run_prefill()))
        return failed

    async def _reserve_unless_ended(self) -> Failed | None:
        """:meth:`_reserve_decode`, unless a watcher ends the attempt first (its instance declared
        dead, or the drain ending every request): before the workers start only a watcher puts
        anything on the attempt's queue, and its failure must not wait for a decode slow to answer
        (the drain's end would miss the request, left to aiohttp's shutdown: a closed connection).
        The reservation is then cancelled; the decode, told nothing yet, is aborted by the caller."""
        reserve = asyncio.ensure_future(self._reserve_decode())
        ended = asyncio.ensure_future(self.events.get())
        try:
            await asyncio.wait((reserve, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()       # a cancelled get leaves its item on the queue
            if not reserve.done():
                reserve.cancel()
                await asyncio.gather(reserve, return_exceptions=True)
        if reserve.cancelled():
            return ended.result()              # a watcher's Failed
        if ended.done() and not ended.cancelled():
            self.events.put_nowait(ended.result())   # both at once: the relay meets it as usual
        return reserve.result()

    async def _reserve_decode(self) -> Failed | None:
        d, s = self.decode, self.req.sampling
        msg = GenerateRequest(self.upstream_id, self.transfer_id, len(self.req.prompt_ids), s,
                              self.svc.kv_timeout_s, kv_in(self.decision))
        self._decode_span = span = tracing.start_span("conductor.decode", self.span, kind="client",
                                                      instance=d.instance_id, upstream_id=self.upstream_id)
        try:
            resp = await self.svc.session.post(
                f"http://{d.reg.http}/v1/generate", data=dumps(msg), headers=self._headers(span),
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=self.svc.upstream_timeout_s))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.is_decode_done = True
            tracing.end_span(span, f"unreachable: {exc!r}")
            return self._failed(d, exc, f"decode instance {d.instance_id} could not be reached ({how(exc)})",
                                "decode-unreachable")
        self.svc.membership.trust(d.instance_id, "it answered")
        if resp.status == 200:
            self._decode_resp = resp
            return None
        self.is_decode_done = True
        detail = error_text(await resp.read())
        resp.release()
        tracing.end_span(span, f"answered {resp.status}: {detail}", status=resp.status)
        if resp.status == 429:
            self.svc.metrics.rejections.labels("decode-refused").inc()
            raise Rejected(f"decode instance {d.instance_id} refused the request: {detail}", 1, "upstream-refused")
        return Failed(f"decode instance {d.instance_id} answered {resp.status}: {detail}", d.instance_id,
                      "decode-error", retry=resp.status >= 500)

    def _failed(self, inst: Instance, exc: BaseException, message: str, reason: str, *,
                to_queue: bool = False) -> Failed:
        """A call to ``inst`` raised ``exc``: the client's ``message`` says what happened in plain
        words, the log has ``exc`` too. A refused or broken connection makes it suspect at once (the
        scheduler stops choosing it); a timeout is not retried. ``to_queue``: the failure goes on
        the attempt's queue before the instance's state changes, so a death this causes reaches the
        request after its own failure (one wording per event, not one per connection counted)."""
        log.warning("%s: %r", message, exc)
        is_broken = is_connection_failure(exc)
        failed = Failed(message, inst.instance_id, reason) if is_broken else \
            Failed(message, inst.instance_id, reason.replace("unreachable", "error"),
                   retry=not isinstance(exc, asyncio.TimeoutError))
        if to_queue:
            self.events.put_nowait(failed)
        if is_broken:
            self.svc.membership.connection_failed(inst.instance_id, message)
        return failed

    # ---- the workers -----------------------------------------------------------------------
    async def _read_decode(self) -> None:
        resp, did = self._decode_resp, self.decode.instance_id
        num_open = self.req.sampling.n   # each choice ends with a line; an abort or error ends all
        try:
            async for line in resp.content:
                if not line.strip():
                    continue
                ev = parse_token_event(line)
                index = ev.index if self.choice is None else self.choice
                if ev.token is not None:
                    self.events.put_nowait(Token(ev.token, index, ev.logprob))
                if ev.finish_reason is not None:
                    num_open -= 1
                    self.events.put_nowait(Finished(ev.finish_reason, ev.error, index))
                    if num_open == 0 or ev.finish_reason not in ("stop", "length"):
                        self.is_decode_done = True
                        return
            message = f"decode instance {did} closed its token stream early; the request was not completed"
            log.warning("%s", message)
            self.events.put_nowait(Failed(message, did, "decode-unreachable"))
            self.svc.membership.connection_failed(did, message)
        except ProtocolError as exc:
            message = f"decode instance {did} sent a malformed token line; the request was not completed"
            log.warning("%s: %s", message, exc)
            self.events.put_nowait(Failed(message, did, "decode-error"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._failed(self.decode, exc, f"decode instance {did} failed mid-stream ({how(exc)}); the request "
                                           "was not completed", "decode-unreachable", to_queue=True)
        finally:
            resp.release()
            tracing.end_span(self._decode_span, None if self.is_decode_done else "token stream ended early")

    async def _run_prefill(self) -> None:
        with tracing.span("conductor.prefill", self.span, kind="client", instance=self.prefill.instance_id,
                          upstream_id=self.upstream_id) as span:
            await self._post_prefill(span)

    async def _post_prefill(self, span) -> None:
        p, pid = self.prefill, self.prefill.instance_id
        msg = prefill_request(self.decision, self.block_keys, self.upstream_id, self.transfer_id,
                              self.req.prompt_ids, self.decode.reg.data, self.req.sampling, sent_cap(self.decision, p.reg),
                              (self.svc.placer, self.num_placed) if p.reg.reads_placed else None)
        try:
            async with self.svc.session.post(
                    f"http://{p.reg.http}/v1/prefill", data=dumps(msg), headers=self._headers(span),
                    timeout=aiohttp.ClientTimeout(total=self.svc.upstream_timeout_s, connect=10)) as resp:
                body = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.is_prefill_done = is_connection_failure(exc)   # nothing left there to abort
            self._failed(p, exc, f"prefill instance {pid} failed ({how(exc)})", "prefill-unreachable", to_queue=True)
            return
        self.svc.membership.trust(pid, "it answered")
        if resp.status == 429:
            self.events.put_nowait(PrefillRefused(f"prefill instance {pid} refused the request: {error_text(body)}"))
        elif resp.status != 200:
            self.events.put_nowait(Failed(f"prefill instance {pid} answered {resp.status}: {error_text(body)}", pid,
                                          "prefill-error", retry=resp.status >= 500))
        else:
            try:
                self.events.put_nowait(FirstToken(parse_prefill_result(body)))
            except ProtocolError as exc:
                log.warning("prefill instance %s sent a malformed result: %s", pid, exc)
                self.events.put_nowait(Failed(f"prefill instance {pid} sent a malformed result", pid,
                                              "prefill-error"))

    def _death_watch(self, instance_id: str) -> Callable[..., None]:
        """What the membership calls when ``instance_id`` is declared dead, or when the conductor's
        drain ends the request (``retry`` False): a failure of this attempt, on its own queue."""
        def on_death(reason: str, retry: bool = True) -> None:
            self.events.put_nowait(Failed(reason, instance_id, "instance-dead" if retry else SHUTDOWN, retry=retry))
        return on_death

    def _headers(self, span=None) -> dict[str, str]:
        """The JSON and cluster-token headers, and ``span``'s ``traceparent`` (tracing on)."""
        headers = {"Content-Type": "application/json", **cluster_headers(self.svc.cluster_token)}
        if span is not None:
            headers.update(tracing.headers(span))
        return headers

    # ---- what the flight tells it ---------------------------------------------------------------
    def prefill_finished(self, result: PrefillResult) -> None:
        """The first token is here: the prefill is done, its migration timed, and the request
        joins its decode's batch in the membership."""
        mig, links = self.decision.migration, self.svc.scheduler.costs.links
        if mig is not None and links is not None:   # the prefill timed the migration: the link's speed
            observe_migration(links, mig.source_store_id, mig.target_store_id, result.timings)
        self.is_prefill_done = True
        now, m = loop_now(), self.svc.membership
        m.prefill_done(self.prefill.instance_id, self.upstream_id, now)
        m.add_decode(self.decode.instance_id, DecodeJob(self.upstream_id, len(self.req.prompt_ids) + 1, now,
                                                        self.expected_output, self.req.sampling.n))

    def decode_progress(self, index: int = 0) -> None:
        """Choice ``index`` generated a token."""
        self.svc.membership.decode_progress(self.decode.instance_id, sequence_id(self.upstream_id, index))

    # ---- end -------------------------------------------------------------------------------
    def end(self, *, fence: bool = False) -> None:
        """Tear the attempt down for a retry: stop its workers, abort what still runs upstream,
        forget it. ``fence`` (a continuation replaces it): decode is told to abort even when
        declared dead, since a hung one may resume; its late tokens go to a queue no one reads."""
        for task in self._tasks:
            task.cancel()
        tracing.end_span(self._decode_span, "attempt torn down")
        if not self.is_prefill_done:
            self._abort(self.prefill)
        if not self.is_decode_done:
            self._abort(self.decode, force=fence)
        self.is_prefill_done = self.is_decode_done = True
        self._release()

    def close(self, *, abort: bool) -> None:
        """The request is over. ``abort``: tell each instance still working on it to drop it and
        free its KV. Otherwise decode's end line may still be in flight: it gets a moment before
        the decode is aborted (the conductor counts max_tokens and stop ids itself)."""
        reader = self._tasks[0] if self._tasks else None
        for task in self._tasks[1:]:
            task.cancel()
        if not self.is_prefill_done:
            self._abort(self.prefill)
        if not self.is_decode_done:
            if abort or reader is None:
                if reader is not None:
                    reader.cancel()
                self._abort(self.decode)
            else:
                self.svc.spawn(self._await_decode_end(reader))
        self._release()

    async def _await_decode_end(self, reader: asyncio.Task) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(reader), DECODE_END_GRACE_S)
        except asyncio.TimeoutError:
            reader.cancel()
        if not self.is_decode_done:
            await post_abort(self.svc, self.decode, self.upstream_id)

    def _withdraw_prefill(self) -> None:
        """The prefill never heard of this attempt: its queue entry goes, and the overtakes it
        took in the conductor's view of that queue are given back (the instance counted none)."""
        self.svc.membership.withdraw_prefill(self.prefill.instance_id, self.upstream_id, loop_now())

    def _release(self) -> None:
        self.svc.membership.release(self.upstream_id, (self.prefill.instance_id, self.decode.instance_id), loop_now())

    def _abort(self, inst: Instance, *, force: bool = False) -> None:
        if inst.is_alive or force:
            self.svc.spawn(post_abort(self.svc, inst, self.upstream_id))


def loop_now() -> float:
    """The event loop's clock: what membership's and the flight's times are read on."""
    return asyncio.get_running_loop().time()


def kv_in(decision: Decision) -> float | None:
    """When the decision expects the request's KV at its decode, in seconds from now: its predicted
    TTFT (the decode judges its TBT with what still decodes then), within what the decode takes."""
    ttft = decision.predicted_ttft_s
    if ttft is None or math.isnan(ttft):
        return None
    return min(max(ttft, 0.0), MAX_KV_IN_S)
