"""Cached contexts (issue #18): a client pays once to prefill a long shared prefix (a document, a
system prompt) and reuses its KV across requests until the context expires.

    POST   /v1/contexts        {"model", "prompt" | "messages", "ttl" (s), "name"?} -> the context
    GET    /v1/contexts        the caller's live contexts
    GET    /v1/contexts/{id}   one of them
    PATCH  /v1/contexts/{id}   {"ttl"}: it now expires ttl seconds from now
    DELETE /v1/contexts/{id}   unpinned at once

Creating one dispatches a prefill-only job (its KV stream goes to the conductor's sink,
``kv_sink.py``; no decode takes part), then holds the blocks the prefill wrote in that prefill's
store (the store's PIN op) until the expiry, counted against the caller's quota. A completion
naming ``context_id`` has the context's tokens put before its prompt (chat: its messages before
the request's); the usual prefix match then finds the held blocks, Algorithm 1 prices the hit on
the store holding them, and ``usage.prompt_tokens_details.cached_tokens`` says what prefill
reused. A request whose prompt merely starts with a context's reuses it the same way.

Contexts belong to the caller's tenant (its API key names it, ``conductor/tenants.py``): each
tenant sees and uses only its own, and holds at most ``--context-quota`` tokens of them. Contexts live in the conductor's memory (a restarted conductor forgets them; the
stores still hold their blocks until the expiry, so prefix matches keep working); with
``--discovery`` they are shared by every conductor through etcd (``shared.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from mooncake_lite.common import discovery
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.conductor.api.body import OFF_LOOP_BYTES, read_json
from mooncake_lite.conductor.config import Config
from mooncake_lite.conductor.contexts.book import Context, ContextBook
from mooncake_lite.conductor.contexts.upstream import prefill_only, store_pin, store_unpin
from mooncake_lite.conductor.api.errors import ApiError, bad_request, short, unavailable
from mooncake_lite.conductor.contexts.kv_sink import KVSink
from mooncake_lite.conductor.contexts.shared import SharedContexts
from mooncake_lite.conductor.api.params import TextAfterIds, _encode, chat_prompt, parse_request
from mooncake_lite.conductor.api.state import API, ApiState
from mooncake_lite.conductor.tenants import TENANT
from mooncake_lite.scheduler.tenants import DEFAULT_TENANT

log = logging.getLogger(__name__)
SWEEP_S = 5.0


@dataclass
class ContextState:
    cfg: Config
    book: ContextBook = field(default_factory=ContextBook)
    sink: KVSink = field(default_factory=KVSink)
    shared: SharedContexts | None = None   # with --discovery: the book shared through etcd (shared.py)


CONTEXTS: web.AppKey[ContextState] = web.AppKey("contexts", ContextState)


def add_routes(app: web.Application, cfg: Config) -> None:
    app[CONTEXTS] = ContextState(cfg)
    app[API].rewrite_body = use_context
    app.router.add_post("/v1/contexts", create)
    app.router.add_get("/v1/contexts", list_contexts)
    app.router.add_get("/v1/contexts/{context_id}", get_one)
    app.router.add_patch("/v1/contexts/{context_id}", extend)
    app.router.add_delete("/v1/contexts/{context_id}", delete)
    app.cleanup_ctx.append(_sink_and_sweeper)


def tenant_of(request: web.Request) -> str:
    """The caller's tenant, as the tenant middleware resolved it from its API key
    (``conductor/tenants.py``; ``default`` when no tenants are configured)."""
    return request.get(TENANT, DEFAULT_TENANT)


# ---- using a context -----------------------------------------------------------------------------
def use_context(request: web.Request, body: Any, kind: str) -> Any:
    """A completion body with ``context_id``, rewritten to carry the context's prefix first."""
    if not isinstance(body, dict) or body.get("context_id") is None:
        return body
    ctx = request.app[CONTEXTS].book.get(tenant_of(request), body["context_id"], time.time())
    body = {k: v for k, v in body.items() if k != "context_id"}
    if kind == "chat":
        if ctx.kind != "messages":
            raise bad_request(f"context {ctx.context_id} was made from a prompt: use it with /v1/completions",
                              "context_id")
        messages = body.get("messages")
        if isinstance(messages, list) and messages:   # anything else: parse_request says what is wrong
            body["messages"] = [*ctx.messages, *messages]
        return body
    if ctx.kind != "prompt":
        raise bad_request(f"context {ctx.context_id} was made from messages: use it with /v1/chat/completions",
                          "context_id")
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):   # tokenized by the parser, in its thread for a long body
        body["prompt"] = TextAfterIds(ctx.prompt_ids, prompt)
        return body
    if not isinstance(prompt, list):
        raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
    body["prompt"] = [*ctx.prompt_ids, *prompt]
    return body


