"""A stand-in for ``python -m mooncake_lite --role R`` that honours the same process contract.

It prints the JSON ready line, serves ``/health``, registers prefill/decode instances with the
conductor (sending the cluster token from MOONCAKE_CLUSTER_TOKEN, as the real roles get it),
and the conductor answers ``/v1/completions`` (streamed or not) and ``/v1/chat/completions``
(streamed) with fixed text. Misbehaviour on
demand, for the supervisor tests: ``FAKE_FAIL=ROLE`` exits with an error before ready,
``FAKE_STUBBORN=ROLE`` ignores SIGTERM and SIGINT, ``FAKE_CRASH_AFTER=ROLE:SECONDS`` dies while serving,
``FAKE_REJECT=N`` answers the first N completions with 429, ``FAKE_SLOW=ROLE`` takes a minute to start,
``FAKE_DRAIN=ROLE`` drains for a minute unless a second stop signal hurries it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import aiohttp
import orjson
from aiohttp import web

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from mooncake_lite.common.auth import api_key_middleware, cluster_headers, cluster_token_middleware  # noqa: E402
from mooncake_lite.common.service import DRAIN, announce_ready, serve_app  # noqa: E402

ANSWER = "fake answer"
MEMBERS = web.AppKey("members", list)


def parse(argv):
    p = argparse.ArgumentParser()
    for flag in ("--role", "--host", "--port", "--data-port", "--conductor", "--store", "--model", "--config",
                 "--block-size", "--log-level"):
        p.add_argument(flag)
    p.add_argument("--log-json", action="store_true")
    return p.parse_args(argv)


async def health(request):
    return web.json_response({"status": "ok", "instances": request.app.get(MEMBERS, [])})


async def register(request):
    request.app[MEMBERS].append(await request.json())
    return web.json_response({"ok": True})


async def models(request):
    return web.json_response({"object": "list", "data": [{"id": request.app["model"], "object": "model"}]})


REJECTED = web.AppKey("rejected", list)


async def chat_completions(request):
    """Chat, as the smoke client asks: the same fixed answer as content deltas."""
    body = await request.json()
    refusal = _maybe_reject(request)
    if refusal is not None:
        return refusal
    created, model = int(time.time()), body.get("model")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, word in enumerate(ANSWER.split(" ")):
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [{"index": 0, "delta": {"content": word if i == 0 else " " + word},
                              "finish_reason": "length" if i == 1 else None}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _maybe_reject(request):
    """A 429 for each of the first FAKE_REJECT requests, completions and chat together."""
    rejected = request.app[REJECTED]
    if len(rejected) >= int(os.environ.get("FAKE_REJECT", "0")):
        return None
    rejected.append(1)
    return web.json_response({"error": {"message": "overloaded", "type": "rate_limit_error"}}, status=429,
                             headers={"Retry-After": "0"})


async def completions(request):
    body = await request.json()
    refusal = _maybe_reject(request)
    if refusal is not None:
        return refusal
    created, model = int(time.time()), body.get("model")
    if not body.get("stream"):
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": created, "model": model,
                                  "choices": [{"index": 0, "text": ANSWER, "finish_reason": "length",
                                               "logprobs": None}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, word in enumerate(ANSWER.split(" ")):
        chunk = {"id": "cmpl-1", "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": 0, "text": word if i == 0 else " " + word, "logprobs": None,
                              "finish_reason": "length" if i == 1 else None}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def long_drain(bound: float, hurry: asyncio.Event) -> None:
    """A drain that outlasts any test (its bound ignored): only a second stop signal ends it."""
    print("fake drain: waiting for a second stop signal", file=sys.stderr, flush=True)
    try:
        await asyncio.wait_for(hurry.wait(), 60)
        print("fake drain: cut short", file=sys.stderr, flush=True)
    except asyncio.TimeoutError:
        print("fake drain: ran its minute out", file=sys.stderr, flush=True)


async def serve(args) -> None:
    token = os.environ.get("MOONCAKE_CLUSTER_TOKEN")
    mws = [cluster_token_middleware(token, prefixes=("/internal/",))]
    if args.role == "conductor":
        mws.append(api_key_middleware(os.environ.get("MOONCAKE_API_KEY"), prefixes=("/v1/",)))
    app = web.Application(middlewares=mws)
    app["model"] = args.model
    app[MEMBERS] = []
    app[REJECTED] = []
    app.router.add_get("/health", health)
    if os.environ.get("FAKE_DRAIN") == args.role:
        app[DRAIN] = long_drain
    if args.role == "conductor":
        app.router.add_post("/internal/v1/register", register)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/chat/completions", chat_completions)
    extra = {}
    if args.data_port is not None:
        server = await asyncio.start_server(lambda r, w: w.close(), args.host, int(args.data_port))
        extra["data"] = f"{args.host}:{server.sockets[0].getsockname()[1]}"
    if args.role in ("prefill", "decode"):
        async with aiohttp.ClientSession(headers=cluster_headers(token)) as s:
            async with s.post(f"{args.conductor}/internal/v1/register",
                              json={"role": args.role, "store": args.store, "pid": os.getpid()}) as r:
                if r.status != 200:
                    sys.stderr.write(f"register refused: HTTP {r.status}\n")
                    sys.exit(4)
    crash = os.environ.get("FAKE_CRASH_AFTER", "")
    if crash.startswith(args.role + ":"):
        asyncio.get_running_loop().call_later(float(crash.split(":")[1]), os._exit, 5)
    print(f"{args.role} argv: {' '.join(sys.argv[1:])}", file=sys.stderr, flush=True)
    await serve_app(app, args.host, int(args.port), role=args.role, extra_addresses=lambda: extra)


def main() -> int:
    args = parse(sys.argv[1:])
    if os.environ.get("FAKE_FAIL") == args.role:
        print(f"{args.role}: boom, cannot start", file=sys.stderr, flush=True)
        return 3
    if os.environ.get("FAKE_SLOW") == args.role:
        print(f"{args.role}: starting slowly", file=sys.stderr, flush=True)
        time.sleep(60)
    if os.environ.get("FAKE_STUBBORN") == args.role:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        announce_ready(args.role, http=f"{args.host}:1", data=f"{args.host}:1")
        while True:
            time.sleep(1)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
