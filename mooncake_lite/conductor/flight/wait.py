"""Waiting for an instance that can take a request whose decode failed, before its first token (a
retry) or after (a continuation): one rule for both.

The failed registration is left out (``continuation.still_registered``), so with one decode no
instance can take the request for a while (a 503). That decode may be restarting under its
supervisor (``mooncake up`` has it back at the same address in a few seconds, a new registration
the request may use), or the only other one's heartbeat late (counted dead until its next): the
request is placed again every ``POLL_S`` for ``--dead-after``, at least ``WAIT_S``, before the
client is told (docs/results/2026-11-29-one-decode-restart.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from mooncake_lite.conductor.api.errors import ApiError
from mooncake_lite.conductor.flight.attempt import loop_now
from mooncake_lite.conductor.flight.events import Failed

WAIT_S = 5.0
POLL_S = 0.5


def wait_limit(dead_after_s: float) -> float:
    """How long a request whose decode failed waits for one: ``--dead-after``, at least ``WAIT_S``
    (a restart takes seconds; a late heartbeat, up to ``--dead-after``)."""
    return max(WAIT_S, dead_after_s)


async def placed_within(start: Callable[[], Awaitable[Failed | None]], wait_s: float) -> Failed | None:
    """``start()`` (place the request and start an attempt), again every ``POLL_S`` while no
    instance can take it (503), for up to ``wait_s``; then that 503. Any other ApiError at once."""
    give_up = loop_now() + wait_s
    while True:
        try:
            return await start()
        except ApiError as exc:
            if exc.status != 503 or loop_now() >= give_up:
                raise
        await asyncio.sleep(POLL_S)
