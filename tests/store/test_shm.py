"""The same-node fast path against a real store process: chosen on the same host, TCP otherwise,
bytes equal either way, reads only under leases and never torn, token still required, staging
bounds enforced, the slab read-only for clients."""

from __future__ import annotations

import asyncio
import os

import pytest

from mooncake_lite.store import shm_client
from mooncake_lite.store.client import RemoteError, StoreClient
from mooncake_lite.store.protocol import Op, keys_to_hex
from mooncake_lite.transfer import shm
from mooncake_lite.transfer.client import FrameClient
from mooncake_lite.transfer.framing import HEADER_BYTES, Limits, decode_header, encode_frame
from tests.conftest import start_role
from tests.store.helpers import block, chain, metric

SLOT = 256 << 10
TOKEN = "s3cret"
pytestmark = pytest.mark.skipif(not shm.is_supported(), reason="no memfd_create or /proc here")


STORE_ARGS = ("--port", "0", "--data-port", "0", "--dram", "4MiB", "--slot-bytes", "256KiB",
              "--shm-staging", "1MiB", "--lease-ttl", "1s", "--cluster-token", TOKEN)


@pytest.fixture(scope="module")
def store():
    """16 slots, a 1 MiB staging area, leases that run out quickly; shared by the tests that
    neither fill nor stop it (keys differ per test)."""
    proc = start_role("store", *STORE_ARGS)
    yield proc
    proc.stop()


def no_socket_bytes(client: StoreClient) -> None:
    """Make any block bytes on the socket fail the test."""
    async def refuse(*args, **kwargs):
        raise AssertionError("block bytes went over TCP")
    client._read_batch_tcp = refuse   # type: ignore[method-assign]
    request = client.frames.request

    async def checked(op, meta=None, payload=(), sink=None):
        assert not payload, "a put sent its blocks on the socket"
        return await request(op, meta, payload, sink)
    client.frames.request = checked   # type: ignore[method-assign]


async def leases_all_ended(store) -> None:
    """Wait (2 s at most) for the store to end every lease, then check it did."""
    for _ in range(100):
        if metric("http://" + store.addresses["http"], "mooncake_store_leases") == 0:
            break
        await asyncio.sleep(0.02)
    assert metric("http://" + store.addresses["http"], "mooncake_store_leases") == 0

async def test_shm_selected_bytes_equal_and_tcp_agrees(store):
    address = store.addresses["data"]
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
        await leases_all_ended(store)
    finally:
        await fast.close()
        await slow.close()


async def test_a_get_hands_its_read_lease_back_with_the_next_request(store):
    """No frame of its own on a get's path: the read lease's end rides on the next request
    (``reads_done``), or goes alone (READ_DONE) once the loop comes round with none; the store
    ends them all."""
    client = await StoreClient.connect(store.addresses["data"], token=TOKEN)
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
        await leases_all_ended(store)
    finally:
        await client.close()


