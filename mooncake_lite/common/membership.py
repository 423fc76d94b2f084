"""Joining a conductor: ``Register`` once the ports are known, then periodic ``Heartbeat``s.

Used by both the prefill and the decode role. A 409 answer means the conductor refuses this
instance (model, block size or hash seed differ from the cluster): the error is logged and the
process exits non-zero. An unreachable conductor is retried (it may start after us); a heartbeat
answered 404 (the conductor restarted and forgot us) triggers a fresh registration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import Heartbeat, InstanceLoad, Register, dumps

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}


class RegistrationRefused(RuntimeError):
    pass


async def register(session: aiohttp.ClientSession, conductor: str, msg: Register, token: str | None,
                   retry_s: float = 0.5, max_wait_s: float = 60.0) -> None:
    """POST the registration, retrying while the conductor is unreachable; 409 raises."""
    url = conductor.rstrip("/") + "/internal/v1/register"
    waited = 0.0
    while True:
        try:
            async with session.post(url, data=dumps(msg), headers={**JSON, **cluster_headers(token)}) as resp:
                body = await resp.text()
                if resp.status == 409:
                    raise RegistrationRefused(f"conductor {conductor} refused registration: {body.strip()}")
                if resp.status < 300:
                    log.info("registered with conductor %s as %s", conductor, msg.instance_id)
                    return
                log.warning("conductor %s answered %d to register: %s", conductor, resp.status, body[:300])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:   # the session's total timeout is the latter
            log.warning("conductor %s unreachable (%r); retrying", conductor, exc)
        if waited >= max_wait_s:
            raise RegistrationRefused(f"could not register with conductor {conductor} within {max_wait_s:g}s")
        await asyncio.sleep(retry_s)
        waited += retry_s


async def keep_membership(conductor: str, msg: Register, load: Callable[[], InstanceLoad],
                          interval_s: float, token: str | None,
                          on_refused: Callable[[str], None],
                          on_registered: Callable[[], None] | None = None,
                          cost: Callable[[], dict[str, float] | None] | None = None) -> None:
    """Register, then heartbeat forever (run as a background task); ``on_registered`` runs
    once, after the first registration (the instance can be sent work from then on). ``cost``
    gives the instance's current cost model for each heartbeat (and a re-registration)."""
    hb_url = conductor.rstrip("/") + "/internal/v1/heartbeat"
    headers = {**JSON, **cluster_headers(token)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        try:
            await register(session, conductor, msg, token)
            if on_registered is not None:
                on_registered()
            while True:
                await asyncio.sleep(interval_s)
                current = cost() if cost is not None else None
                beat = Heartbeat(msg.instance_id, InstanceLoad(**{k: float(v) for k, v in load().reported().items()}), current)
                try:
                    async with session.post(hb_url, data=dumps(beat), headers=headers) as resp:
                        if resp.status == 404:
                            log.warning("conductor forgot this instance; registering again")
                            await register(session, conductor, replace(msg, cost=current) if current else msg, token)
                        elif resp.status == 409:
                            raise RegistrationRefused(f"conductor refused heartbeat: {(await resp.text())[:300]}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:   # a timeout must not end the loop
                    log.warning("heartbeat to %s failed: %r", conductor, exc)
        except RegistrationRefused as exc:
            on_refused(str(exc))


def exit_process(app_state: dict, key) -> Callable[[str], None]:
    """``on_refused`` that logs, records exit code 1 under ``key`` and stops the server."""
    def refuse(message: str) -> None:
        log.error("%s; exiting", message)
        app_state[key] = 1
        os.kill(os.getpid(), signal.SIGTERM)
    return refuse
