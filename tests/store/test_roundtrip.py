"""A real store process: byte-exact round trips, layer reads, match/exists/delete, bad requests."""

from __future__ import annotations

import orjson
import pytest

from mooncake_lite.store.client import RemoteError, StoreClient
from tests.store.helpers import block, chain, http_get, metric

SLOT = 256 << 10


@pytest.fixture
def store(role_procs):
    return role_procs("store", "--port", "0", "--data-port", "0", "--dram", "8MiB", "--slot-bytes", "256KiB")


async def test_put_get_byte_exact(store):
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(6)
    sizes = [SLOT, 4096, 1, 100_000, SLOT - 8, 12_288]
    data = [block(k, s) for k, s in zip(keys, sizes)]
    try:
        assert await client.put(keys, data, num_layers=1) == 6
        assert await client.put(keys[:2], data[:2]) == 0  # already stored: not new
        got = await client.get(keys)
        assert [bytes(g) for g in got] == data
        missing = chain(2, seed=99)
        got = await client.get([missing[0], keys[3], missing[1]])
        assert got[0] is None and got[2] is None and bytes(got[1]) == data[3]
        # Into caller buffers: the result views the caller's memory.
        outs = [bytearray(SLOT) for _ in keys]
        got = await client.get(keys, out=outs)
        assert all(g.obj is o for g, o in zip(got, outs))
        assert [bytes(o[:s]) for o, s in zip(outs, sizes)] == data
    finally:
        await client.close()


async def test_layers_match_exists_delete(store):
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(4, seed=1)
    num_layers, layer_bytes = 8, 4096
    data = [block(k, num_layers * layer_bytes) for k in keys]
    try:
        await client.put(keys, data, num_layers=num_layers)
        got = await client.get_layers(keys, first_layer=3, num_layers=2)
        assert [bytes(g) for g in got] == [d[3 * layer_bytes:5 * layer_bytes] for d in data]
        with pytest.raises(RemoteError) as err:
            await client.get_layers(keys, first_layer=7, num_layers=2)
        assert err.value.code == "bad_request" and "outside" in err.value.message
        assert await client.match(keys) == 4
        other = chain(3, seed=2)
        assert await client.match(keys[:2] + other) == 2
        assert await client.match(other) == 0
        assert await client.exists([keys[0], other[0]]) == [True, False]
        assert await client.delete([keys[1], other[1]]) == 1
        assert await client.match(keys) == 1
        assert (await client.get([keys[1]]))[0] is None
        _, body = http_get(store.url() + "/blocks")
        listed = orjson.loads(body)
        assert sorted(listed["keys"]) == sorted(k.hex() for k in (keys[0], keys[2], keys[3]))
        assert listed["store"] == store.addresses["data"]
    finally:
        await client.close()


async def test_bad_requests_keep_the_connection(store):
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(2, seed=3)
    try:
        with pytest.raises(RemoteError) as err:
            await client.put(keys[:1], [b"x" * (SLOT + 1)])
        assert err.value.code == "bad_request" and "--slot-bytes" in err.value.message
        with pytest.raises(RemoteError) as err:
            await client.put(keys[:1], [b"x" * 10], num_layers=3)
        assert "divisible" in err.value.message
        with pytest.raises(RemoteError) as err:
            await client.frames.request(2, {"keys": ["zz"]})
        assert err.value.code == "bad_request" and "hex" in err.value.message
        with pytest.raises(RemoteError) as err:
            await client.frames.request(99, {})
        assert err.value.code == "unknown_op"
        assert await client.exists(keys) == [False, False]  # nothing half-stored
        assert await client.put(keys, [b"ok", b"fine"]) == 2
        assert [bytes(b) for b in await client.get(keys)] == [b"ok", b"fine"]
    finally:
        await client.close()
    assert metric(store.url(), "mooncake_store_blocks", 'tier="dram"') == 2
    assert metric(store.url(), "mooncake_store_hits_total", 'tier="dram"') >= 2
    assert metric(store.url(), "mooncake_store_capacity_bytes", 'tier="dram"') == 8 << 20


async def test_many_blocks_batched_and_pipelined(store):
    client = await StoreClient.connect(store.addresses["data"])
    client.max_batch_keys = 5  # force several batches in flight at once
    keys = chain(30, seed=4)
    data = [block(k, 64 << 10) for k in keys]
    try:
        assert await client.put(keys, data, num_layers=2) == 30
        got = await client.get(keys)
        assert [bytes(g) for g in got] == data
    finally:
        await client.close()


async def test_forged_private_meta_is_just_a_bad_request(store):
    client = await StoreClient.connect(store.addresses["data"])
    try:
        key = chain(1, seed=5)[0].hex()
        for meta in ({"keys": [key], "sizes": [4], "_ticket": 1, "_error": "x"}, {"keys": [key], "_ticket": 3}):
            with pytest.raises(RemoteError) as err:
                await client.frames.request(1, meta)  # PUT without a payload
            assert err.value.code == "bad_request"
        assert (await client.frames.request(1, {"keys": []})).meta == {"num_new": 0}
        assert await client.exists([bytes.fromhex(key)]) == [False]
    finally:
        await client.close()


async def test_client_timeout_leaves_the_connection_usable():
    import asyncio

    from mooncake_lite.transfer.connection import FrameHandler
    from mooncake_lite.transfer.framing import FLAG_REPLY
    from mooncake_lite.transfer.server import server_address, start_server

    class SlowStore(FrameHandler):  # answers every MATCH after 0.3 s
        def frame_received(self, conn, frame):
            asyncio.get_running_loop().call_later(
                0.3, conn.send, frame.op, frame.request_id, {"num_matched": 1}, (), FLAG_REPLY)

    server = await start_server(SlowStore(), "127.0.0.1", 0)
    client = await StoreClient.connect(server_address(server), timeout=0.05)
    try:
        with pytest.raises(asyncio.TimeoutError):
            await client.match(chain(1))
        client.timeout = None
        assert await client.match(chain(1)) == 1  # the late first reply was dropped quietly
    finally:
        await client.close()
        server.close()
