"""``common/service.serve_app``'s stop signals, in process (the signals go to this process, whose
loop ``serve_app`` gives handlers): the first SIGTERM/SIGINT starts the app's drain, a second one
tells it to hurry, and the handlers go once the app has stopped."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from aiohttp import web

from mooncake_lite.common import service

pytestmark = pytest.mark.timeout(30)
LONG_BOUND_S = 60.0   # a drain bound no test waits out


async def _serve_with_drain(calls: list) -> tuple[asyncio.Task, asyncio.Event]:
    """serve_app on a free port with a DRAIN hook that records its bound and waits for ``hurry``."""
    drained = asyncio.Event()

    async def hook(bound: float, hurry: asyncio.Event) -> None:
        calls.append(bound)
        drained.set()
        await hurry.wait()
        calls.append("hurried")

    app = web.Application()
    app[service.DRAIN] = hook
    ready = asyncio.Event()
    task = asyncio.create_task(service.serve_app(app, "127.0.0.1", 0, role="test", shutdown_timeout=LONG_BOUND_S,
                                                 on_ready=lambda _: ready.set(), notify_ready=False))
    await asyncio.wait_for(ready.wait(), 10)
    return task, drained


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)])
async def test_a_second_stop_signal_cuts_the_drain_short(first, second):
    calls: list = []
    task, drained = await _serve_with_drain(calls)
    os.kill(os.getpid(), first)
    await asyncio.wait_for(drained.wait(), 10)
    assert calls == [LONG_BOUND_S] and not task.done()     # draining, for up to its bound
    os.kill(os.getpid(), second)
    await asyncio.wait_for(task, 10)                       # not the 60 s bound
    assert calls == [LONG_BOUND_S, "hurried"]
    # stopped: the loop no longer catches them (SIGINT is Python's KeyboardInterrupt again)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


async def test_a_drain_without_a_second_signal_is_not_hurried():
    seen: list[bool] = []

    async def hook(bound: float, hurry: asyncio.Event) -> None:
        seen.append(hurry.is_set())

    app = web.Application()
    app[service.DRAIN] = hook
    await service.drain(app, 1.0)
    assert seen == [False]
