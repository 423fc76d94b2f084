"""Puts through the same-node staging area against a real store process: a CPP stage's layer
slices staged and assembled, a staged range reused only once the store copied it out."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_lite.store.client import RemoteError, StoreClient
from mooncake_lite.store.protocol import Op, keys_to_hex
from tests.store.helpers import block, chain
from tests.store.shm_helpers import SLOT, TOKEN, needs_shm, no_socket_bytes

pytestmark = needs_shm


async def test_layer_slices_are_staged_and_assembled(shm_store):
    """A CPP stage's slices go through the staging area too: the block shows only once every
    layer is in, whole and byte-exact; a slice already in is a no-op; a bad range is refused
    and the connection stays usable."""
    stage0 = await StoreClient.connect(shm_store.addresses["data"], token=TOKEN)
    stage1 = await StoreClient.connect(shm_store.addresses["data"], token=TOKEN)
    keys, layer = chain(3, seed=12), 8192
    data = [block(k, 4 * layer) for k in keys]
    try:
        no_socket_bytes(stage0)
        no_socket_bytes(stage1)
        assert await stage0.put(keys, [d[:2 * layer] for d in data], num_layers=2, first_layer=0,
                                block_layers=4) == 0
        assert await stage0.exists(keys) == [False] * 3                     # half a block: not shown
        assert await stage0.put(keys[:1], [data[0][:2 * layer]], num_layers=2, first_layer=0,
                                block_layers=4) == 0                          # covered already: a no-op
        with pytest.raises(RemoteError) as err:
            await stage1.put(keys, [d[3 * layer:] + d[3 * layer:] for d in data], num_layers=2, first_layer=3,
                             block_layers=4)
        assert err.value.code == "bad_request"                              # layers 3..4 of a 4-layer block
        assert await stage1.put(keys, [d[2 * layer:] for d in data], num_layers=2, first_layer=2,
                                block_layers=4) == 3
        assert [bytes(g) for g in await stage1.get(keys)] == data
        assert [n for _, n in await stage1.get_blocks(keys)] == [4] * 3
    finally:
        await stage0.close()
        await stage1.close()


async def test_a_staged_range_is_reused_only_after_the_store_copied_it(shm_store):
    """The store answers a staged put before copying its blocks out, so the client keeps the
    range until a later answer; with no put in flight to bring one, it asks (an empty EXISTS)
    rather than wait forever, and no block is overwritten before it was copied."""
    client = await StoreClient.connect(shm_store.addresses["data"], token=TOKEN)
    keys = chain(5, seed=13)
    data = [block(k, SLOT) for k in keys]
    sent: list[Op] = []
    request = client.frames.request

    async def recorded(op, meta=None, payload=(), sink=None):
        sent.append(op)
        return await request(op, meta, payload, sink)
    client.frames.request = recorded   # type: ignore[method-assign]

    def put_meta(ks):
        return {"keys": keys_to_hex(ks), "sizes": [SLOT] * len(ks), "num_layers": 1, "first_pos": 0}
    try:
        assert client.shm.staging.size == 4 * SLOT
        reply = await client.shm.put(put_meta(keys[:3]), [memoryview(d) for d in data[:3]], 10)
        assert reply.meta == {"num_new": 3, "copying": True}
        assert client.shm._copying == [(0, 3 * SLOT)]        # not reused yet: maybe still being copied
        # Two more blocks do not fit beside the held range: the client asks, then reuses it.
        reply = await asyncio.wait_for(client.shm.put(put_meta(keys[3:]), [memoryview(d) for d in data[3:]], 10), 10)
        assert reply.meta["num_new"] == 2 and sent.count(Op.EXISTS) == 1
        assert [bytes(g) for g in await client.get(keys)] == data
    finally:
        await client.close()
