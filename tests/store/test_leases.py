"""Leases: a block being sent is never evicted, and a dead reader cannot pin it forever."""

from __future__ import annotations

import asyncio
import socket

import pytest

from mooncake_lite.store.client import RemoteError, StoreClient
from mooncake_lite.store.protocol import Op
from mooncake_lite.transfer.framing import HEADER_BYTES, decode_header, encode_frame, Limits
from tests.store.helpers import block, chain, metric, wait_log

SLOT = 4 << 20
COPIES = 16  # the slow GET asks for the same block this many times: far more than socket buffers hold


async def slow_reader(address: str, key: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Handshake, send one big GET, and then read nothing."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    writer.write(b"".join(bytes(p) for p in encode_frame(0, 1, {"token": None})))
    header = decode_header(await reader.readexactly(HEADER_BYTES), Limits())
    await reader.readexactly(header.meta_len)
    writer.write(b"".join(bytes(p) for p in encode_frame(Op.GET, 2, {"keys": [key.hex()] * COPIES})))
    await writer.drain()
    return reader, writer


async def wait_metric(url: str, name: str, value: float, timeout: float = 15.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if metric(url, name) == value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never became {value} (now {metric(url, name)})")


async def test_lease_protects_block_being_sent(role_procs):
    store = role_procs("store", "--port", "0", "--data-port", "0", "--dram", str(2 * SLOT), "--slot-bytes", "4MiB")
    client = await StoreClient.connect(store.addresses["data"])
    a, b, c, d, e, f = chain(6, seed=20)
    data_a = block(a, SLOT)
    await client.put([a], [data_a])
    await client.put([b], [block(b, 1000)])
    reader, writer = await slow_reader(store.addresses["data"], a)
    try:
        await wait_metric(store.url(), "mooncake_store_leases", 1)
        await client.get([b])  # now a is the least recently used block: LRU would evict it next
        await client.put([c], [block(c, 1000)])
        assert await client.exists([a, b, c]) == [True, False, True]
        await client.put([d], [block(d, 1000)])
        assert await client.exists([a, c, d]) == [True, False, True]
        with pytest.raises(RemoteError) as err:  # two slots needed, one can be freed
            await client.put([e, f], [b"e", b"f"])
        assert err.value.code == "full"
        assert await client.exists([a, d, e, f]) == [True, True, False, False]  # a failed put changes nothing

        # The slow reader finally reads: every copy is intact, so the slot was never reused.
        header = decode_header(await reader.readexactly(HEADER_BYTES), Limits())
        await reader.readexactly(header.meta_len)
        assert header.payload_len == COPIES * SLOT
        for _ in range(COPIES):
            assert await reader.readexactly(SLOT) == data_a
        await wait_metric(store.url(), "mooncake_store_leases", 0)
        await client.put([e], [b"e"])  # a is least recently used and no longer pinned
        assert await client.exists([a, d, e]) == [False, True, True]
    finally:
        writer.close()
        await client.close()
    assert metric(store.url(), "mooncake_store_full_errors_total") == 1


async def test_lease_expires_and_closes_the_dead_reader(role_procs):
    store = role_procs("store", "--port", "0", "--data-port", "0", "--dram", str(SLOT), "--slot-bytes", "4MiB",
                       "--lease-ttl", "500ms")
    client = await StoreClient.connect(store.addresses["data"])
    a, b = chain(2, seed=21)
    await client.put([a], [block(a, SLOT)])
    reader, writer = await slow_reader(store.addresses["data"], a)
    try:
        await wait_metric(store.url(), "mooncake_store_leases_expired_total", 1)
        await wait_log(store, "lease expired")
        await client.put([b], [b"b"])  # the only slot is free to evict again
        assert await client.exists([a, b]) == [False, True]
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            while True:  # the dead reader's connection was closed by the store
                await asyncio.wait_for(reader.readexactly(1 << 20), 10)
    finally:
        writer.close()
        await client.close()


async def test_match_and_pin_keeps_a_prefix_until_released(role_procs, tmp_path):
    store = role_procs("store", "--port", "0", "--data-port", "0", "--dram", "3MiB", "--slot-bytes", "1MiB",
                       "--ssd-dir", str(tmp_path))
    client = await StoreClient.connect(store.addresses["data"])
    a0, a1, b, c, d, e = chain(6, seed=22)
    try:
        await client.put([a0, a1], [b"a0", b"a1"])
        await client.put([b], [b"b"])
        await client.put([e], [b"e"])  # a0 goes to the SSD
        num, lease_id = await client.match_and_pin([a0, a1, c], lease_s=30)
        assert num == 2  # a0 promoted from SSD, a1 in DRAM, c unknown
        for key in (c, d):  # DRAM pressure: only the unpinned slot is reused
            await client.put([key], [b"x"])
        assert await client.exists([a0, a1]) == [True, True]
        got = await client.get_layers([a0, a1], first_layer=0, num_layers=1)
        assert [bytes(g) for g in got] == [b"a0", b"a1"]
        with pytest.raises(RemoteError) as err:
            await client.put([b, e], [b"b", b"e"])  # two slots needed, one can be freed
        assert err.value.code == "full"
        assert await client.release(lease_id) is True
        assert await client.release(lease_id) is False
        await client.put([b, e], [b"b", b"e"])
        # Pinning through a second connection is undone when that connection closes.
        other = await StoreClient.connect(store.addresses["data"])
        await other.match_and_pin([b], lease_s=30)
        await wait_metric(store.url(), "mooncake_store_leases", 1)
        await other.close()
        await wait_metric(store.url(), "mooncake_store_leases", 0)
        with pytest.raises(RemoteError) as err:
            await client.frames.request(Op.MATCH, {"keys": [b.hex()], "lease_s": -1})
        assert err.value.code == "bad_request"
    finally:
        await client.close()
    assert metric(store.url(), "mooncake_store_hits_total", 'tier="ssd"') >= 1