async def test_single_gets_take_the_fast_channel(store):
    """A one-key get goes on the single-get channel (no framed GET), into ``out`` when given;
    a key not in DRAM asks the framed way; the channel admits only the secret handed over the
    authenticated connection; every read lease ends."""
    import socket

    from mooncake_lite.store.fastget import GET, REPLY, REQUEST
    client = await StoreClient.connect(store.addresses["data"], token=TOKEN)
    sent: list[int] = []
    send = client.frames.conn.send

    def recorded(op, request_id, meta=None, payload=(), flags=0):
        sent.append(op)
        return send(op, request_id, meta, payload, flags)
    try:
        assert client.shm.fast is not None
        keys = chain(3, seed=31)
        await client.put(keys, [block(k, 7000) for k in keys])
        client.frames.conn.send = recorded   # type: ignore[method-assign]
        for key in keys:
            assert bytes((await client.get([key]))[0]) == block(key, 7000)
        out = bytearray(8192)
        got = await client.get([keys[1]], out=[out])
        assert got[0].obj is out and bytes(out[:7000]) == block(keys[1], 7000)
        assert Op.GET not in sent
        assert await client.get(chain(1, seed=32)) == [None] and sent.count(Op.GET) == 1
        # A one-block put goes on the channel too (staged; no framed PUT), and is in the store.
        single = chain(1, seed=33)
        assert await client.put(single, [block(single[0], 9000)]) == 1
        assert await client.put(single, [block(single[0], 9000)]) == 0
        assert Op.PUT not in sent and await client.exists(single) == [True]
        assert [bytes(g) for g in await client.get(single + keys[:1])] == [block(single[0], 9000), block(keys[0], 7000)]
        # A big one (a whole slot here) is answered before the store copies it: its staged range
        # stays taken until the next reply on the channel, the next put's.
        big = chain(2, seed=34)
        assert await client.put(big[:1], [block(big[0], SLOT)]) == 1 and len(client.shm._fast_copying) == 1
        assert await client.put(big[1:], [block(big[1], 5000)]) == 1 and not client.shm._fast_copying
        assert Op.PUT not in sent
        assert [bytes(g) for g in await client.get(big)] == [block(big[0], SLOT), block(big[1], 5000)]
        # The channel: our secret admits a raw socket, any other is closed at once.
        grant = (await client.frames.request(Op.FAST_ATTACH, {})).meta
        for secret, answered in ((bytes.fromhex(grant["secret"]), True), (b"\x00" * 16, False)):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.settimeout(5)
                raw.connect("\0" + grant["socket"])
                raw.sendall(secret + REQUEST.pack(GET, 7, 0, keys[0]) + REQUEST.pack(GET, 0, 0, bytes(16)))
                reply = raw.recv(REPLY.size)
                assert (len(reply) == REPLY.size and REPLY.unpack(reply)[0] == 7 and REPLY.unpack(reply)[3] == 7000) \
                    if answered else reply == b""
        # The raw socket's lease ended with nothing (it never handed it back): it ends with the
        # data connection, closed below; every lease of the client's own gets is back already.
    finally:
        await client.close()
    await leases_all_ended(store)


async def test_a_given_up_single_put_frees_its_staged_range(store, monkeypatch):
    """A one-block put left unanswered for GIVE_UP_S (the store stopped) gives the channel up
    and goes framed. The store may still read that request later, so its staged range is let
    go only once the store has retired the channel (FAST_ATTACH ``retire``); before, it stayed
    taken until the connection closed. Reusing it afterwards corrupts nothing."""
    import signal

    from mooncake_lite.store import fastget_client
    monkeypatch.setattr(fastget_client, "GIVE_UP_S", 0.05)
    client = await StoreClient.connect(store.addresses["data"], token=TOKEN)
    pid = store.proc.pid
    keys = chain(3, seed=35)
    try:
        shm_path, staging = client.shm, client.shm.staging
        assert shm_path.fast is not None
        os.kill(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(0.3, os.kill, pid, signal.SIGCONT)
        assert await asyncio.wait_for(client.put(keys[:1], [block(keys[0], 5000)]), 10) in (0, 1)
        assert shm_path.fast.is_closed and not shm_path.fast._late
        held = staging.size - sum(n for _, n in staging._free)
        # Nothing held but what a later answer frees (the framed put's range, answered COPYING).
        assert held == sum(n for _, n in shm_path._copying + shm_path._fast_copying)
        for key in keys[1:]:   # framed now, through the same staging ranges
            assert await client.put([key], [block(key, 5000)]) == 1
        assert [bytes(g) for g in await client.get(keys)] == [block(k, 5000) for k in keys]
    finally:
        os.kill(pid, signal.SIGCONT)
        await client.close()


async def test_tcp_fallback_when_shm_is_refused(store, role_procs, monkeypatch):
    address = store.addresses["data"]
    off = role_procs("store", "--port", "0", "--data-port", "0", "--dram", "1MiB", "--slot-bytes", "256KiB",
                     "--shm", "off")
    keys, data = chain(2, seed=6), [b"x" * 5000, b"y" * 7]
    client = await StoreClient.connect(off.addresses["data"])
    assert "shm" not in client.frames.hello and client.transport == "tcp"
    assert await client.put(keys, data) == 2 and [bytes(g) for g in await client.get(keys)] == data
    await client.close()

    async def offer_with(**changes):
        frames = await FrameClient.connect(*address.rsplit(":", 1), token=TOKEN)
        frames.hello["shm"] = {**frames.hello["shm"], **changes}
        try:
            return await shm_client.attach(frames)
        finally:
            await frames.close()
    assert (await offer_with()).fast is not None   # the untouched offer is usable here
    for other_layout in (True, 3):   # a store whose single-block channel speaks another layout
        assert (await offer_with(fast=other_layout)).fast is None
    assert await offer_with(nonce="00" * 16) is None   # not the memory the store announced
    assert await offer_with(fd=10_000) is None          # cannot be opened
    assert await offer_with(pid=(1 << 22) + 1) is None  # no such process
    assert await offer_with(host="another-node") is None
    monkeypatch.setattr(shm, "host_identity", lambda: "other/boot/netns")   # another node
    client = await StoreClient.connect(address, token=TOKEN)
    assert client.transport == "tcp"
    assert await client.put(keys, data) == 2 and [bytes(g) for g in await client.get(keys)] == data
    await client.close()


async def test_auth_still_required(store):
    address = store.addresses["data"]
    with pytest.raises(RemoteError) as err:
        await StoreClient.connect(address, token="wrong")
    assert err.value.code == "unauthorized"
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"".join(bytes(p) for p in encode_frame(Op.SHM_ATTACH, 1, {})))
    header = decode_header(await reader.readexactly(HEADER_BYTES), Limits())
    meta = await reader.readexactly(header.meta_len)
    assert header.is_error and b"handshake_required" in meta and b"fd" not in meta
    writer.close()
    with pytest.raises(RemoteError) as err:
        await FrameClient.connect(host, int(port), token=None)
    assert err.value.code == "unauthorized"


