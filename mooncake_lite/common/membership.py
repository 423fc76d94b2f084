"""Joining a conductor: ``Register`` once the ports are known, then periodic ``Heartbeat``s.

Used by both the prefill and the decode role (through ``common/lifecycle.py``). A 409 answer
means the conductor refuses this instance (model, block size or hash seed differ from the
cluster): ``RegistrationRefused`` ends the membership, and the lifecycle the process. An
unreachable conductor is retried (it may start after us); a heartbeat answered 404 (the conductor
restarted and forgot us) triggers a fresh registration.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.cost_report import CostReport
from mooncake_lite.common.protocol import Heartbeat, InstanceLoad, Register, dumps

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}


class RegistrationRefused(RuntimeError):
    pass


@dataclass(frozen=True)
class Conductor:
    """The conductor an instance joins (``--conductor``), the secret it presents
    (``--cluster-token``) and how often it reports its load (``--heartbeat-interval``)."""
    url: str
    token: str | None = None
    heartbeat_interval_s: float = 1.0


async def register(session: aiohttp.ClientSession, conductor: Conductor, msg: Register,
                   retry_s: float = 0.5, max_wait_s: float = 60.0) -> None:
    """POST the registration, retrying while the conductor is unreachable; 409 raises."""
    url = conductor.url.rstrip("/") + "/internal/v1/register"
    waited = 0.0
    while True:
        try:
            async with session.post(url, data=dumps(msg), headers={**JSON, **cluster_headers(conductor.token)}) as resp:
                body = await resp.text()
                if resp.status == 409:
                    raise RegistrationRefused(f"conductor {conductor.url} refused registration: {body.strip()}")
                if resp.status < 300:
                    log.info("registered with conductor %s as %s", conductor.url, msg.instance_id)
                    return
                log.warning("conductor %s answered %d to register: %s", conductor.url, resp.status, body[:300])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:   # the session's total timeout is the latter
            log.warning("conductor %s unreachable (%r); retrying", conductor.url, exc)
        if waited >= max_wait_s:
            raise RegistrationRefused(f"could not register with conductor {conductor.url} within {max_wait_s:g}s")
        await asyncio.sleep(retry_s)
        waited += retry_s


async def keep_membership(conductor: Conductor, msg: Register, load: Callable[[], InstanceLoad],
                          cost: Callable[[], CostReport | None],
                          on_registered: Callable[[], object] = lambda: None) -> None:
    """Register, then heartbeat forever (run as a background task); ``on_registered`` runs
    once, after the first registration (the instance can be sent work from then on). ``cost``
    gives the instance's current cost model for each heartbeat (and a re-registration).
    Raises RegistrationRefused when the conductor refuses this instance."""
    hb_url = conductor.url.rstrip("/") + "/internal/v1/heartbeat"
    headers = {**JSON, **cluster_headers(conductor.token)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        await register(session, conductor, msg)
        on_registered()
        while True:
            await asyncio.sleep(conductor.heartbeat_interval_s)
            current = cost()
            reported = InstanceLoad(**{k: float(v) for k, v in load().reported().items()})
            try:
                async with session.post(hb_url, data=dumps(Heartbeat(msg.instance_id, reported, current)),
                                        headers=headers) as resp:
                    if resp.status == 404:
                        log.warning("conductor forgot this instance; registering again")
                        await register(session, conductor, replace(msg, cost=current) if current is not None else msg)
                    elif resp.status == 409:
                        raise RegistrationRefused(f"conductor refused heartbeat: {(await resp.text())[:300]}")
                    elif resp.status >= 400:   # e.g. a field this conductor does not know: say so, keep beating
                        log.warning("conductor answered a heartbeat with %d: %s", resp.status, (await resp.text())[:300])
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:   # a timeout must not end the loop
                log.warning("heartbeat to %s failed: %r", conductor.url, exc)