# ---- endpoints -----------------------------------------------------------------------------------
async def create(request: web.Request) -> web.Response:
    st, cs = request.app[API], request.app[CONTEXTS]
    tenant = tenant_of(request)
    try:
        body, size = await read_json(request, st.body_limit)
        parse = functools.partial(_context_ids, st, body)
        # tokenized in a thread when long, as a completion's prompt is (api/routes.py)
        kind, ids, messages = await asyncio.to_thread(parse) if size > OFF_LOOP_BYTES else parse()
        ttl, name = _ttl(body, cs.cfg), _name(body)
        keys = prefix_hash(ids, st.svc.block_size, st.svc.hash_seed)
        if not keys:
            raise bad_request(f"a context must hold at least one full block ({st.svc.block_size} tokens); "
                              f"this one has {len(ids)}", "prompt" if kind == "prompt" else "messages")
        cached = len(keys) * st.svc.block_size
        _check_quota(cs, tenant, cached)
        if cs.shared is not None:
            cs.shared.check_reachable()
        cs.book.reserve(tenant, cached)
        try:
            ctx = await _make(st, cs, Context(f"ctx-{uuid.uuid4().hex}", tenant, kind, body["model"], ids,
                                              messages, tuple(keys), "", int(time.time()), 0.0, name), ttl)
        finally:
            cs.book.reserve(tenant, cached, -1)
    except ApiError as exc:
        return exc.response()
    cs.book.contexts[ctx.context_id] = ctx
    log.info("context %s: %d tokens, %d block(s) held in store %s for %.0fs", ctx.context_id, len(ids),
             len(keys), ctx.store, ttl)
    return web.json_response(ctx.public())


def _check_quota(cs: ContextState, tenant: str, num_tokens: int) -> None:
    used = cs.book.used_tokens(tenant)
    if used + num_tokens > cs.cfg.context_quota:
        raise ApiError(429, f"this context would hold {num_tokens} tokens, and your tenant already holds "
                            f"{used} of its {cs.cfg.context_quota}; delete a context or wait for one to "
                            f"expire", err_type="insufficient_quota", code="context_quota_exceeded",
                       headers={"x-should-retry": "false"})


async def _make(st: ApiState, cs: ContextState, ctx: Context, ttl: float) -> Context:
    """Prefill the context once (no decode) and hold every block of it; ApiError otherwise."""
    req = parse_request({"model": ctx.model, "prompt": list(ctx.prompt_ids), "max_tokens": 1}, "completion",
                        served=st.served, tokenizer=st.tokenizer, vocab_size=st.vocab_size,
                        max_context=st.max_context)
    ctx.model = req.model
    ctx.store = await prefill_only(st.svc, cs.sink, ctx.context_id, req, list(ctx.keys), ctx.tenant)
    ctx.expires_at = time.time() + ttl
    num_held = await store_pin(st.svc, ctx.store, ctx.context_id, ctx.keys, ctx.expires_at)
    if num_held < len(ctx.keys):
        await store_unpin(st.svc, ctx.store, ctx.context_id)
        raise unavailable(f"only {num_held} of the context's {len(ctx.keys)} blocks reached store {ctx.store} "
                          f"(is it full of held blocks?); try again")
    ctx.cached_tokens = num_held * st.svc.block_size
    if cs.shared is not None:
        try:
            await cs.shared.publish(ctx)
        except ApiError:
            await store_unpin(st.svc, ctx.store, ctx.context_id)
            raise
    return ctx


async def list_contexts(request: web.Request) -> web.Response:
    book = request.app[CONTEXTS].book
    data = [c.public() for c in book.of(tenant_of(request), time.time())]
    return web.json_response({"object": "list", "data": data})


async def get_one(request: web.Request) -> web.Response:
    try:
        return web.json_response(_lookup(request).public())
    except ApiError as exc:
        return exc.response()


