"""One request's answer to the client, relayed from its flights: one JSON body, or SSE chunks.

A request is one flight per prompt (a batch of prompts in ``/v1/completions`` is several), each
with ``n`` choices; choice ``i`` of prompt ``p`` is the answer's choice ``p × n + i``
(``choices.py`` builds each). The SSE response is opened only once the first token exists, so
every failure before that is a plain HTTP error the client can act on; a failure after it is an
``error`` event, then the stream ends. A client that disconnects cancels the handler
(``handler_cancellation``), and closing the flights aborts the request on prefill and decode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import orjson
from aiohttp import web

from mooncake_lite.common.logs import set_request_id
from mooncake_lite.common.tbt import paper_tbt
from mooncake_lite.conductor.api.choices import Choice
from mooncake_lite.conductor.api.errors import ApiError, Rejected
from mooncake_lite.conductor.api.params import ApiRequest
from mooncake_lite.conductor.api.state import ApiState
from mooncake_lite.conductor.flight.events import Token
from mooncake_lite.conductor.flight.flight import Flight
from mooncake_lite.conductor.flight.placement import placed_header

log = logging.getLogger(__name__)
OUTCOMES = {400: "bad_request", 429: "rejected", 503: "unavailable"}


class Relay:
    """Answers one request from its flights (one per prompt): starts them, relays their tokens
    to the client (one JSON body, or SSE chunks), measures it and counts its outcome, and always
    closes the flights."""

    def __init__(self, st: ApiState, reqs: list[ApiRequest], flights: list[Flight], arrival: float,
                 tenant: str) -> None:
        self.st, self.reqs, self.flights, self.arrival, self.tenant = st, reqs, flights, arrival, tenant
        self.req, self.flight = reqs[0], flights[0]   # what every prompt shares; the id the client sees
        n, use = self.req.sampling.n, self.req.tools
        # Each choice parses its own tool calls (tool_parser.py), unless tool_choice is "none".
        parser = use.parser if use is not None and use.choice != "none" else None
        self.choices = [Choice(p * n + i, self.req.kind, st.tokenizer, r.stop, reasoning=st.reasoning,
                               opened=r.opens_reasoning, echo_text=r.echo_text, top_k=r.sampling.logprobs,
                               tool_parser=parser)
                        for p, r in enumerate(reqs) for i in range(n)]
        self.created = int(time.time())
        self.outcome = "ok"
        self._queue: asyncio.Queue | None = None   # a batch's tokens, from every flight
        self._last: float | None = None
        self._gaps: list[float] = []

    async def serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        mx = self.st.svc.metrics
        set_request_id(self.flight.request_id)   # every log line from here on names the request
        mx.in_flight.inc()
        mx.tenant.in_flight.labels(self.tenant).inc()
        outcome = "aborted"   # stays so if the client disconnects (the handler is cancelled)
        try:
            await _all(f.start() for f in self.flights)
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
                      sum(f.num_tokens for f in self.flights))
            stopped = any(c.is_stopped for c in self.choices)
            for flight in self.flights:
                await flight.close(abort=outcome != "ok" or stopped)

    async def _events(self) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, text delta) per token of every flight, then each choice's flush; a choice
        ends early on a stop string, and the request once every choice has ended."""
        n = self.req.sampling.n
        async for p, token in self._tokens():
            if p == 0 and token.index == 0:
                self._tick()
            self.st.svc.metrics.output_tokens.inc()
            if self.reqs[p].is_prompt_only:
                continue      # max_tokens 0: the token the flight needed is not the answer's
            choice = self.choices[p * n + token.index]
            self._echo(choice)
            yield choice, choice.add(token)
            if choice.is_stopped:
                self.flights[p].stop(token.index)
        for choice in self.choices:
            self._echo(choice)
            yield choice, choice.flush()

    def _echo(self, choice: Choice) -> None:
        """Once per choice, before its first token: with echo and logprobs, the prompt's."""
        p = choice.index // self.req.sampling.n
        result = self.flights[p].prefill_result
        if not choice.is_echoed and result is not None:
            choice.is_echoed = True
            if choice.echo_text is not None and choice.top_k is not None:
                choice.echo_prompt(self.reqs[p].prompt_ids, result.prompt_logprobs)

    async def _tokens(self) -> AsyncIterator[tuple[int, Token]]:
        """(prompt index, token) from every flight as they come, until all of them are done."""
        if len(self.flights) == 1:
            async for token in self.flight.tokens():
                yield 0, token
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, flight: Flight) -> None:
            try:
                async for token in flight.tokens():
                    queue.put_nowait((p, token))
                queue.put_nowait((p, None))
            except Exception as exc:
                queue.put_nowait((p, exc))

        tasks = [asyncio.ensure_future(pump(p, f)) for p, f in enumerate(self.flights)]
        self._queue = queue
        try:
            # A flight is done once its last token is counted, which is when it is queued (no await
            # between): its tokens still in the queue go out first.
            while not (queue.empty() and all(f.is_done for f in self.flights)):
                p, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is not None:
                    yield p, item
        finally:
            for task in tasks:
                task.cancel()

    def _has_pending(self) -> bool:
        """More tokens are already waiting (the relay can batch its writes)."""
        return self.flight.has_pending if self._queue is None else not self._queue.empty()

    def _tick(self) -> None:
        now, mx = time.perf_counter(), self.st.svc.metrics
        if self._last is None:
            mx.ttft.observe(now - self.arrival)
            mx.tenant.ttft.labels(self.tenant).observe(now - self.arrival)
        else:
            self._gaps.append(now - self._last)
            mx.itl.observe(now - self._last)
        self._last = now

    def _finish_metrics(self) -> None:
        mx = self.st.svc.metrics
        mx.e2e.observe(time.perf_counter() - self.arrival)
        tbt = paper_tbt(self._gaps)
        if tbt is not None:
            mx.tbt.observe(tbt)

    def _finish_reason(self, choice: Choice) -> str | None:
        n = self.req.sampling.n
        flight = self.flights[choice.index // n]
        if self.reqs[choice.index // n].is_prompt_only:
            return "length"
        return choice.finish_reason(flight.finish_reasons[choice.index % n])

    def _usage(self) -> dict:
        n_prompt = sum(len(r.prompt_ids) for r in self.reqs)
        n_out = sum(f.num_tokens for r, f in zip(self.reqs, self.flights) if not r.is_prompt_only)
        # What prefill really loaded from the pool, not what the scheduler hoped to reuse.
        cached = sum(f.prefill_result.num_prefix_tokens for f in self.flights if f.prefill_result is not None)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _headers(self) -> dict[str, str]:
        f, d = self.flight, self.flight.decision
        return {"X-Request-Id": f.request_id, "X-Mooncake-Prefill": d.prefill_id,
                "X-Mooncake-Decode": d.decode_id, "X-Mooncake-Route": d.route,
                "X-Mooncake-Reused-Blocks": str(d.reused_prefix_blocks), **placed_header(f.attempt.num_placed),
                **f.prediction_headers()}

    # ---- non-streaming ---------------------------------------------------------------------
    async def collect(self) -> web.Response:
        texts = {c.index: [c.echo_text or ""] for c in self.choices}
        async for choice, delta in self._events():
            texts[choice.index].append(delta)
        self._finish_metrics()
        body = {"id": self.flight.request_id, "created": self.created, "model": self.req.model,
                "usage": self._usage(), "choices": [self._whole(c, "".join(texts[c.index])) for c in self.choices]}
        body["object"] = "chat.completion" if self.req.kind == "chat" else "text_completion"
        if self.req.return_token_ids:
            body["prompt_token_ids"] = list(self.req.prompt_ids)
        return web.json_response(body, headers=self._headers(), dumps=lambda o: orjson.dumps(o).decode())

    def _whole(self, choice: Choice, text: str) -> dict:
        out: dict = {"index": choice.index, "logprobs": choice.logprobs()}
        if self.req.kind == "chat":
            out["message"] = choice.message(text)
        else:
            out["text"] = text
        out["finish_reason"] = self._finish_reason(choice)   # after message: tool calls make it "tool_calls"
        if self.req.return_token_ids:
            out["token_ids"] = [] if self.reqs[choice.index // self.req.sampling.n].is_prompt_only \
                else choice.text.token_ids
        return out

    # ---- streaming -------------------------------------------------------------------------
    async def stream(self, request: web.Request) -> web.StreamResponse:
        events = self._events()
        first = await anext(events)     # raises ApiError before any byte is sent
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **self._headers()})
        await resp.prepare(request)
        pending: list[bytes] = []   # chunks of tokens that arrived together go out in one write
        opened: set[int] = set()
        try:
            event = first
            while event is not None:
                pending += self._opening(event[0], opened) + self._delta_chunks(*event)
                # Token 1 goes out now, not with the next delta: that waits for decode's first step.
                if pending and not self._has_pending():
                    await resp.write(b"".join(pending))
                    pending.clear()
                event = await anext(events, None)
        except ApiError as exc:
            self.outcome = "upstream_error"
            await resp.write_eof(b"".join(pending) + _sse(exc.body()) + b"data: [DONE]\n\n")
            return resp
        self._finish_metrics()
        for choice in self.choices:
            pending += self._opening(choice, opened) + self._delta_chunks(choice, None)
            pending.append(_sse(self._chunk(choice, None, self._finish_reason(choice))))
        if self.req.include_usage:
            pending.append(_sse(self._envelope([], usage=self._usage())))
        # The tail, [DONE] and the end of the chunked body in one write (one syscall).
        await resp.write_eof(b"".join(pending) + b"data: [DONE]\n\n")
        return resp

    def _opening(self, choice: Choice, opened: set[int]) -> list[bytes]:
        """A choice's first chunk: the assistant's role (chat), or the echoed prompt (completions),
        with the echoed prompt's logprobs only: token 1's ride on its own text, as OpenAI sends them."""
        if choice.index in opened:
            return []
        opened.add(choice.index)
        if self.req.kind == "chat":
            return [_sse(self._chunk(choice, {"role": "assistant", "content": ""}, None, upto=0))]
        return [_sse(self._chunk(choice, choice.echo_text, None, upto=choice.num_echoed))] if choice.echo_text else []

    def _delta_chunks(self, choice: Choice, delta: str | None) -> list[bytes]:
        """The SSE chunks of one text delta (``Choice.deltas``); ``None``: what was held back.
        Logprobs not sent yet ride on the first."""
        parts = choice.deltas(delta)
        if not parts and choice.top_k is not None and choice.num_sent < len(choice.entries):
            parts = [""]   # a token whose text is held back still has its logprobs
        return [_sse(self._chunk(choice, part, None)) for part in parts]

    def _chunk(self, choice: Choice, delta: str | dict | None, finish_reason: str | None, *,
               upto: int | None = None) -> dict:
        out = {"index": choice.index, "logprobs": choice.take_logprobs(upto), "finish_reason": finish_reason}
        if self.req.kind == "chat":
            out["delta"] = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
        else:
            out["text"] = delta or ""
        return self._envelope([out])

    def _envelope(self, choices: list, **extra) -> dict:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {"id": self.flight.request_id, "object": obj, "created": self.created, "model": self.req.model,
                "choices": choices, **extra}


async def _all(starts) -> None:
    """Start every flight; the first failure is raised once none is still starting."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
