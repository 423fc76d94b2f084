"""Issue #16 item 5: a store's keepalive follows the conductor's ``--dead-after`` (a short one
must not drop a live idle store and re-sync it over and over), and every store op ends within
the client's deadline with an error naming the store and the op."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from mooncake_lite.conductor.api import API
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.config import Config
from mooncake_lite.store.events import BlockEventPublisher
from tests.store.helpers import chain

pytestmark = pytest.mark.timeout(60)


async def test_an_idle_store_keeps_alive_within_a_short_dead_after(aiohttp_server):
    dead_after = 0.9                       # far below the publisher's own 5 s keepalive
    app = make_app(Config(model="tiny", block_size=4, dead_after=dead_after, admission="none"))
    server = await aiohttp_server(app)
    index = app[API].svc.scheduler.index
    keys = chain(3, seed=11)
    pub = BlockEventPublisher(f"http://127.0.0.1:{server.port}", "s:1", inventory=lambda: set(keys),
                              interval=0.05)
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(pub.run(session))
        try:
            await asyncio.sleep(3 * dead_after)   # idle: nothing stored or evicted meanwhile
        finally:
            task.cancel()
    assert pub.keepalive == pytest.approx(dead_after / 3)
    assert index.num_blocks("s:1") == 3          # never dropped as silent ...
    assert pub.num_full_syncs == 1               # ... so never asked to sync again


async def test_the_keepalive_never_grows_past_its_own_setting(aiohttp_server):
    app = make_app(Config(model="tiny", block_size=4, dead_after=60.0, admission="none"))
    server = await aiohttp_server(app)
    pub = BlockEventPublisher(f"http://127.0.0.1:{server.port}", "s:1", inventory=lambda: set(), keepalive=2.0)
    async with aiohttp.ClientSession() as session:
        assert await pub.flush(session)
    assert pub.keepalive == 2.0
