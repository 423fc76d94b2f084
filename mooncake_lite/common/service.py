"""Run a role's aiohttp app on uvloop with a machine-readable ready line and graceful drain.

Every role process prints exactly one JSON line on stdout once it serves::

    {"event": "ready", "role": "store", "http": "127.0.0.1:8100", "data": "127.0.0.1:8101"}

Logs go to stderr. ``common/launch.py`` waits for that line, for ``mooncake up``, the test
fixtures and the benchmarks alike (ports may be 0, meaning "pick a free one", so the line is the
only place the real port is known).

Slow clients are cut: a request's headers must arrive within ``HEADER_TIMEOUT_S`` of the
connection opening or of the previous response (aiohttp's keep-alive timer, which also closes
idle keep-alive connections; kept above aiohttp clients' own 15 s keep-alive so a pooled
connection is never closed under a client that is about to reuse it), and its body within
``BODY_TIMEOUT_S`` of the handler starting (a middleware; streaming answers are not limited).

What aiohttp answers on its own, before any handler or middleware runs (a bad request line or
header: 400; an unhandled exception: 500), is OpenAI-style JSON like every other error of ours.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import orjson
from aiohttp import web

from mooncake_lite.common import sdnotify, tracing
from mooncake_lite.common.config import ListenError
from mooncake_lite.common.logs import reset_request_id, set_request_id
from mooncake_lite.common.auth import openai_error

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 30.0
MAX_ERROR_CHARS = 200   # a parser's message quotes the client's bytes: echo only so much

# An app's own drain, if it has one: awaited on SIGINT/SIGTERM with the drain's bound in seconds
# and a ``hurry`` event, while the app still listens (its peers' heartbeats still arrive); it
# refuses new work and returns once its work in flight is over, or soon after ``hurry`` is set (a
# second stop signal: end the work in flight now). Then the listener closes (``drain``, ``serve_app``).
DRAIN: web.AppKey[Callable[[float, asyncio.Event], Awaitable[None]]] = web.AppKey("drain")


def announce_ready(role: str, **addresses: str) -> None:
    sys.stdout.write(orjson.dumps({"event": "ready", "role": role, **addresses}).decode() + "\n")
    sys.stdout.flush()


def body_timeout_middleware(timeout: float):
    """Close the connection of a request whose body has not fully arrived ``timeout`` seconds
    after its headers (the handler awaiting it then fails with a connection error)."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        if not request.body_exists or request.content.is_eof():
            return await handler(request)

        def expire() -> None:
            if not request.content.is_eof() and request.transport is not None:
                log.warning("closing HTTP connection from %s: %s %s body not received within %gs",
                            request.remote, request.method, request.path, timeout)
                request.transport.close()

        timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            return await handler(request)
        finally:
            timer.cancel()
    return middleware


class JsonErrorHandler(web.RequestHandler):
    """aiohttp's connection handler with its own error answers (parse errors, uncaught
    exceptions) in OpenAI's JSON shape instead of plain text."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if a response began
        detail = message if message and status != 500 else HTTPStatus(status).phrase
        resp = openai_error(status, detail[:MAX_ERROR_CHARS],
                            err_type="invalid_request_error" if status < 500 else "server_error",
                            code=HTTPStatus(status).phrase.lower().replace(" ", "_"))
        resp.force_close()  # the stream may be out of step with the parser: start afresh
        return resp


class JsonErrorServer(web.Server):
    """The protocol factory a runner listens with, making :class:`JsonErrorHandler`s."""

    def __call__(self) -> web.RequestHandler:
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)


@web.middleware
async def request_id_scope(request: web.Request, handler):
    """The request id a handler tags its log lines with (``common/logs.set_request_id``) ends
    with it: the connection's next request starts untagged."""
    token = set_request_id(None)
    try:
        return await handler(request)
    finally:
        reset_request_id(token)


