"""Reads through the same-node fast path against a real store process: chosen on the same
host, bytes equal to TCP's, read leases handed back without a frame of their own, reads only
under leases and never torn, a store gone away unmapped at once."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_lite.store.client import RemoteError, StoreClient
from mooncake_lite.store.protocol import Op, keys_to_hex
from tests.store.helpers import block, chain
from tests.store.shm_helpers import SLOT, STORE_ARGS, TOKEN, leases_all_ended, needs_shm, no_socket_bytes

pytestmark = needs_shm


async def test_shm_selected_bytes_equal_and_tcp_agrees(shm_store):
    address = shm_store.addresses["data"]
    fast = await StoreClient.connect(address, token=TOKEN)
    slow = await StoreClient.connect(address, token=TOKEN, shm=False)
    try:
        assert fast.transport == "shm" and fast.shm.staging is not None and slow.transport == "tcp"
        no_socket_bytes(fast)
        keys = chain(8, seed=3)
        sizes = [SLOT, 4096, 1, 100_000, SLOT - 8, 12_288, SLOT, 65_536]
        data = [block(k, s) for k, s in zip(keys, sizes)]
        # 8 blocks > the 1 MiB staging area: several staged batches, some in flight together.
        assert await fast.put(keys, data) == 8
        assert [bytes(g) for g in await fast.get(keys)] == data
        assert [bytes(g) for g in await slow.get(keys)] == data
        outs = [bytearray(SLOT) for _ in keys]
        got = await fast.get(keys + chain(1, seed=4), out=outs + [None])
        assert got[-1] is None and all(g.obj is o for g, o in zip(got, outs))
        assert [bytes(o[:s]) for o, s in zip(outs, sizes)] == data
        layered = chain(2, seed=5)
        ldata = [block(k, 8 * 4096) for k in layered]
        await slow.put(layered, ldata, num_layers=8)   # written over TCP, read through the slab
        assert [bytes(g) for g in await fast.get_layers(layered, 3, 2)] == [d[3 * 4096:5 * 4096] for d in ldata]
        with pytest.raises(RemoteError, match="outside"):
            await fast.get_layers(layered, 7, 2)
        # The read leases of those gets were all handed back (one-way READ_DONE).
        await leases_all_ended(shm_store)
    finally:
        await fast.close()
        await slow.close()


async def test_a_get_hands_its_read_lease_back_with_the_next_request(shm_store):
    """No frame of its own on a get's path: the read lease's end rides on the next request
    (``reads_done``), or goes alone (READ_DONE) once the loop comes round with none; the store
    ends them all."""
    client = await StoreClient.connect(shm_store.addresses["data"], token=TOKEN)
    sent: list[tuple[int, dict]] = []
    send = client.frames.conn.send

    def recorded(op, request_id, meta=None, payload=(), flags=0):
        sent.append((op, dict(meta or {})))
        return send(op, request_id, meta, payload, flags)
    try:
        keys = chain(6, seed=21)
        await client.put(keys, [block(k, 5000) for k in keys])
        client.frames.conn.send = recorded   # type: ignore[method-assign]
        for pair in (keys[0:2], keys[2:4], keys[4:6]):   # back to back (two keys: framed gets)
            got = await client.get(pair)
            assert [bytes(g) for g in got] == [block(k, 5000) for k in pair]
        assert [op for op, _ in sent] == [Op.GET] * 3
        assert "reads_done" not in sent[0][1]
        first, second = sent[1][1]["reads_done"], sent[2][1]["reads_done"]
        assert len(first) == 1 and len(second) == 1 and first != second
        await asyncio.sleep(0)   # the loop comes round: the last get's lease goes alone
        assert [op for op, _ in sent[3:]] == [Op.READ_DONE]
        assert len(sent[3][1]["reads"]) == 1 and sent[3][1]["reads"] not in (first, second)
        await leases_all_ended(shm_store)
    finally:
        await client.close()


async def test_reads_only_under_leases_never_torn(role_procs):
    store = role_procs("store", *STORE_ARGS)
    client = await StoreClient.connect(store.addresses["data"], token=TOKEN)
    filler = await StoreClient.connect(store.addresses["data"], token=TOKEN)
    keys = chain(4, seed=8)
    data = [block(k, SLOT) for k in keys]
    try:
        await client.put(keys, data)
        # A raw shm GET: offsets only for the blocks found, under a read lease we do not end.
        missing = chain(1, seed=9)[0]
        reply = await client.frames.request(Op.GET, {"keys": keys_to_hex([keys[0], missing]), "shm": True})
        (offset, slot, gen), absent = reply.meta["spans"]
        assert absent is None and reply.meta["read"] is not None and not reply.payload
        # Fill the 16-slot store twice over: the leased block is not evicted, its bytes stay.
        more = chain(32, seed=10)
        for i in range(0, 32, 4):
            await filler.put(more[i:i + 4], [block(k, SLOT) for k in more[i:i + 4]])
        view = client.shm.slab.mapping.view
        assert bytes(view[offset:offset + SLOT]) == data[0] and client.shm.slab.is_current(slot, gen)
        # A MATCH lease lets gets skip the store entirely while it lasts...
        await client.put(keys[1:], data[1:])
        num, lease = await client.match_and_pin(keys[1:], lease_s=0.5)
        assert num == 3
        request = client._request

        async def no_round_trip(*args, **kwargs):
            raise AssertionError("asked the store for a block we hold a lease on")
        client._request = no_round_trip   # type: ignore[method-assign]
        assert [bytes(g) for g in await client.get(keys[1:])] == data[1:]
        assert [bytes(g) for g in await client.get_layers(keys[1:], 0, 1)] == data[1:]
        client._request = request   # type: ignore[method-assign]
        # ...and once it (and the read lease) ran out and the slots were reused, the copy is
        # seen to be stale: the get asks the store, which no longer has them, never old bytes.
        await asyncio.sleep(1.6)
        more = chain(32, seed=11)
        for i in range(0, 32, 4):
            await filler.put(more[i:i + 4], [block(k, SLOT) for k in more[i:i + 4]])
        assert not client.shm.slab.is_current(slot, gen)
        got = await client.get(keys[1:])
        assert all(g is None or bytes(g) == d for g, d in zip(got, data[1:]))
        assert any(g is None for g in got)
        # A store that goes away: its slab is unmapped at once, and gets fail cleanly.
        store.stop()
        await asyncio.wait_for(client.frames.conn.closed, 10)
        assert client.shm.is_closed
        with pytest.raises(ConnectionError):
            await client.get(keys[:1])
    finally:
        await client.close()
        await filler.close()
