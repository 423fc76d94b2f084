"""The conductor's graceful stop (SIGTERM, Ctrl-C): the requests in flight finish, nothing new starts.

``common/service.serve_app`` awaits :meth:`Drain.run` before it closes the listener, so during
the drain the conductor still takes heartbeats, block events and ``/health``: the instances its
requests run on stay alive in its eyes. (Closing the listener first made every heartbeat fail,
and after ``--dead-after`` the conductor's own reaper declared the healthy decode dead and failed
every stream with "stopped heartbeating"; a drain could never outlast ``--dead-after``.) Keeping
the door open, rather than pausing the reaper, keeps a real death during the drain detected, and
lets a new request be told why it is refused: a 503 on the public API (``/v1/``). ``/health``
answers 503 ``draining`` meanwhile, so a load balancer or watcher takes the conductor out of
rotation. A request still running when the drain's bound is up, or when a second stop signal cuts
the drain short (``hurry``), ends with an error that names the shutdown (a 503, or an SSE error
event), not a cut connection.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from mooncake_lite.conductor.api.errors import shutting_down
from mooncake_lite.conductor.cluster.membership import Membership

log = logging.getLogger(__name__)
PUBLIC_PREFIX = "/v1/"
HEALTH_PATH = "/health"
END_GRACE_S = 1.0    # for requests ended at the bound to write their error and return


class Drain:
    """Counts the public requests in flight (:meth:`middleware`) and drains them (:meth:`run`)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.is_draining = False
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def middleware(self):
        @web.middleware
        async def drain_middleware(request: web.Request, handler) -> web.StreamResponse:
            if not request.path.startswith(PUBLIC_PREFIX):
                if self.is_draining and request.path == HEALTH_PATH:
                    return self._health()
                return await handler(request)   # heartbeats, block events: still taken
            if self.is_draining:
                resp = shutting_down("the conductor is shutting down and takes no new requests; "
                                     "retry shortly").response()
                resp.force_close()
                return resp
            self._active += 1
            self._idle.clear()
            try:
                return await handler(request)   # a stream's handler returns once it is written
            finally:
                self._active -= 1
                if not self._active:
                    self._idle.set()
        return drain_middleware

    def _health(self) -> web.Response:
        """``/health`` while draining: a 503 (out of rotation), built without touching the
        membership or the block index (a watcher may poll it often)."""
        return web.json_response({"status": "draining", "ready": False, "in_flight": self._active,
                                  "message": "the conductor is shutting down: it finishes the requests "
                                             "in flight and takes no new ones"}, status=503)

    async def run(self, bound: float, hurry: asyncio.Event | None = None) -> None:
        """Refuse new requests; wait up to ``bound`` seconds for those in flight (less if
        ``hurry`` is set: a second stop signal), then end the rest with an error naming the
        shutdown and give them :data:`END_GRACE_S` to say so."""
        self.is_draining = True
        if self._active:
            log.info("draining: waiting up to %gs for %d request(s) in flight", bound, self._active)
        if await self._until_idle(bound, hurry):
            return
        if hurry is not None and hurry.is_set():
            why, over = "its drain was cut short by a second stop signal", "drain cut short"
        else:
            why, over = f"its drain of {bound:g}s ran out", f"drain of {bound:g}s over"
        told = self.membership.end_requests(f"the conductor shut down before the request completed ({why})")
        log.warning("%s: ending %d request(s) still running (%d placed on instances)", over, self._active, told)
        await self._until_idle(END_GRACE_S)

    async def _until_idle(self, timeout: float, hurry: asyncio.Event | None = None) -> bool:
        """True once no request is in flight; False after ``timeout`` or once ``hurry`` is set."""
        idle = asyncio.ensure_future(self._idle.wait())
        waits = {idle} if hurry is None else {idle, asyncio.ensure_future(hurry.wait())}
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        return self._idle.is_set()
