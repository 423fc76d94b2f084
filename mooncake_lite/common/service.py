"""Run a role's aiohttp app on uvloop with a machine-readable ready line and graceful drain.

Every role process prints exactly one JSON line on stdout once it serves::

    {"event": "ready", "role": "store", "http": "127.0.0.1:8100", "data": "127.0.0.1:8101"}

Logs go to stderr. ``common/launch.py`` waits for that line, for ``mooncake up``, the test
fixtures and the benchmarks alike (ports may be 0, meaning "pick a free one", so the line is the
only place the real port is known).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

log = logging.getLogger(__name__)


def announce_ready(role: str, **addresses: str) -> None:
    sys.stdout.write(orjson.dumps({"event": "ready", "role": role, **addresses}).decode() + "\n")
    sys.stdout.flush()


def bound_port(site: web.TCPSite) -> int:
    server = site._server  # aiohttp exposes no public accessor for the bound socket
    return server.sockets[0].getsockname()[1]


async def serve_app(app: web.Application, host: str, port: int, *, role: str,
                    extra_addresses: Callable[[], dict[str, str]] | None = None,
                    shutdown_timeout: float = 10.0,
                    on_ready: Callable[[dict[str, str]], None] | None = None,
                    advertise_host: str | None = None) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, then stop accepting and drain for ``shutdown_timeout``.
    ``on_ready(addresses)`` runs once the real ports are known (e.g. to register with the
    conductor); the addresses name ``advertise_host`` (default: ``host``) and the bound port."""
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    addresses = {"http": f"{advertise_host or host}:{bound_port(site)}"}
    if extra_addresses:
        addresses.update(extra_addresses())
    announce_ready(role, **addresses)
    if on_ready is not None:
        on_ready(addresses)
    log.info("%s serving on %s", role, addresses)
    try:
        await stop.wait()
        log.info("%s draining", role)
    finally:
        await runner.cleanup()
        log.info("%s stopped", role)


def run(main: Callable[[], Awaitable[None]]) -> int:
    """Run a coroutine on uvloop (asyncio's default loop if uvloop is missing)."""
    try:
        import uvloop
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    return 0
