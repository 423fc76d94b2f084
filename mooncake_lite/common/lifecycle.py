"""One lifecycle for every role process: serve, join the conductor, say ready, drain, stop.

A role's ``main`` builds its app and awaits :func:`serve_role` (run on uvloop by
``service.run``, which returns the exit status it gives back). In order:

1. the app starts (its ``cleanup_ctx``: the role's own sockets and loops), then listens, and
   prints its ready line (``service.serve_app``);
2. an instance with a conductor (``Membership``) registers once its addresses are known, then
   heartbeats its load and cost model; systemd hears ``READY=1`` only once it is registered
   (the conductor can send it work). Without a conductor ``READY=1`` follows the ready line;
3. on SIGTERM/SIGINT the app drains (its ``service.DRAIN`` hook where it has one, while it
   still listens; then aiohttp's bounded wait for the handlers still running) and its
   ``cleanup_ctx`` stops what it started (the instances end their last requests there); the heartbeats go on until that is over, so the conductor does not take the
   instance for dead while its last requests end.

Anything that must stop the process on purpose (the conductor refused it, a peer it cannot serve
without is gone) calls ``app[EXIT].fail(message)``: the exit status becomes 1 and the process
stops as on SIGTERM, drain included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from mooncake_lite.common import sdnotify
from mooncake_lite.common.cost_report import CostReport
from mooncake_lite.common.membership import Conductor, Nudge, RegistrationRefused, keep_membership
from mooncake_lite.common.membership import log as membership_log
from mooncake_lite.common.protocol import InstanceLoad, Register, RunningPrefill
from mooncake_lite.common.service import serve_app

log = logging.getLogger(__name__)


@dataclass
class ExitStatus:
    """The process's exit status: 0 unless something stopped it on purpose (:meth:`fail`)."""
    code: int = 0

    def fail(self, message: str, logger: logging.Logger = log) -> None:
        """Log why (as an error of ``logger``), exit 1, and stop as on SIGTERM (drained like any stop)."""
        logger.error("%s", message)
        self.code = 1
        os.kill(os.getpid(), signal.SIGTERM)

    async def fail_when_done(self, future: Awaitable[Any], message: str, logger: logging.Logger = log) -> None:
        """:meth:`fail` once ``future`` is done: e.g. a link this process cannot serve without
        closed. Run as a task; cancelling it (shutting down closes the link on purpose) does not
        cancel the future."""
        await asyncio.shield(future)
        self.fail(message, logger)


EXIT = web.AppKey("exit", ExitStatus)


@dataclass(frozen=True)
class Listener:
    """Where a role serves: ``--host``/``--port`` (0: any free port), the host its addresses
    name to peers (``--advertise-host``, default: ``host``), and the drain's bound in seconds."""
    role: str                       # the ready line's and the logs' name: "prefill", "prefill-stage", ...
    host: str
    port: int
    advertise_host: str | None = None
    shutdown_timeout: float = 10.0


@dataclass(frozen=True)
class Membership:
    """What keeps an instance in the conductor's cluster: its registration, built once its
    addresses (``{"http": .., "data": ..}``) are known, and what each heartbeat reports."""
    conductor: Conductor
    registration: Callable[[dict[str, str]], Register]
    load: Callable[[], InstanceLoad]
    cost: Callable[[], CostReport | None]   # its current cost models, for each heartbeat
    running: Callable[[], RunningPrefill | None] = lambda: None   # a prefill's job in progress, likewise
    nudge: Nudge | None = None   # fired when ``running`` has news: the next heartbeat goes at once


async def serve_role(app: web.Application, listener: Listener, membership: Membership | None = None,
                     extra_addresses: Callable[[], dict[str, str]] | None = None,
                     on_ready: Callable[[dict[str, str]], None] = lambda addresses: None) -> int:
    """Serve ``app`` until stopped (the steps above); the exit status (``app[EXIT]``, added here
    when the app has none). ``on_ready`` is told the addresses once the ports are bound."""
    status = app.setdefault(EXIT, ExitStatus())
    listening: asyncio.Future[dict[str, str]] = asyncio.get_running_loop().create_future()
    if membership is not None:   # first in: its cleanup runs last, after the rest of the app's
        app.cleanup_ctx.insert(0, partial(_membership, membership, listener.role, listening))
    await serve_app(app, listener.host, listener.port, role=listener.role, extra_addresses=extra_addresses,
                    shutdown_timeout=listener.shutdown_timeout,
                    on_ready=lambda addresses: (listening.set_result(addresses), on_ready(addresses)),
                    advertise_host=listener.advertise_host, notify_ready=membership is None)
    return status.code


async def _membership(membership: Membership, role: str, listening: asyncio.Future[dict[str, str]],
                      app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(_join(membership, role, listening, app[EXIT]), name=f"{role}-membership")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _join(membership: Membership, role: str, listening: asyncio.Future[dict[str, str]],
                status: ExitStatus) -> None:
    addresses = await listening
    conductor = membership.conductor.url or membership.conductor.discovery
    msg = membership.registration(addresses)
    sdnotify.notify(f"STATUS={role} registering with {conductor}")
    try:
        await keep_membership(membership.conductor, msg, membership.load, membership.cost, membership.running,
                              on_registered=lambda:
                              sdnotify.ready(f"{role} serving on {addresses['http']}, registered with {conductor}"),
                              nudge=membership.nudge)
    except RegistrationRefused as exc:
        status.fail(f"{exc}; exiting", membership_log)   # logged where it always was