async def extend(request: web.Request) -> web.Response:
    st, cs = request.app[API], request.app[CONTEXTS]
    try:
        ctx = _lookup(request)
        body, _ = await read_json(request, st.body_limit)
        if not isinstance(body, dict) or "ttl" not in body:
            raise bad_request("'ttl' (seconds from now) is required", "ttl")
        expires_at = time.time() + _ttl(body, cs.cfg)
        num_held = await store_pin(st.svc, ctx.store, ctx.context_id, ctx.keys, expires_at, wait_s=0)
        ctx.expires_at, ctx.cached_tokens = expires_at, num_held * st.svc.block_size
        if cs.shared is not None:
            await cs.shared.publish(ctx)
    except ApiError as exc:
        return exc.response()
    return web.json_response(ctx.public())


async def delete(request: web.Request) -> web.Response:
    st, cs = request.app[API], request.app[CONTEXTS]
    try:
        ctx = _lookup(request)
    except ApiError as exc:
        return exc.response()
    del cs.book.contexts[ctx.context_id]
    await store_unpin(st.svc, ctx.store, ctx.context_id)
    if cs.shared is not None:
        await cs.shared.withdraw(ctx.context_id)
    return web.json_response({"id": ctx.context_id, "object": "context.deleted", "deleted": True})


def _lookup(request: web.Request) -> Context:
    return request.app[CONTEXTS].book.get(tenant_of(request), request.match_info["context_id"], time.time())


# ---- parsing -------------------------------------------------------------------------------------
def _context_ids(st: ApiState, body: Any) -> tuple[str, tuple[int, ...], tuple[dict[str, str], ...]]:
    """(kind, token ids, messages) of a creation body; the model is checked like a completion's."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("give exactly one of 'prompt' (for /v1/completions) or 'messages' (for chat)",
                          "prompt")
    if not has_messages:   # the prompt is validated the way a completion's is
        req = parse_request({**_only(body, "model", "prompt"), "max_tokens": 1}, "completion", served=st.served,
                            tokenizer=st.tokenizer, vocab_size=st.vocab_size, max_context=st.max_context)
        return "prompt", req.prompt_ids, ()
    # Chat: validated by a chat parse; the context is the messages rendered without the
    # assistant's turn, which a request's rendering (these messages, then its own) starts with.
    parse_request({**_only(body, "model", "messages"), "max_tokens": 1}, "chat", served=st.served,
                  tokenizer=st.tokenizer, vocab_size=st.vocab_size, max_context=st.max_context)
    messages = tuple({"role": m["role"], "content": m["content"]} for m in body["messages"]
                     if isinstance(m.get("content"), str))
    if len(messages) != len(body["messages"]):
        raise bad_request("a context's messages must have string contents", "messages")
    template = st.tokenizer.chat_template
    if template is None:
        ids = _encode(st.tokenizer, chat_prompt(list(messages)).removesuffix("<|assistant|>\n"), st.max_context)
    else:
        ids = _encode(st.tokenizer, template.render(list(messages), add_generation_prompt=False),
                      st.max_context, add_special_tokens=False)
    return "messages", ids, messages


def _only(body: dict, *names: str) -> dict:
    return {k: body[k] for k in names if k in body}


def _ttl(body: dict, cfg: Config) -> float:
    ttl = body.get("ttl", cfg.context_ttl)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= cfg.context_max_ttl:
        raise bad_request(f"'ttl' must be a number of seconds in (0, {cfg.context_max_ttl:g}], got {short(ttl)}",
                          "ttl")
    return float(ttl)


def _name(body: dict) -> str | None:
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > 256):
        raise bad_request("'name' must be a string of at most 256 characters", "name")
    return name


async def _sink_and_sweeper(app: web.Application) -> AsyncIterator[None]:
    cs = app[CONTEXTS]
    await cs.sink.start(cs.cfg.host, cs.cfg.advertise_host, cs.cfg.cluster_token)
    follow = session = None
    if cs.cfg.discovery:   # its own session: the app's opens after this cleanup context
        session = aiohttp.ClientSession()
        cs.shared = SharedContexts(discovery.client(session, cs.cfg.discovery), cs.cfg.cluster_token, cs.book)
        follow = asyncio.get_running_loop().create_task(cs.shared.directory.run())

    async def sweep() -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            for ctx in cs.book.sweep(time.time()):
                log.info("context %s expired", ctx.context_id)

    task = asyncio.get_running_loop().create_task(sweep())
    yield
    task.cancel()
    if follow is not None:
        follow.cancel()
        await session.close()
    await cs.sink.stop()
