"""How a call from the conductor to an instance fails, and telling an instance to drop a request:
these pieces only classify and report what went wrong upstream (a refused connection marks the
instance suspect; a slow answer does not)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import AbortRequest, dumps
from mooncake_lite.conductor.cluster.membership import Instance
from mooncake_lite.conductor.services import Services

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 5.0


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


def how(exc: BaseException) -> str:
    """A failed call's exception in a few plain words, for the client (the log keeps the exception)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "no connection in time"
    if isinstance(exc, asyncio.TimeoutError):     # aiohttp's read timeouts are TimeoutErrors too
        return "no answer in time"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connection refused" if isinstance(exc.os_error, ConnectionRefusedError) else "no connection"
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)):
        return "connection lost"
    return "malformed HTTP answer"