async def test_staging_bounds_and_read_only_slab(store):
    client = await StoreClient.connect(store.addresses["data"], token=TOKEN)
    area = client.shm.staging.size
    keys = chain(2, seed=7)

    async def staged(offsets, sizes=(100, 100), payload=(), op=Op.PUT):
        meta = {"keys": keys_to_hex(keys[:len(sizes)]), "sizes": list(sizes), "staged": offsets}
        return await client.frames.request(op, meta, payload)
    hostile = [[area - 50, 0], [-1, 0], [0, area], [2 ** 62, 0], ["0", 0], [True, 0], [0], [0, 0, 0], None, 7]
    try:
        for offsets in hostile:
            with pytest.raises(RemoteError) as err:
                await staged(offsets)
            assert err.value.code == "bad_request", offsets
        with pytest.raises(RemoteError, match="no payload"):
            await staged([0, 200], payload=[b"z" * 200])
        with pytest.raises(RemoteError, match="already"):
            await client.frames.request(Op.SHM_ATTACH, {})
        assert await client.exists(keys) == [False, False]   # nothing refused was stored
        client.shm.staging.mapping.view[area - 200:area] = b"q" * 200
        assert (await staged([area - 200, area - 100])).meta["num_new"] == 2   # the last byte is fine
        assert [bytes(g) for g in await client.get(keys)] == [b"q" * 100] * 2
        # The slab cannot be mapped writable nor written, even through its descriptor.
        offer = client.frames.hello["shm"]
        with pytest.raises(shm.ShmError):
            shm.open_offer(offer, writable=True)
        fd = os.open(f"/proc/{offer['pid']}/fd/{offer['fd']}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"!", offer["slab_offset"])
        finally:
            os.close(fd)
        # A client without a staging area (TCP) cannot send a staged put either.
        tcp = await StoreClient.connect(store.addresses["data"], token=TOKEN, shm=False)
        with pytest.raises(RemoteError, match="staging area"):
            await tcp.frames.request(Op.PUT, {"keys": keys_to_hex(keys[:1]), "sizes": [1], "staged": [0]})
        await tcp.close()
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


async def test_layer_slices_are_staged_and_assembled(store):
    """A CPP stage's slices go through the staging area too: the block shows only once every
    layer is in, whole and byte-exact; a slice already in is a no-op; a bad range is refused
    and the connection stays usable."""
    stage0 = await StoreClient.connect(store.addresses["data"], token=TOKEN)
    stage1 = await StoreClient.connect(store.addresses["data"], token=TOKEN)
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


async def test_a_staged_range_is_reused_only_after_the_store_copied_it(store):
    """The store answers a staged put before copying its blocks out, so the client keeps the
    range until a later answer; with no put in flight to bring one, it asks (an empty EXISTS)
    rather than wait forever, and no block is overwritten before it was copied."""
    client = await StoreClient.connect(store.addresses["data"], token=TOKEN)
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
