"""The decode role's aiohttp app: ``/v1/generate`` (NDJSON token stream), ``/v1/abort``, load, ``/metrics``.

``POST /v1/generate`` (GenerateRequest) reserves KV room and answers at once: either 429 with
``{"error": reason}`` when the local check refuses (TBT SLO, memory, batch size), or 200 with an
``application/x-ndjson`` stream whose headers go out immediately — the caller should wait for them
before starting the prefill, so the KV never arrives before its request. Lines are TokenEvents
from the *second* token on; the last carries ``finish_reason``. A client that disconnects aborts
the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import orjson
from aiohttp import web

from mooncake_lite.common.auth import cluster_token_middleware
from mooncake_lite.common.metrics import add_metrics_route
from mooncake_lite.common.protocol import AbortRequest, GenerateRequest, ProtocolError, TokenEvent, loads
from mooncake_lite.decode.batcher import AdmissionError
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.decode.kv_receiver import start_kv_server
from mooncake_lite.transfer.server import server_address

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", DecodeEngine)
RUNTIME = web.AppKey("runtime", dict)   # filled at startup: {"data": "host:port"}
STATS = web.AppKey("stats", dict)


@dataclass(frozen=True)
class DecodeAppSettings:
    host: str = "127.0.0.1"
    data_port: int = 0
    cluster_token: str | None = None
    disconnect_poll_s: float = 0.5
    advertise_host: str | None = None   # the data address given to peers (default: host)


SETTINGS = web.AppKey("settings", DecodeAppSettings)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        req = loads(GenerateRequest, await request.read())
        if req.kv_timeout_s <= 0:
            raise ProtocolError("GenerateRequest.kv_timeout_s must be positive")
        events = engine.add_request(req)
    except AdmissionError as exc:
        request.app[STATS]["rejected"] += 1
        log.info("refused request %s: %s", getattr(req, "request_id", "?"), exc)
        return error(429, str(exc))
    except (ProtocolError, ValueError) as exc:
        return error(400, str(exc))
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    finished = False
    try:
        await resp.prepare(request)
        while True:
            try:
                event = await asyncio.wait_for(events.get(), request.app[SETTINGS].disconnect_poll_s)
            except asyncio.TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client went away")
                continue
            await resp.write(orjson.dumps(_event_dict(event)) + b"\n")
            if event.finish_reason is not None:
                finished = True
                break
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        if not finished:
            log.info("client of request %s disconnected; aborting it", req.request_id)
        raise
    finally:
        if not finished:
            engine.abort(req.request_id)
    return resp


def _event_dict(event: TokenEvent) -> dict:
    return {k: v for k, v in (("token", event.token), ("finish_reason", event.finish_reason),
                              ("error", event.error)) if v is not None}


async def abort(request: web.Request) -> web.Response:
    try:
        msg = loads(AbortRequest, await request.read())
    except ProtocolError as exc:
        return error(400, str(exc))
    return web.json_response({"aborted": request.app[ENGINE].abort(msg.request_id)})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def load(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response({**engine.load(), "num_steps": engine.num_steps,
                              "pending_transfers": len(engine.pending), **request.app[STATS]})


def figures(app: web.Application) -> dict[str, float]:
    engine = app[ENGINE]
    return {**engine.load(), "steps_total": engine.num_steps, "pending_transfers": len(engine.pending),
            "rejected_total": app[STATS]["rejected"]}


def make_app(engine: DecodeEngine, settings: DecodeAppSettings) -> web.Application:
    """The decode app around a ready engine; the step loop and the KV data socket live in
    ``cleanup_ctx`` (started with the app, stopped on shutdown)."""
    app = web.Application(middlewares=[cluster_token_middleware(settings.cluster_token)],
                          client_max_size=64 << 20)
    app[ENGINE] = engine
    app[SETTINGS] = settings
    app[STATS] = {"rejected": 0}
    app[RUNTIME] = {}
    app.router.add_post("/v1/generate", generate)
    app.router.add_post("/v1/abort", abort)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/load", load)
    add_metrics_route(app, "decode", lambda: figures(app), engine.runner.device)
    app.cleanup_ctx.append(_background)
    return app


async def _background(app: web.Application):
    engine, settings = app[ENGINE], app[SETTINGS]
    server = await start_kv_server(engine, settings.host, settings.data_port, settings.cluster_token)
    app[RUNTIME]["data"] = server_address(server, settings.advertise_host)
    loop_task = asyncio.create_task(engine.run(), name="decode-steps")
    yield
    loop_task.cancel()
    server.close()
    for rid in list(engine.requests):
        engine.abort(rid, "abort", "decode instance shutting down")
    try:
        await loop_task
    except asyncio.CancelledError:
        pass


def make_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-model")