async def start_site(app: web.Application, host: str, port: int, *, shutdown_timeout: float = 10.0,
                     header_timeout: float = HEADER_TIMEOUT_S,
                     body_timeout: float = BODY_TIMEOUT_S) -> tuple[web.AppRunner, web.TCPSite]:
    """Serve ``app`` on host:port with the header and body timeouts; the caller cleans up the
    runner. The app must not have started yet (the body middleware goes first in its chain)."""
    app.middlewares.insert(0, body_timeout_middleware(body_timeout))
    if tracing.is_enabled():   # a caller's traceparent header parents the handler's spans
        app.middlewares.insert(0, tracing.remote_parent_middleware())
    app.middlewares.insert(0, request_id_scope)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=shutdown_timeout,
                           keepalive_timeout=header_timeout)
    await runner.setup()
    runner.server.__class__ = JsonErrorServer  # aiohttp offers no hook; the subclass adds no state
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:   # taken, or not this host's: one line for the user, not a traceback
        await runner.cleanup()
        raise ListenError.of(exc, host, port, "--port") from None
    return runner, site


def bound_port(site: web.TCPSite) -> int:
    server = site._server  # aiohttp exposes no public accessor for the bound socket
    return server.sockets[0].getsockname()[1]


async def serve_app(app: web.Application, host: str, port: int, *, role: str,
                    extra_addresses: Callable[[], dict[str, str]] | None = None,
                    shutdown_timeout: float = 10.0,
                    on_ready: Callable[[dict[str, str]], None] | None = None,
                    advertise_host: str | None = None, notify_ready: bool = True) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, then drain for ``shutdown_timeout`` (:func:`drain`).
    ``on_ready(addresses)`` runs once the real ports are known (e.g. to register with the
    conductor); the addresses name ``advertise_host`` (default: ``host``) and the bound port.
    Under systemd (``common/sdnotify.py``) the watchdog pings from this loop throughout,
    ``READY=1`` follows the ready line unless ``notify_ready`` is False (the caller sends it
    once it can really serve, e.g. registered), and ``STOPPING=1`` starts the drain. A second
    SIGINT/SIGTERM during the drain cuts it short (the app's :data:`DRAIN` is told to hurry)."""
    watchdog = sdnotify.start_watchdog()
    runner, site = await start_site(app, host, port, shutdown_timeout=shutdown_timeout)
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_stop_signal, role, stop, hurry, DRAIN in app)
    addresses = {"http": f"{advertise_host or host}:{bound_port(site)}"}
    if extra_addresses:
        addresses.update(extra_addresses())
    announce_ready(role, **addresses)
    if on_ready is not None:
        on_ready(addresses)
    if notify_ready:
        sdnotify.notify("READY=1", f"STATUS={role} serving on {addresses['http']}")
    log.info("%s serving on %s", role, addresses)
    try:
        await stop.wait()
        sdnotify.notify("STOPPING=1", f"STATUS={role} draining")
        log.info("%s draining", role)
        await drain(app, shutdown_timeout, hurry)
    finally:
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if watchdog is not None:
            watchdog.cancel()
        log.info("%s stopped", role)


def _on_stop_signal(role: str, stop: asyncio.Event, hurry: asyncio.Event, has_drain: bool) -> None:
    """The first SIGINT/SIGTERM starts the drain; the next one (an impatient Ctrl-C, a
    supervisor's second SIGTERM) tells the app's :data:`DRAIN` to hurry. Later ones change nothing."""
    if not stop.is_set():
        stop.set()
    elif not hurry.is_set():
        hurry.set()
        if has_drain:
            log.warning("%s: a second stop signal: cutting the drain short", role)
        else:   # its stop is aiohttp's cleanup (and the app's own), bounded as it is
            log.warning("%s: a second stop signal: already stopping", role)


async def drain(app: web.Application, timeout: float, hurry: asyncio.Event | None = None) -> None:
    """The part of a drain that runs before the listener closes: the app's :data:`DRAIN`, if it
    has one, cut short once ``hurry`` is set. The rest is aiohttp's (``runner.cleanup``): the
    listener closes, handlers still running get ``timeout`` seconds, then the app's cleanup runs."""
    hook = app.get(DRAIN)
    if hook is not None:
        await hook(timeout, hurry if hurry is not None else asyncio.Event())


def run(main: Callable[[], Awaitable[int | None]]) -> int:
    """Run a coroutine on uvloop (asyncio's default loop if uvloop is missing); the exit status
    it returns (None: 0)."""
    try:
        import uvloop
        status = uvloop.run(main())
    except ImportError:
        status = asyncio.run(main())
    return status or 0
