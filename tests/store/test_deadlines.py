"""Issue #16 item 5: a store's keepalive follows the conductor's ``--dead-after`` (a short one
must not drop a live idle store and re-sync it over and over), and every store op ends within
the client's deadline with an error naming the store and the op."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from mooncake_lite.conductor.api.state import API
from mooncake_lite.conductor.app import make_app
from mooncake_lite.conductor.config import Config
from mooncake_lite.prefill.remote_store import RemoteStore
from mooncake_lite.store.client import NoAnswer, RemoteError, StoreClient
from mooncake_lite.store.events import BlockEventPublisher
from tests.store.helpers import block, chain
from tests.transfer.test_deadlines import MutePeer

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


async def test_a_store_that_does_not_answer_is_named_with_the_op():
    async with MutePeer(hello=False) as peer:
        with pytest.raises(NoAnswer, match=rf"^store {peer.address} hello: no answer in 0.3 s$"):
            await StoreClient.connect(peer.address, timeout=0.3, shm=False)
    async with MutePeer() as peer:
        client = await StoreClient.connect(peer.address, timeout=0.3, shm=False)
        try:
            with pytest.raises(NoAnswer, match=rf"^store {peer.address} get_layers: no answer in 0.3 s$"):
                await client.get_layers(chain(2), first_layer=0, num_layers=1)
        finally:
            await client.close()


async def test_a_prefill_falls_back_when_its_store_stops_answering():
    async with MutePeer() as peer:
        store = RemoteStore(peer.address, None, num_layers=2, layer_bytes=64, timeout=0.3)
        first = await store.client()
        assert await store.match(chain(2)) == 0          # no reuse, no error: the prefill recomputes
        assert first.is_closed                           # dropped; a probe redials it meanwhile
        # the store is down until a probe reaches it (store/link.py): the next op is not even
        # asked, and fails at once, a failed prefix load the prefill recomputes
        with pytest.raises(OSError, match="is not answering"):
            await store.get_layers(chain(2), 0, 1)
        await store.close()


async def test_replicating_from_a_peer_that_does_not_answer_ends_within_the_callers_deadline(role_procs):
    dst = role_procs("store", "--port", "0", "--data-port", "0", "--dram", "4MiB", "--slot-bytes", "1MiB")
    client = await StoreClient.connect(dst.addresses["data"], timeout=1.0, shm=False)
    keys = chain(2, seed=5)
    try:
        async with MutePeer() as peer:           # the pull's HELLO is answered, its get never
            with pytest.raises(RemoteError) as err:
                await client.replicate(keys, peer.address)
        assert err.value.code == "peer_error" and peer.address in err.value.message
        assert "no answer in 0.8 s" in err.value.message     # the pull's share of our 1 s deadline
        await client.put(keys[:1], [block(keys[0], 1024)])  # the store itself still answers
    finally:
        await client.close()
