"""The public OpenAI-compatible API: completions and chat (JSON or SSE), models, health, metrics.

A request is read and parsed (413 past the model's bound, 400 on anything malformed), let in by
its tenant's limits (429), placed by the scheduler (429 + Retry-After when the SLOs cannot be
met, 503 when no instance is up) and run by a :class:`Flight`, whose answer :class:`Relay` writes.
"""

from __future__ import annotations

import asyncio
import functools
import time

from aiohttp import web

from mooncake_lite.conductor.api.body import OFF_LOOP_BYTES, read_json
from mooncake_lite.conductor.api.errors import ApiError, Rejected
from mooncake_lite.conductor.api.params import ApiRequest, parse_request, unknown_model
from mooncake_lite.conductor.api.relay import Relay
from mooncake_lite.conductor.api.state import API, ApiState
from mooncake_lite.conductor.cluster import discovery
from mooncake_lite.conductor.flight.flight import Flight
from mooncake_lite.conductor.tenants import TENANT
from mooncake_lite.scheduler.tenants import DEFAULT_TENANT


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def models(request: web.Request) -> web.Response:
    st = request.app[API]
    return web.json_response({"object": "list", "data": [_model_card(st, st.served[0])]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (the openai client's ``models.retrieve``): any name requests may
    use; another is OpenAI's 404 ``model_not_found``."""
    st, name = request.app[API], request.match_info["model"]
    if name not in st.served:
        return unknown_model(name, st.served[0], status=404).response()
    return web.json_response(_model_card(st, name))


def _model_card(st: ApiState, name: str) -> dict:
    return {"id": name, "object": "model", "created": st.created, "owned_by": "mooncake-lite",
            "max_model_len": st.max_context}


async def health(request: web.Request) -> web.Response:
    m = request.app[API].svc.membership
    num_prefill, num_decode = len(m.alive("prefill")), len(m.alive("decode"))
    ok = num_prefill > 0 and num_decode > 0
    # 200 even without instances: the conductor itself is healthy; "ready" says if it can serve.
    instances = [{"instance_id": i.instance_id, "role": i.role, "http": i.reg.http, "store": i.reg.store,
                  "alive": i.is_alive} for i in m.instances.values()]
    index = request.app[API].svc.scheduler.index
    stores = [{"store": sid, "num_blocks": index.num_blocks(sid)} for sid in m.stores.known(index.store_ids())]
    # 503 until the view is rebuilt after a start (conductor/cluster/rebuild.py), and with ?ready
    # (a balancer's check) while it cannot serve, e.g. cut off from its instances: out of rotation
    rebuilt = discovery.is_rebuilt(request.app)
    serving = rebuilt and (ok or "ready" not in request.query)
    return web.json_response({"status": "ok" if rebuilt else "rebuilding", "ready": ok, "prefill": num_prefill,
                              "decode": num_decode, "instances": instances, "stores": stores},
                             status=200 if serving else 503)


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[API].svc
    body = svc.metrics.render(svc.membership, svc.scheduler.index.num_blocks(), svc.scheduler.costs.links)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    """A completion or chat request: parsed, let in by its tenant's limits, then flown and relayed."""
    st = request.app[API]
    mx, gate = st.svc.metrics, st.svc.tenants
    endpoint = "chat" if kind == "chat" else "completions"
    arrival = time.perf_counter()
    try:
        req = await _parse(request, st, kind)
    except ApiError as exc:
        mx.requests.labels(endpoint, "bad_request").inc()
        return exc.response()
    tenant = request.get(TENANT, DEFAULT_TENANT)   # the tenant middleware's, from the API key
    try:
        if gate is not None:
            gate.admit(tenant)   # its concurrency and rate limits (429); in flight until gate.end
    except Rejected as exc:
        mx.requests.labels(endpoint, "rejected").inc()
        mx.tenant.requests.labels(tenant, "rejected").inc()
        mx.tenant.rejections.labels(tenant, exc.cause).inc()
        return exc.response()
    try:
        reqs = req.each()   # one flight per prompt of a batch
        flights = [Flight(st.svc, r, tenant) for r in reqs]
        return await Relay(st, reqs, flights, arrival, tenant).serve(request, endpoint)
    finally:
        if gate is not None:
            gate.end(tenant)


async def _parse(request: web.Request, st: ApiState, kind: str) -> ApiRequest:
    """The request's body, read (413 past the model's bound), rewritten when it names a cached
    context, and parsed (400)."""
    body, size = await read_json(request, st.body_limit)
    if st.rewrite_body is not None:
        body = st.rewrite_body(request, body, kind)
    parse = functools.partial(parse_request, body, kind, served=st.served, tokenizer=st.tokenizer,
                              vocab_size=st.vocab_size, max_context=st.max_context, tool_parser=st.tool_parser)
    # A long prompt takes the tokenizer a while (~2 ms per KiB): in a thread, so the event loop
    # keeps answering heartbeats, /health and the tokens of the requests in flight meanwhile.
    req = await asyncio.to_thread(parse) if size > OFF_LOOP_BYTES else parse()
    if req.constraint is not None and st.grammars is not None:
        await st.grammars.check(req.constraint)   # a new grammar compiles, bounded, in a child (400)
    return req
