"""What the prefill and the decode app serve alike: ``POST /v1/abort``, ``GET /health``, their
``{"error": ...}`` answers and the cluster token check. ``instance_app`` is the app each of them
adds its own routes to.

``POST /v1/abort`` (AbortRequest) ends the request wherever it is on this instance and answers
``{"aborted": bool}`` (False: not here, or already over).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from mooncake_lite.common.auth import cluster_token_middleware
from mooncake_lite.common.lifecycle import EXIT, ExitStatus
from mooncake_lite.common.logs import set_request_id
from mooncake_lite.common.protocol import AbortRequest, ProtocolError, loads

log = logging.getLogger(__name__)

# Ends one request on this instance by its id; True if it was here and running.
ABORT: web.AppKey[Callable[[str], bool]] = web.AppKey("abort")
# Why the instance cannot serve any more (a tensor-parallel rank died), or None; absent: healthy.
UNHEALTHY: web.AppKey[Callable[[], str | None]] = web.AppKey("unhealthy")


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def instance_app(abort: Callable[[str], bool], cluster_token: str | None, client_max_size: int) -> web.Application:
    """An instance's app with the routes every instance serves; the role adds its own."""
    app = web.Application(middlewares=[cluster_token_middleware(cluster_token)], client_max_size=client_max_size)
    app[ABORT] = abort
    app[EXIT] = ExitStatus()
    app.router.add_post("/v1/abort", abort_request)
    app.router.add_get("/health", health)
    return app


async def abort_request(request: web.Request) -> web.Response:
    try:
        msg = loads(AbortRequest, await request.read())
    except ProtocolError as exc:
        return error(400, str(exc))
    set_request_id(msg.request_id)
    log.debug("abort asked")
    return web.json_response({"aborted": request.app[ABORT](msg.request_id)})


async def health(request: web.Request) -> web.Response:
    reason = request.app[UNHEALTHY]() if UNHEALTHY in request.app else None
    if reason is not None:
        return web.json_response({"status": "unhealthy", "error": reason}, status=503)
    return web.json_response({"status": "ok"})
