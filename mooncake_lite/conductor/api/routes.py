"""The public OpenAI-compatible API: completions and chat (JSON or SSE), models, health, metrics.

A request is parsed (400 on anything malformed), placed by the scheduler (429 + Retry-After
when the SLOs cannot be met, 503 when no instance is up) and run by a :class:`Flight`. The SSE
response is opened only once the first token exists, so every failure before that is a plain
HTTP error the client can act on; a failure after it is an ``error`` event, then the stream
ends. A client that disconnects cancels the handler (``handler_cancellation``), and closing
the flight aborts the request on prefill and decode.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from mooncake_lite.common.logs import set_request_id
from mooncake_lite.common.tbt import paper_tbt
from mooncake_lite.conductor.flight.flight import Flight, Services
from mooncake_lite.conductor.api.errors import ApiError, bad_request, short
from mooncake_lite.conductor.api.params import ApiRequest, parse_request
from mooncake_lite.conductor.api.reasoning import ThinkSplitter, split_whole
from mooncake_lite.conductor.tenants import TENANT
from mooncake_lite.conductor.api.text import TextStream
from mooncake_lite.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 2**20   # what the HTTP parser reads at most; each model's own limit is lower
# A request body's room, from the model's context (max_body_bytes): a text character takes at most
# 6 bytes in JSON (a \u escape), a token id with its comma and spacing 16; then the other fields.
JSON_BYTES_PER_TEXT_BYTE = 6
JSON_BYTES_PER_TOKEN_ID = 16
OTHER_FIELDS_BYTES = 2**20
FALLBACK_TOKEN_BYTES = 256    # bytes per token assumed for a tokenizer with no bound of its own
OFF_LOOP_BYTES = 4096         # bodies over this many bytes are parsed (tokenized) in a thread
OUTCOMES = {400: "bad_request", 429: "rejected", 503: "unavailable"}


@dataclass
class ApiState:
    svc: Services
    tokenizer: Tokenizer
    served: tuple[str, ...]        # model names accepted in requests; the first is advertised
    vocab_size: int
    max_context: int
    created: int
    # Rewrites a body naming a cached context (conductor/contexts.py) before it is parsed.
    rewrite_body: Callable[[web.Request, object, str], object] | None = None
    reasoning: bool = False        # --reasoning-parser think: chat answers' reasoning apart (reasoning.py)
    body_limit: int = field(init=False)   # the largest (decoded) body a request can need; 413 past it

    def __post_init__(self) -> None:
        self.body_limit = max_body_bytes(self.max_context, self.tokenizer)


def max_body_bytes(max_context: int, tokenizer: Tokenizer) -> int:
    """The largest request body, once decoded, that a request fitting the model's context can
    need: a prompt of at most context × the longest token's bytes of text, each written in at most
    6 bytes of JSON, or a context of token ids; plus the other fields. A bigger body can only be
    refused, so it is, before its text is decoded, parsed or tokenized (a gzip bomb of 25 MiB
    took the conductor's event loop for 36 s)."""
    per_token = getattr(tokenizer, "max_token_bytes", None) or FALLBACK_TOKEN_BYTES
    prompt = max_context * max(per_token * JSON_BYTES_PER_TEXT_BYTE, JSON_BYTES_PER_TOKEN_ID)
    return min(MAX_BODY_BYTES, prompt + OTHER_FIELDS_BYTES)


API: web.AppKey[ApiState] = web.AppKey("api", ApiState)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def models(request: web.Request) -> web.Response:
    st = request.app[API]
    data = [{"id": st.served[0], "object": "model", "created": st.created, "owned_by": "mooncake-lite",
             "max_model_len": st.max_context}]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    m = request.app[API].svc.membership
    num_prefill, num_decode = len(m.alive("prefill")), len(m.alive("decode"))
    ok = num_prefill > 0 and num_decode > 0
    # 200 even without instances: the conductor itself is healthy; "ready" says if it can serve.
    instances = [{"instance_id": i.instance_id, "role": i.role, "http": i.reg.http, "store": i.reg.store,
                  "alive": i.is_alive} for i in m.instances.values()]
    index = request.app[API].svc.scheduler.index
    stores = [{"store": str(sid), "num_blocks": index.num_blocks(sid)} for sid in index.store_ids()]
    return web.json_response({"status": "ok", "ready": ok, "prefill": num_prefill, "decode": num_decode,
                              "instances": instances, "stores": stores})


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[API].svc
    body = svc.metrics.render(svc.membership, svc.scheduler.index.num_blocks(), svc.scheduler.costs.links)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _json_body(request: web.Request) -> object:
    return (await _read_json(request))[0]


async def _read_json(request: web.Request) -> tuple[object, int]:
    """The body as JSON, and its size once decoded; 413 past the model's ``body_limit``."""
    limit = request.app[API].body_limit
    raw = await _read_body(request, limit)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("gzip", "deflate"):
        # Compressed bodies are decoded here, not by aiohttp (auto_decompress is off, app.py), so
        # the decoded size is capped exactly and a zip bomb is a 413, off the event loop.
        raw = await asyncio.to_thread(decode_body, raw, encoding, limit)
    try:
        return orjson.loads(raw), len(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, refused (413) once past ``limit``: at once when its length says so, or as
    soon as a chunked body's bytes do."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    try:
        if request.content_length is not None:
            return await request.read()
        raw = bytearray()
        async for chunk in request.content.iter_any():
            raw += chunk
            if len(raw) > limit:
                raise _too_large(limit)
        return bytes(raw)
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    except web.RequestPayloadError as exc:   # broken chunked framing
        raise ApiError(400, f"the request body could not be read ({short(' '.join(str(exc).split()), 200)})",
                       code="invalid_body") from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (after decoding its Content-Encoding), "
                         f"more than any request that fits this model's context needs", code="request_too_large")


def decode_body(raw: bytes, encoding: str, limit: int) -> bytes:
    """A gzip (concatenated members too) or deflate (zlib-wrapped or raw) body, decoded; 413 past
    ``limit`` decoded bytes, 400 when it is not what its Content-Encoding says."""
    out = bytearray()
    rest = raw
    while rest:
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else \
            (zlib.MAX_WBITS if rest[0] & 0x0F == 8 else -zlib.MAX_WBITS)
        d = zlib.decompressobj(wbits)
        try:
            out += d.decompress(rest, limit + 1 - len(out))
        except zlib.error as exc:
            raise ApiError(400, f"the request body is not valid {encoding} data, as its Content-Encoding "
                                f"says ({exc})", code="invalid_body") from None
        if len(out) > limit or d.unconsumed_tail:
            raise _too_large(limit)
        if not d.eof:
            raise ApiError(400, f"the request body's {encoding} data is truncated", code="invalid_body")
        rest = d.unused_data   # gzip: the next member; deflate: one stream only
        if encoding == "deflate" and rest:
            raise ApiError(400, "the request body has bytes after its deflate data", code="invalid_body")
    return bytes(out)


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    st = request.app[API]
    mx = st.svc.metrics
    endpoint = "chat" if kind == "chat" else "completions"
    arrival = time.perf_counter()
    try:
        body, size = await _read_json(request)
        if st.rewrite_body is not None:
            body = st.rewrite_body(request, body, kind)
        parse = functools.partial(parse_request, body, kind, served=st.served, tokenizer=st.tokenizer,
                                  vocab_size=st.vocab_size, max_context=st.max_context)
        # A long prompt takes the tokenizer a while (~2 ms per KiB): in a thread, so the event loop
        # keeps answering heartbeats, /health and the tokens of the requests in flight meanwhile.
        req = await asyncio.to_thread(parse) if size > OFF_LOOP_BYTES else parse()
    except ApiError as exc:
        mx.requests.labels(endpoint, "bad_request").inc()
        return exc.response()
    tenant, gate = request.get(TENANT, "default"), st.svc.tenants
    try:
        if gate is not None:
            gate.admit(tenant)   # its concurrency and rate limits (429); in flight until gate.end
    except ApiError as exc:
        _tenant_outcome(mx, tenant, endpoint, exc)
        return exc.response()
    flight = Flight(st.svc, req)
    set_request_id(flight.request_id)   # every log line from here on names the request
    run = _Run(st, req, flight, arrival, tenant)
    mx.in_flight.inc()
    mx.tenant_in_flight.labels(tenant).inc()
    outcome = "aborted"   # stays so if the client disconnects (the handler is cancelled)
    try:
        await flight.start()
        resp = await (run.stream(request) if req.stream else run.collect())
        outcome = run.outcome
        return resp
    except ApiError as exc:
        outcome = OUTCOMES.get(exc.status, "upstream_error")
        if exc.status == 429:
            mx.tenant_rejections.labels(tenant, getattr(exc, "cause", "upstream-refused")).inc()
        return exc.response()
    except ConnectionResetError:
        # The client left while we were writing; the finally clause aborts upstream.
        return web.Response(status=499)
    finally:
        if gate is not None:
            gate.end(tenant)
        mx.in_flight.dec()
        mx.tenant_in_flight.labels(tenant).dec()
        mx.requests.labels(endpoint, outcome).inc()
        mx.tenant_requests.labels(tenant, outcome).inc()
        log.debug("%s %s after %.3fs: %d token(s)", endpoint, outcome, time.perf_counter() - arrival,
                  flight.num_tokens)
        await flight.close(abort=outcome != "ok" or run.is_text_stopped)


def _tenant_outcome(mx, tenant: str, endpoint: str, exc: ApiError) -> None:
    """A request its tenant's limits refused before it was placed, counted."""
    mx.requests.labels(endpoint, "rejected").inc()
    mx.tenant_requests.labels(tenant, "rejected").inc()
    mx.tenant_rejections.labels(tenant, getattr(exc, "cause", "upstream-refused")).inc()


class _Run:
    """Relays one flight's tokens to the client and measures it."""

    def __init__(self, st: ApiState, req: ApiRequest, flight: Flight, arrival: float,
                 tenant: str = "default") -> None:
        self.st, self.req, self.flight, self.arrival, self.tenant = st, req, flight, arrival, tenant
        self.text = TextStream(st.tokenizer, req.stop)
        self.thinking = ThinkSplitter(req.opens_reasoning) if st.reasoning and req.kind == "chat" else None
        self.created = int(time.time())
        self.outcome = "ok"
        self.is_text_stopped = False
        self._last: float | None = None
        self._gaps: list[float] = []

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
            mx.tenant_ttft.labels(self.tenant).observe(now - self.arrival)
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
        pending.append(_sse(self._chunk(None, self.flight.finish_reason)))
        if self.req.include_usage:
            pending.append(_sse(self._envelope([], usage=self._usage())))
        # The tail, [DONE] and the end of the chunked body in one write (one syscall).
        await resp.write_eof(b"".join(pending) + b"data: [DONE]\n\n")
        return resp

    def _delta_chunks(self, delta: str | None) -> list[bytes]:
        """The SSE chunks of one text delta: one of content, or with --reasoning-parser think
        up to two (reasoning, then content); ``None``: the splitter's held-back end."""
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
