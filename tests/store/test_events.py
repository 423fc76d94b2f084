"""The block-event publisher against an in-process fake conductor: full syncs on start, on the
conductor's request and after dropped events; chunking; a failed sync is retried whole."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from mooncake_lite.common.protocol import StoreCapacity
from mooncake_lite.store import events
from mooncake_lite.store.events import BlockEventPublisher
from tests.store.helpers import chain


class Conductor:
    """Answers like the real one: ``resync`` until it has had a full sync from the store."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.synced = False
        self.fail_next = 0

    async def receive(self, request: web.Request) -> web.Response:
        msg = await request.json()
        if self.fail_next:
            self.fail_next -= 1
            return web.json_response({"error": "busy"}, status=503)
        self.messages.append(msg)
        self.synced = self.synced or msg.get("full", False)
        return web.json_response({"ok": True, "resync": not self.synced})


@pytest.fixture
async def conductor(aiohttp_server):
    fake = Conductor()
    app = web.Application()
    app.router.add_post("/internal/v1/block_events", fake.receive)
    server = await aiohttp_server(app)
    fake.url = str(server.make_url(""))
    return fake


async def test_first_post_is_a_chunked_full_sync_then_plain_events(conductor, monkeypatch):
    monkeypatch.setattr(events, "SYNC_CHUNK_KEYS", 2)
    held = set(chain(5, seed=1))
    pub = BlockEventPublisher(conductor.url, "s:1", inventory=lambda: held)
    pub.stored(b"\x01" * 16)                      # recorded before the sync: covered by it
    async with aiohttp.ClientSession() as session:
        assert await pub.flush(session)
        parts = conductor.messages
        assert [m["full"] for m in parts] == [True, False, False]
        assert {k for m in parts for k in m["stored"]} == {k.hex() for k in held}
        new = chain(1, seed=2)[0]
        pub.stored(new)
        assert await pub.flush(session)
        assert conductor.messages[-1] == {"store": "s:1", "stored": [new.hex()], "evicted": [], "full": False,
                                           "usage": {}, "capacity": None}
    assert pub.num_full_syncs == 1


async def test_a_conductor_that_forgot_the_store_gets_a_full_sync(conductor):
    held = set(chain(3, seed=3))
    pub = BlockEventPublisher(conductor.url, "s:1")   # no inventory yet: plain events only
    pub.stored(next(iter(held)))
    async with aiohttp.ClientSession() as session:
        assert await pub.flush(session)
        assert conductor.messages[0]["full"] is False
        pub.enable_full_sync(lambda: held)
        conductor.synced = False                    # as after a conductor restart
        assert await pub.flush(session) and conductor.messages[-1]["full"]
        pub.stored(chain(1, seed=4)[0])
        conductor.synced = False                    # restarted again: its answer asks for a resync
        assert await pub.flush(session) and not conductor.messages[-1]["full"]
        assert await pub.flush(session) and conductor.messages[-1]["full"]
    assert pub.num_full_syncs == 2


async def test_a_failed_sync_is_retried_whole_and_dropped_events_trigger_one(conductor, monkeypatch):
    monkeypatch.setattr(events, "SYNC_CHUNK_KEYS", 2)
    held = set(chain(4, seed=5))
    pub = BlockEventPublisher(conductor.url, "s:1", inventory=lambda: held, max_pending=2)
    async with aiohttp.ClientSession() as session:
        conductor.fail_next = 1
        assert not await pub.flush(session)
        assert await pub.flush(session)
        assert [m["full"] for m in conductor.messages] == [True, False]
        for key in chain(3, seed=6):               # one more than max_pending: an event is lost
            pub.stored(key)
        assert pub.num_dropped == 1
        assert await pub.flush(session)
        assert conductor.messages[-2]["full"]      # so the next post is a full sync instead
    assert pub.num_full_syncs == 2


async def test_an_idle_store_still_hears_that_the_conductor_restarted(conductor):
    pub = BlockEventPublisher(conductor.url, "s:1", inventory=lambda: set(chain(2, seed=7)), keepalive=0.0)
    async with aiohttp.ClientSession() as session:
        assert await pub.flush(session) and conductor.messages[-1]["full"]
        conductor.synced = False                    # restarted; the store has nothing new to say
        assert await pub.flush(session)
        assert conductor.messages[-1] == {"store": "s:1", "stored": [], "evicted": [], "full": False,
                                           "usage": {}, "capacity": None}
        assert await pub.flush(session) and conductor.messages[-1]["full"]


async def test_every_post_carries_the_store_capacity(conductor):
    """For the simulator's store (the conductor's cost export): sync, events and keepalives alike,
    so a restarted conductor learns it from whatever comes next."""
    pub = BlockEventPublisher(conductor.url, "s:1", inventory=lambda: set(), keepalive=0.0,
                              capacity=StoreCapacity(2465, 0, "lru"))
    async with aiohttp.ClientSession() as session:
        assert await pub.flush(session)              # the full sync
        pub.stored(chain(1, seed=9)[0])
        assert await pub.flush(session)              # an event
        assert await pub.flush(session)              # a keepalive
    assert [m["full"] for m in conductor.messages] == [True, False, False]
    assert [m["capacity"] for m in conductor.messages] == [{"dram_slots": 2465, "ssd_blocks": 0, "eviction": "lru"}] * 3
