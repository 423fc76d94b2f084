"""One request's answer to the client, relayed from its flight: one JSON body, or SSE chunks.

The SSE response is opened only once the first token exists, so every failure before that is a
plain HTTP error the client can act on; a failure after it is an ``error`` event, then the stream
ends. A client that disconnects cancels the handler (``handler_cancellation``), and closing the
flight aborts the request on prefill and decode.
"""

from __future__ import annotations

import logging
import time

import orjson
from aiohttp import web

from mooncake_lite.common.logs import set_request_id
from mooncake_lite.common.tbt import paper_tbt
from mooncake_lite.conductor.api.errors import ApiError, Rejected
from mooncake_lite.conductor.api.params import ApiRequest
from mooncake_lite.conductor.api.reasoning import ThinkSplitter, split_whole
from mooncake_lite.conductor.api.state import ApiState
from mooncake_lite.conductor.api.text import TextStream
from mooncake_lite.conductor.api.tool_parser import ToolCallStream, parse_whole
from mooncake_lite.conductor.flight.flight import Flight

log = logging.getLogger(__name__)
OUTCOMES = {400: "bad_request", 429: "rejected", 503: "unavailable"}


class Relay:
    """Answers one request from its flight: starts it, relays its tokens to the client (one JSON
    body, or SSE chunks), measures it and counts its outcome, and always closes the flight."""

    def __init__(self, st: ApiState, req: ApiRequest, flight: Flight, arrival: float, tenant: str) -> None:
        self.st, self.req, self.flight, self.arrival, self.tenant = st, req, flight, arrival, tenant
        self.text = TextStream(st.tokenizer, req.stop)
        self.thinking = ThinkSplitter(req.opens_reasoning) if st.reasoning and req.kind == "chat" else None
        use = req.tools   # tool calls parsed out of the answer (tool_parser.py), unless tool_choice none
        self.calls = ToolCallStream(use.parser) if use is not None and use.choice != "none" else None
        self.created = int(time.time())
        self.outcome = "ok"
        self.is_text_stopped = False
        self._last: float | None = None
        self._gaps: list[float] = []

    async def serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        flight, mx = self.flight, self.st.svc.metrics
        set_request_id(flight.request_id)   # every log line from here on names the request
        mx.in_flight.inc()
        mx.tenant.in_flight.labels(self.tenant).inc()
        outcome = "aborted"   # stays so if the client disconnects (the handler is cancelled)
        try:
            await flight.start()
            resp = await (self.stream(request) if self.req.stream else self.collect())
            outcome = self.outcome
            return resp
        except ApiError as exc:
            outcome = OUTCOMES.get(exc.status, "upstream_error")
            if isinstance(exc, Rejected):
                mx.tenant.rejections.labels(self.tenant, exc.cause).inc()
            return exc.response()
        except ConnectionResetError:
            # The client left while we were writing; the finally clause aborts upstream.
            return web.Response(status=499)
        finally:
            mx.in_flight.dec()
            mx.tenant.in_flight.labels(self.tenant).dec()
            mx.requests.labels(endpoint, outcome).inc()
            mx.tenant.requests.labels(self.tenant, outcome).inc()
            log.debug("%s %s after %.3fs: %d token(s)", endpoint, outcome, time.perf_counter() - self.arrival,
                      flight.num_tokens)
            await flight.close(abort=outcome != "ok" or self.is_text_stopped)

    async def _deltas(self):
        """(text delta) per token, then a final flush; stops early on a stop string."""
        async for token in self.flight.tokens():
            self._tick()
            yield self.text.add(token)
            if self.text.is_stopped:
                self.is_text_stopped = True
                self.flight.finish_reason = "stop"
                return
        yield self.text.flush()

    def _tick(self) -> None:
        now, mx = time.perf_counter(), self.st.svc.metrics
        if self._last is None:
            mx.ttft.observe(now - self.arrival)
            mx.tenant.ttft.labels(self.tenant).observe(now - self.arrival)
        else:
            self._gaps.append(now - self._last)
            mx.itl.observe(now - self._last)
        self._last = now
        mx.output_tokens.inc()

    def _finish_metrics(self) -> None:
        mx = self.st.svc.metrics
        mx.e2e.observe(time.perf_counter() - self.arrival)
        tbt = paper_tbt(self._gaps)
        if tbt is not None:
            mx.tbt.observe(tbt)

    def _usage(self) -> dict:
        n_prompt, n_out = len(self.req.prompt_ids), self.flight.num_tokens
        # What prefill really loaded from the pool, not what the scheduler hoped to reuse.
        result = self.flight.prefill_result
        cached = result.num_prefix_tokens if result is not None else 0
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _headers(self) -> dict[str, str]:
        f, d = self.flight, self.flight.decision
        return {"X-Request-Id": f.request_id, "X-Mooncake-Prefill": d.prefill_id,
                "X-Mooncake-Decode": d.decode_id, "X-Mooncake-Route": d.route,
                "X-Mooncake-Reused-Blocks": str(d.reused_prefix_blocks)}

    # ---- non-streaming ---------------------------------------------------------------------
    async def collect(self) -> web.Response:
        parts = [delta async for delta in self._deltas()]
        self._finish_metrics()
        text, reason = "".join(parts), self.flight.finish_reason
        base = {"id": self.flight.request_id, "created": self.created, "model": self.req.model,
                "usage": self._usage()}
        if self.req.kind == "chat":
            message = {"role": "assistant", "content": text}
            if self.thinking is not None:   # as vLLM: null for a part the answer does not have
                reasoning, content = split_whole(text, self.req.opens_reasoning)
                message["content"], message["reasoning_content"] = content or None, reasoning
            if self.calls is not None:
                message["content"], calls = parse_whole(text, self.calls.parser)
                if calls:
                    message["tool_calls"] = [c.message() for c in calls]
                    reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            body = {**base, "object": "chat.completion", "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = {**base, "object": "text_completion", "choices": [choice]}
        if self.req.return_token_ids:
            choice["token_ids"] = self.text.token_ids
            body["prompt_token_ids"] = list(self.req.prompt_ids)
        return web.json_response(body, headers=self._headers(), dumps=lambda o: orjson.dumps(o).decode())

    # ---- streaming -------------------------------------------------------------------------
    async def stream(self, request: web.Request) -> web.StreamResponse:
        deltas = self._deltas()
        first = await anext(deltas)     # raises ApiError before any byte is sent
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **self._headers()})
        await resp.prepare(request)
        pending: list[bytes] = []   # chunks of tokens that arrived together go out in one write
        if self.req.kind == "chat":
            pending.append(_sse(self._chunk({"role": "assistant", "content": ""}, None)))
        try:
            pending += self._delta_chunks(first)
            # Token 1 goes out now, not with the next delta: that waits for decode's first step.
            if pending and not self.flight.has_pending:
                await resp.write(b"".join(pending))
                pending.clear()
            async for delta in deltas:
                pending += self._delta_chunks(delta)
                if pending and not self.flight.has_pending:
                    await resp.write(b"".join(pending))
                    pending.clear()
        except ApiError as exc:
            self.outcome = "upstream_error"
            pending += self._delta_chunks(None)   # what the reasoning split held back goes out first
            await resp.write_eof(b"".join(pending) + _sse(exc.body()) + b"data: [DONE]\n\n")
            return resp
        pending += self._delta_chunks(None)   # what the reasoning split held back as a possible tag
        self._finish_metrics()
        reason = self.flight.finish_reason
        if self.calls is not None and self.calls.calls and reason == "stop":
            reason = "tool_calls"
        pending.append(_sse(self._chunk(None, reason)))
        if self.req.include_usage:
            pending.append(_sse(self._envelope([], usage=self._usage())))
        # The tail, [DONE] and the end of the chunked body in one write (one syscall).
        await resp.write_eof(b"".join(pending) + b"data: [DONE]\n\n")
        return resp

    def _delta_chunks(self, delta: str | None) -> list[bytes]:
        """The SSE chunks of one text delta: one of content, or with --reasoning-parser think
        up to two (reasoning, then content); ``None``: the splitter's held-back end."""
        if self.calls is not None:
            return [_sse(self._chunk(d, None)) for d in (self.calls.finish() if delta is None else self.calls.feed(delta))]
        if self.thinking is None:
            return [_sse(self._chunk(delta, None))] if delta else []
        reasoning, content = self.thinking.flush() if delta is None else self.thinking.feed(delta)
        out = [_sse(self._chunk({"reasoning_content": reasoning}, None))] if reasoning else []
        return out + ([_sse(self._chunk(content, None))] if content else [])

    def _chunk(self, delta: str | dict | None, finish_reason: str | None) -> dict:
        if self.req.kind == "chat":
            content = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope([choice])

    def _envelope(self, choices: list, **extra) -> dict:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": self.flight.request_id, "object": obj, "created": self.created, "model": self.req.model,
                "choices": choices, **extra}


def _sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
