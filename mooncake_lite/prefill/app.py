"""The prefill role's aiohttp app: ``/v1/prefill``, ``/v1/abort``, ``/health``, ``/v1/load``, ``/metrics``.

``POST /v1/prefill`` (PrefillRequest) answers PrefillResult once the KV stream has ended and the
first token is known. Errors: 400 ``{"error"}`` for a bad request (never retry as is), 502 when
the KV stream to decode failed or the request was aborted (decode gone, transfer refused).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from aiohttp import web

from mooncake_lite.common.auth import cluster_token_middleware
from mooncake_lite.common.metrics import add_metrics_route
from mooncake_lite.common.protocol import AbortRequest, PrefillRequest, ProtocolError, loads
from mooncake_lite.prefill.engine import PrefillAborted
from mooncake_lite.prefill.service import PrefillRejected, PrefillService
from mooncake_lite.prefill.writeback import WritebackFailuresCollector
from mooncake_lite.transfer.client import RemoteError

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", PrefillService)
EXTRA_CLEANUP = web.AppKey("extra_cleanup", list)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def prefill(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    try:
        req = loads(PrefillRequest, await request.read())
        # The conductor may go away; the prefill still finishes (decode waits for this KV).
        result = await asyncio.shield(service.prefill(req))
    except (ProtocolError, PrefillRejected) as exc:
        return error(400, str(exc))
    except PrefillAborted as exc:
        log.warning("prefill %s abandoned: %s", req.request_id, exc)
        return error(502, f"prefill abandoned: {exc}")
    except (ConnectionError, OSError, asyncio.TimeoutError) as exc:
        # Decode (KV), the store or a downstream pipeline stage: the error names the address.
        detail = f"{exc}" or type(exc).__name__
        log.warning("prefill %s: lost a peer (KV to decode %s): %s", req.request_id, req.decode_data, detail)
        return error(502, f"lost a peer during the prefill (KV to decode {req.decode_data}): {detail}")
    except RemoteError as exc:   # decode, the store or a pipeline stage refused (e.g. its KV cache is full)
        who = exc.peer or "a peer"
        log.warning("prefill %s: %s refused: %s", req.request_id, who, exc)
        return error(502, f"{who} refused: {exc}")
    except Exception as exc:     # never take the server down; say what happened
        log.exception("prefill %s failed", req.request_id)
        return error(500, f"prefill failed: {type(exc).__name__}: {exc}")
    return web.json_response(dataclasses.asdict(result))


async def abort(request: web.Request) -> web.Response:
    try:
        msg = loads(AbortRequest, await request.read())
    except ProtocolError as exc:
        return error(400, str(exc))
    return web.json_response({"aborted": request.app[SERVICE].abort(msg.request_id)})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def figures(service: PrefillService) -> dict[str, float]:
    return {**service.load(), **service.totals, "requests_done_total": service.num_done,
            "requests_failed_total": service.num_failed, "blocks_stored_total": service.stage.num_blocks_stored,
            **service.stage.writebacks.figures()}


async def load(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.json_response({**service.load(), "num_done": service.num_done, "num_failed": service.num_failed,
                              "blocks_stored": service.stage.num_blocks_stored})


def make_app(service: PrefillService, cluster_token: str | None = None) -> web.Application:
    app = web.Application(middlewares=[cluster_token_middleware(cluster_token)], client_max_size=256 << 20)
    app[SERVICE] = service
    app[EXTRA_CLEANUP] = []
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/abort", abort)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/load", load)
    add_metrics_route(app, "prefill", lambda: figures(service), service.stage.runner.device,
                      extra=[WritebackFailuresCollector(service.stage.writebacks)])
    app.cleanup_ctx.append(_lifetime)
    return app


async def _lifetime(app: web.Application):
    yield
    service = app[SERVICE]
    await service.stage.drain_puts()
    await service.links.close()
    close_store = getattr(service.stage.store, "close", None)
    if close_store is not None:
        await close_store()
    for fn in app[EXTRA_CLEANUP]:
        await fn()
