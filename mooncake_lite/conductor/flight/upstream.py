"""How a call from the conductor to an instance fails, and telling an instance to drop a request.

Split from ``dispatch.py``, which runs one request: these pieces only classify and report what
went wrong upstream (a refused connection marks the instance suspect; a slow answer does not).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import AbortRequest, dumps

if TYPE_CHECKING:   # dispatch imports this module; the type only
    from mooncake_lite.conductor.flight.flight import Services
    from mooncake_lite.conductor.membership import Instance

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 5.0
SHUTDOWN = "shutdown"   # Failure.reason of a request the conductor's drain ended (a 503, not a 502)


@dataclass(frozen=True)
class Failure:
    """Why an attempt failed upstream. ``instance_id``: the instance to leave out of a retry;
    ``reason``: the retries_total label; ``retry``: whether it may be retried elsewhere (a
    timeout is not: the request has waited long enough)."""

    message: str
    instance_id: str
    reason: str
    retry: bool = True


async def post_abort(svc: Services, inst: Instance, request_id: str) -> None:
    """Tell an instance to drop a request and free its KV; failures are only logged."""
    try:
        async with svc.session.post(f"http://{inst.reg.http}/v1/abort", data=dumps(AbortRequest(request_id)),
                                    headers={"Content-Type": "application/json",
                                             **cluster_headers(svc.cluster_token)},
                                    timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)) as resp:
            await resp.read()
            if resp.status >= 400 and resp.status != 404:
                log.warning("abort %s on %s answered %d", request_id, inst.instance_id, resp.status)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        log.warning("abort %s on %s failed: %r", request_id, inst.instance_id, exc)


def is_connection_failure(exc: BaseException) -> bool:
    """A refused, reset or broken connection (the instance is likely gone), not a slow answer:
    a connect timeout counts, a read timeout does not."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return True
    if isinstance(exc, asyncio.TimeoutError):
        return False
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError))
