"""The store as a service: bad clients, cluster token, transport selection, block events,
replication between two stores, and startup errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest
from aiohttp import web

from mooncake_lite.common.ports import free_port
from mooncake_lite.store.client import RemoteError, StoreClient
from mooncake_lite.store.protocol import Op
from mooncake_lite.transfer.framing import HEADER, MAGIC, VERSION, encode_frame
from mooncake_lite.transfer.rdma import TransportError, select_transport
from tests.conftest import REPO
from tests.store.helpers import block, chain, http_get, wait_log

BASE = ("--port", "0", "--data-port", "0", "--dram", "4MiB", "--slot-bytes", "1MiB")


def frame_bytes(op: int, request_id: int, meta: dict | None, payload: list[bytes] = ()) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(op, request_id, meta, payload))


async def send_raw(address: str, data: bytes, *, wait_close: bool = True) -> bytes:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 10) if wait_close else b""
    writer.close()
    return got


async def test_bad_clients_do_not_affect_a_good_one(role_procs):
    store = role_procs("store", *BASE, "--max-frame", "2MiB")
    addr = store.addresses["data"]
    good = await StoreClient.connect(addr)
    keys = chain(3, seed=30)
    try:
        await good.put(keys[:1], [block(keys[0], 5000)])
        await send_raw(addr, b"\x00\xff garbage that is not a frame at all" * 10)
        hello = frame_bytes(0, 1, {"token": None})
        await send_raw(addr, hello + HEADER.pack(MAGIC, VERSION, Op.PUT, 0, 2, 0, 1 << 40))
        # A put that stops half-way: its key must never become visible, its slots must come back.
        meta = {"keys": [keys[1].hex(), keys[2].hex()], "sizes": [600_000, 600_000], "num_layers": 1}
        partial = frame_bytes(Op.PUT, 3, meta, [block(keys[1], 600_000), block(keys[2], 600_000)])
        await send_raw(addr, hello + partial[:len(partial) - 700_000], wait_close=False)
        await asyncio.sleep(0.2)
        assert await good.exists(keys) == [True, False, False]
        assert bytes((await good.get(keys[:1]))[0]) == block(keys[0], 5000)
        assert await good.put(keys[1:], [b"1", b"2"]) == 2
    finally:
        await good.close()
    logs = store.logs()
    assert "bad magic" in logs and "exceeds the limit" in logs and "closed mid-frame" in logs
    _, body = http_get(store.url() + "/health")
    health = orjson.loads(body)
    assert health["dram_free_slots"] == health["dram_slots"] - 3


async def test_cluster_token(role_procs):
    store = role_procs("store", *BASE, "--cluster-token", "t0ken")
    with pytest.raises(RemoteError) as err:
        await StoreClient.connect(store.addresses["data"])
    assert err.value.code == "unauthorized"
    with pytest.raises(RemoteError):
        await StoreClient.connect(store.addresses["data"], token="wrong")
    client = await StoreClient.connect(store.addresses["data"], token="t0ken")
    assert await client.put(chain(1, seed=31), [b"x"]) == 1
    await client.close()
    assert http_get(store.url() + "/blocks")[0] == 403
    assert http_get(store.url() + "/blocks", {"X-Mooncake-Token": "t0ken"})[0] == 200
    assert http_get(store.url() + "/health")[0] == 200
    assert b"mooncake_store_blocks" in http_get(store.url() + "/metrics")[1]
    assert "wrong or missing cluster token" in store.logs()


def test_transport_selection_unit():
    assert select_transport("tcp") == "tcp"
    assert select_transport("auto", devices=[]) == "tcp"
    assert select_transport("auto", devices=["mlx5_0"]) == "tcp"  # no RDMA data path built yet
    with pytest.raises(TransportError, match="no RDMA device"):
        select_transport("rdma", devices=[])
    with pytest.raises(TransportError, match="mlx5_0"):
        select_transport("rdma", devices=["mlx5_0"])


def run_store(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake_lite", "--role", "store", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_startup_errors_are_clear():
    res = run_store("--transport", "rdma", "--port", "0", "--data-port", "0")
    assert res.returncode == 2 and "--transport rdma: no RDMA device found" in res.stderr
    res = run_store("--dram", "1MiB", "--slot-bytes", "2MiB")
    assert res.returncode == 2 and "must hold at least one slot" in res.stderr
    res = run_store("--slot-bytes", "2GiB", "--dram", "4GiB")
    assert res.returncode == 2 and "--slot-bytes must be in (0, 1GiB]" in res.stderr


async def test_auto_transport_falls_back_with_one_log_line(role_procs):
    store = role_procs("store", *BASE, "--transport", "auto")
    assert store.logs().count("using TCP") == 1


class FakeConductor:
    def __init__(self) -> None:
        self.batches: list[dict] = []

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/internal/v1/block_events", self.receive)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def receive(self, request: web.Request) -> web.Response:
        self.batches.append(await request.json())
        return web.json_response({"ok": True})

    def events(self, kind: str) -> set[str]:
        return {k for b in self.batches for k in b[kind]}

    async def wait_for(self, kind: str, keys: list[bytes]) -> None:
        for _ in range(300):
            if {k.hex() for k in keys} <= self.events(kind):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{kind} events for {len(keys)} keys never arrived: {self.batches}")


async def test_block_events_reach_the_conductor(role_procs):
    conductor = FakeConductor()
    url = await conductor.start()
    store = role_procs("store", *BASE, "--conductor", url, "--event-interval", "50ms", "--dram", "2MiB")
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(3, seed=32)
    try:
        for _ in range(300):          # a store starts with a full sync of its (empty) inventory
            if conductor.batches:
                break
            await asyncio.sleep(0.05)
        assert conductor.batches[0]["full"] is True and conductor.batches[0]["stored"] == []
        # its capacity too, for the simulator's store: 2 MiB of 1 MiB slots, no SSD tier
        assert conductor.batches[0]["capacity"] == {"dram_slots": 2, "ssd_blocks": 0, "eviction": "lru"}
        for key, value in zip(keys, [b"a", b"b", b"c"]):  # 2 slots: the first block is evicted (no SSD)
            await client.put([key], [value])
        # Events are coalesced per key (latest wins), so the first block may only show as evicted.
        await conductor.wait_for("stored", keys[1:])
        await conductor.wait_for("evicted", keys[:1])
        await client.delete(keys[1:2])
        await conductor.wait_for("evicted", keys[:2])
        assert {b["store"] for b in conductor.batches} == {store.addresses["data"]}
    finally:
        await client.close()
        await conductor.runner.cleanup()


async def test_conductor_down_never_blocks_the_data_path(role_procs):
    port = free_port()
    store = role_procs("store", *BASE, "--conductor", f"http://127.0.0.1:{port}", "--event-interval", "50ms")
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(4, seed=33)
    conductor = FakeConductor()
    try:
        await client.put(keys[:2], [b"1", b"2"])
        assert [bytes(b) for b in await client.get(keys[:2])] == [b"1", b"2"]
        await wait_log(store, "unreachable")
        assert store.logs().count("unreachable") == 1  # one line per outage, not per retry
        await conductor.start(port)  # the conductor comes up: queued events are delivered
        await client.put(keys[2:], [b"3", b"4"])
        await conductor.wait_for("stored", keys)
        # the store logs it once the post is answered, which may be after the conductor has the events
        await wait_log(store, "reachable again")
    finally:
        await client.close()
        await conductor.runner.cleanup()


async def test_replicate_between_two_stores(role_procs):
    src = role_procs("store", *BASE, "--cluster-token", "tok")
    dst = role_procs("store", *BASE, "--cluster-token", "tok")
    a = await StoreClient.connect(src.addresses["data"], token="tok")
    b = await StoreClient.connect(dst.addresses["data"], token="tok")
    keys = chain(4, seed=34)
    data = [block(k, 8 * 1024) for k in keys]
    try:
        await a.put(keys[:3], data[:3], num_layers=8)
        result = await b.replicate(keys, src.addresses["data"])
        assert result == {"num_copied": 3, "num_present": 0, "num_missing": 1, "num_bytes": 3 * 8 * 1024}
        assert [bytes(x) for x in await b.get(keys[:3])] == data[:3]
        layer = await b.get_layers(keys[:1], first_layer=2, num_layers=1)
        assert bytes(layer[0]) == data[0][2048:3072]
        assert await b.replicate(keys[:3], src.addresses["data"]) == {"num_copied": 0, "num_present": 3,
                                                                     "num_missing": 0, "num_bytes": 0}
        with pytest.raises(RemoteError) as err:
            await b.replicate(keys, "127.0.0.1:1")
        assert err.value.code == "peer_error"
        with pytest.raises(RemoteError) as err:
            await b.replicate(keys, "no-port")
        assert err.value.code == "bad_request"
    finally:
        await a.close()
        await b.close()


async def test_sigterm_finishes_a_put_in_flight(role_procs):
    store = role_procs("store", "--port", "0", "--data-port", "0", "--dram", "96MiB", "--slot-bytes", "4MiB")
    # TCP: the point is a 64 MiB frame half-received when SIGTERM lands (a same-node put's frame
    # carries no payload; its blocks are copied before it is sent).
    client = await StoreClient.connect(store.addresses["data"], shm=False)
    keys = chain(16, seed=35)
    data = [block(k, 4 << 20) for k in keys]
    put = asyncio.ensure_future(client.put(keys, data))
    await asyncio.sleep(0)  # the frame is being written
    store.proc.terminate()
    assert await asyncio.wait_for(put, 30) == 16  # answered before the store went away
    await client.close()
    assert store.proc.wait(30) == 0
    assert "closed mid-frame" not in store.logs()


async def test_a_restarted_conductor_relearns_what_a_quiet_store_holds(role_procs):
    """No block changes after the conductor restarts: the store's keepalive gets the answer
    "resync" and its full sync refills the new conductor's index."""
    port = free_port()
    conductor_args = ("conductor", "--port", str(port), "--model", "tiny", "--log-level", "warning")
    conductor = role_procs(*conductor_args)
    store = role_procs("store", *BASE, "--conductor", conductor.url(), "--event-interval", "50ms")
    client = await StoreClient.connect(store.addresses["data"])
    try:
        await client.put(chain(3, seed=34), [b"a", b"b", b"c"])
        await _wait_indexed(conductor.url(), 3)
        conductor.stop()
        conductor = role_procs(*conductor_args)
        await _wait_indexed(conductor.url(), 3)
    finally:
        await client.close()


async def _wait_indexed(url: str, n: int) -> None:
    for _ in range(200):
        metrics = (await asyncio.to_thread(http_get, url + "/metrics"))[1].decode()
        if f"mooncake_conductor_indexed_blocks {float(n)}" in metrics:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the conductor never indexed {n} blocks")
