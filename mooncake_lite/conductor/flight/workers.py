"""The upstream side of a :class:`~mooncake_lite.conductor.dispatch.Flight`'s attempt: its calls
to the decode and the prefill instance, each outcome an item on the attempt's queue.

Split from ``dispatch.py``, which runs the request (attempts and retries, the relay loop that
reads that queue, bookkeeping, close). The workers started once decode has reserved room each
end by putting one final item on the queue they were given (after any ``token`` items: ``end``,
``first``, ``refused`` or ``fail``), and an instance declared dead puts a ``fail`` there too, so
the relay meets them only at the queue. The reservation itself answers before the workers start:
None (reserved), a :class:`Failure` to retry elsewhere, or the client's 429.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp

from mooncake_lite.common import tracing
from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import (GenerateRequest, PrefillRequest, ProtocolError, dumps, error_text,
                                           parse_prefill_result, parse_token_event)
from mooncake_lite.conductor.api.errors import rejected
from mooncake_lite.conductor.flight.upstream import SHUTDOWN, Failure, is_connection_failure

if TYPE_CHECKING:   # dispatch imports this module; the types only
    from mooncake_lite.conductor.flight.flight import Services
    from mooncake_lite.conductor.membership import Instance
    from mooncake_lite.conductor.api.params import ApiRequest
    from mooncake_lite.scheduler import Decision

log = logging.getLogger(__name__)


class UpstreamWorkers:
    """The upstream workers of a Flight (mixed in): it sets ``svc``, ``req`` and ``span``, and per
    attempt (``Flight._new_attempt``) the attributes below; the workers set ``_decode_resp``,
    ``_decode_span`` and the ``_is_*_done`` flags."""

    svc: Services
    req: ApiRequest
    span: object                     # the request's trace span (None: tracing off)
    upstream_id: str
    transfer_id: str
    decision: Decision | None
    block_keys: list[bytes]
    prefill: Instance | None
    decode: Instance | None
    _queue: asyncio.Queue
    _decode_resp: aiohttp.ClientResponse | None
    _decode_span: object             # conductor → decode, open while decode streams tokens
    _is_prefill_done: bool
    _is_decode_done: bool

    async def _reserve_decode(self) -> Failure | None:
        d, s = self.decode, self.req.sampling
        msg = GenerateRequest(self.upstream_id, self.transfer_id, len(self.req.prompt_ids), s,
                              self.svc.kv_timeout_s)
        self._decode_span = span = tracing.start_span("conductor.decode", self.span, kind="client",
                                                      instance=d.instance_id, upstream_id=self.upstream_id)
        try:
            resp = await self.svc.session.post(
                f"http://{d.reg.http}/v1/generate", data=dumps(msg), headers=self._headers(span),
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=self.svc.upstream_timeout_s))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._is_decode_done = True
            tracing.end_span(span, f"unreachable: {exc!r}")
            return self._failed(d, exc, f"decode instance {d.instance_id} could not be reached ({how(exc)})",
                                "decode-unreachable")
        self.svc.membership.trust(d.instance_id, "it answered")
        if resp.status == 200:
            self._decode_resp = resp
            return None
        self._is_decode_done = True
        detail = error_text(await resp.read())
        resp.release()
        tracing.end_span(span, f"answered {resp.status}: {detail}", status=resp.status)
        if resp.status == 429:
            self.svc.metrics.rejections.labels("decode-refused").inc()
            raise rejected(f"decode instance {d.instance_id} refused the request: {detail}", 1)
        return Failure(f"decode instance {d.instance_id} answered {resp.status}: {detail}", d.instance_id,
                       "decode-error", retry=resp.status >= 500)

    def _failed(self, inst: Instance, exc: BaseException, message: str, reason: str,
                queue: asyncio.Queue | None = None) -> Failure:
        """A call to ``inst`` raised ``exc``: the client's ``message`` says what happened in plain
        words, the log has ``exc`` too. A refused or broken connection makes it suspect at once (the
        scheduler stops choosing it); a timeout is not retried. With ``queue``, the failure goes
        there before the instance's state changes, so a death this causes reaches the request
        after its own failure (one wording per event, not one per connection counted)."""
        log.warning("%s: %r", message, exc)
        is_broken = is_connection_failure(exc)
        failure = Failure(message, inst.instance_id, reason) if is_broken else \
            Failure(message, inst.instance_id, reason.replace("unreachable", "error"),
                    retry=not isinstance(exc, asyncio.TimeoutError))
        if queue is not None:
            queue.put_nowait(("fail", failure))
        if is_broken:
            self.svc.membership.connection_failed(inst.instance_id, message)
        return failure

    async def _read_decode(self, queue: asyncio.Queue) -> None:
        resp, d, span = self._decode_resp, self.decode, self._decode_span   # this attempt's
        did = d.instance_id
        try:
            async for line in resp.content:
                if not line.strip():
                    continue
                ev = parse_token_event(line)
                if ev.token is not None:
                    queue.put_nowait(("token", ev.token))
                if ev.finish_reason is not None:
                    self._is_decode_done = True
                    queue.put_nowait(("end", ev.finish_reason, ev.error))
                    return
            message = f"decode instance {did} closed its token stream early; the request was not completed"
            log.warning("%s", message)
            queue.put_nowait(("fail", Failure(message, did, "decode-unreachable")))
            self.svc.membership.connection_failed(did, message)
        except ProtocolError as exc:
            message = f"decode instance {did} sent a malformed token line; the request was not completed"
            log.warning("%s: %s", message, exc)
            queue.put_nowait(("fail", Failure(message, did, "decode-error")))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._failed(d, exc, f"decode instance {did} failed mid-stream ({how(exc)}); the request was "
                                 "not completed", "decode-unreachable", queue)
        finally:
            resp.release()
            tracing.end_span(span, None if self._is_decode_done else "token stream ended early")

    async def _run_prefill(self, queue: asyncio.Queue) -> None:
        with tracing.span("conductor.prefill", self.span, kind="client", instance=self.prefill.instance_id,
                          upstream_id=self.upstream_id) as span:
            await self._post_prefill(queue, span)

    async def _post_prefill(self, queue: asyncio.Queue, span) -> None:
        p, d, dec = self.prefill, self.decode, self.decision
        keys = [k.hex() for k in self.block_keys[:dec.reused_prefix_blocks]]
        m = dec.migration
        msg = PrefillRequest(self.upstream_id, self.transfer_id, self.req.prompt_ids, d.reg.data,
                             self.req.sampling, prefix_keys=tuple(keys),
                             migrate_from=str(m.source_store_id) if m else None,
                             migrate_keys=tuple(k.hex() for k in m.keys) if m else ())
        pid = p.instance_id
        try:
            async with self.svc.session.post(
                    f"http://{p.reg.http}/v1/prefill", data=dumps(msg), headers=self._headers(span),
                    timeout=aiohttp.ClientTimeout(total=self.svc.upstream_timeout_s, connect=10)) as resp:
                body = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._is_prefill_done = is_connection_failure(exc)   # nothing left there to abort
            self._failed(p, exc, f"prefill instance {pid} failed ({how(exc)})", "prefill-unreachable", queue)
            return
        self.svc.membership.trust(pid, "it answered")
        if resp.status == 429:
            queue.put_nowait(("refused", f"prefill instance {pid} refused the request: {error_text(body)}"))
        elif resp.status != 200:
            queue.put_nowait(("fail", Failure(f"prefill instance {pid} answered {resp.status}: "
                                              f"{error_text(body)}", pid, "prefill-error",
                                              retry=resp.status >= 500)))
        else:
            try:
                queue.put_nowait(("first", parse_prefill_result(body)))
            except ProtocolError as exc:
                log.warning("prefill instance %s sent a malformed result: %s", pid, exc)
                queue.put_nowait(("fail", Failure(f"prefill instance {pid} sent a malformed result", pid,
                                                  "prefill-error")))

    def _death_watch(self, instance_id: str) -> Callable[..., None]:
        """What the membership calls when ``instance_id`` is declared dead, or when the conductor's
        drain ends the request (``retry`` False): a failure of this attempt (on this attempt's
        queue, so it cannot reach a later one)."""
        queue = self._queue

        def on_death(reason: str, retry: bool = True) -> None:
            queue.put_nowait(("fail", Failure(reason, instance_id, "instance-dead" if retry else SHUTDOWN,
                                              retry=retry)))
        return on_death

    def _headers(self, span=None) -> dict[str, str]:
        """The JSON and cluster-token headers, and ``span``'s ``traceparent`` (tracing on)."""
        headers = {"Content-Type": "application/json", **cluster_headers(self.svc.cluster_token)}
        if span is not None:
            headers.update(tracing.headers(span))
        return headers


def how(exc: BaseException) -> str:
    """A failed call's exception in a few plain words, for the client (the log keeps the exception)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "no connection in time"
    if isinstance(exc, asyncio.TimeoutError):     # aiohttp's read timeouts are TimeoutErrors too
        return "no answer in time"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connection refused" if isinstance(exc.os_error, ConnectionRefusedError) else "no connection"
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)):
        return "connection lost"
    return "malformed HTTP answer"
