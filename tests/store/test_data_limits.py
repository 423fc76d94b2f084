"""The store's data port keeps memory per peer bounded and times out peers that stall (issue #15):
nothing is allocated for a frame beyond what its op may carry (a put: its keys' slots), a
pre-handshake peer may announce only a tiny meta, and unauthenticated or stalled connections are
closed on a deadline, while a well-behaved client keeps being served."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_lite.store.client import StoreClient
from mooncake_lite.store.protocol import Op
from mooncake_lite.transfer.framing import HEADER, MAGIC, VERSION
from tests.store.helpers import block, chain
from tests.transfer.peers import closed_within, frame

pytestmark = pytest.mark.timeout(90)

BASE = ("--port", "0", "--data-port", "0", "--dram", "8MiB", "--slot-bytes", "1MiB", "--cluster-token", "tok")


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


HELLO = frame(0, 1, {"token": "tok"})


async def good_round_trip(client: StoreClient, seed: int) -> None:
    keys = chain(3, seed=seed)
    data = [block(k, 300_000) for k in keys]
    await client.put(keys, data, num_layers=2)
    assert [bytes(b) for b in await client.get(keys)] == data


async def test_announced_gigabytes_and_pre_hello_metas_cost_the_store_nothing(role_procs):
    store = role_procs("store", *BASE)
    host, port = store.addresses["data"].rsplit(":", 1)
    good = await StoreClient.connect(store.addresses["data"], token="tok")
    await good_round_trip(good, 1)
    base = rss_of(store.pid)
    peers = []
    try:
        # 100 peers that announce a 4 MiB meta before HELLO.
        for _ in range(100):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(HEADER.pack(MAGIC, VERSION, 0, 0, 1, 4 << 20, 0) + b'{"token": "')
            peers.append((reader, writer))
        # After HELLO: puts announcing 8 GiB and 2 GiB for one 1 MiB slot.
        key = chain(1, seed=9)[0].hex()
        meta = b'{"keys":"%s","sizes":[%d]}'
        for size in (8 << 30, 2 << 30):
            body = meta % (key.encode(), size)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(HELLO + HEADER.pack(MAGIC, VERSION, Op.PUT, 0, 2, len(body), size) + body + b"\0" * 100_000)
            peers.append((reader, writer))
        await good_round_trip(good, 2)          # served meanwhile
        await asyncio.sleep(0.3)
        grown = rss_of(store.pid) - base
        closed = await asyncio.gather(*(closed_within(r, 3) for r, _ in peers))
        assert grown < 50 << 20, f"store RSS grew by {grown >> 20} MiB"
        assert all(closed), f"{closed.count(False)} connections still open"
        await good_round_trip(good, 3)
    finally:
        for _, writer in peers:
            writer.close()
        await good.close()
    logs = store.logs()
    assert "before the handshake" in logs
    assert "exceeds the limit" in logs           # 8 GiB: over --max-frame, refused at the header
    assert "can carry" in logs                   # 2 GiB: over what one key's slot can hold


async def test_unauthenticated_and_stalled_connections_are_closed_on_time(role_procs):
    store = role_procs("store", *BASE, "--data-handshake-timeout", "500ms", "--data-stall-timeout", "500ms")
    host, port = store.addresses["data"].rsplit(":", 1)
    good = await StoreClient.connect(store.addresses["data"], token="tok")
    peers = []
    try:
        for _ in range(100):
            peers.append(await asyncio.open_connection(host, int(port)))
        key = chain(1, seed=10)[0].hex()
        body = b'{"keys":"%s","sizes":[500000]}' % key.encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(HELLO + HEADER.pack(MAGIC, VERSION, Op.PUT, 0, 2, len(body), 500_000) + body + b"\0" * 1000)
        peers.append((reader, writer))
        closed = await asyncio.gather(*(closed_within(r, 4) for r, _ in peers))
        assert all(closed), f"{closed.count(False)} connections still open"
        await asyncio.sleep(0.6)               # an idle authenticated client is not a stalled one
        await good_round_trip(good, 4)
        # The stalled put's slot came back.
        assert await good.exists([bytes.fromhex(key)]) == [False]
    finally:
        for _, writer in peers:
            writer.close()
        await good.close()
    logs = store.logs()
    assert "no handshake within 0.5s" in logs and "stalled" in logs
