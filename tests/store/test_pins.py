"""Context holds (issue #18): pinned blocks are never evicted before their expiry, in DRAM or on
the SSD, and stay pinned across a store restart (the pin journal beside the SSD files)."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from mooncake_lite.store.blocks import BlockStore, StoreFull
from mooncake_lite.store.client import StoreClient
from mooncake_lite.store.eviction import PinTable, make_policy
from mooncake_lite.store.protocol import Op
from mooncake_lite.store.slab import Slab
from mooncake_lite.store.pin_journal import PIN_JOURNAL
from mooncake_lite.store.ssd import SsdTier
from tests.store.helpers import block, chain, http_get
from tests.store.test_blocks import K, put

SLOT = 64 << 10


def test_pin_table_counts_owners_replaces_and_expires():
    table = PinTable()
    added, dropped = table.pin("a", ["k1", "k2"], 10.0)
    assert sorted(added) == ["k1", "k2"] and dropped == []
    table.pin("b", ["k2", "k3"], 20.0)
    assert all(table.is_pinned(k) for k in ("k1", "k2", "k3")) and len(table) == 3
    added, dropped = table.pin("a", ["k2"], 30.0)   # a re-pin replaces the keys and the expiry
    assert added == [] and dropped == ["k1"] and not table.is_pinned("k1")
    assert table.expired(19.9) == [] and table.expired(20.0) == ["b"]
    assert table.unpin("b") == ["k3"]               # k2 is still a's
    assert table.is_pinned("k2") and table.unpin("a") == ["k2"] and len(table) == 0
    assert table.unpin("nobody") == []


def test_policies_skip_held_keys():
    table = PinTable()
    table.pin("ctx", ["a"], 1.0)
    for name in ("lru", "lfu", "length-aware"):
        policy = make_policy(name)
        for pos, key in enumerate(["a", "b"]):
            policy.insert(key, pos if name != "length-aware" else 5 - pos)   # "a" would go first
        assert policy.victim(table.is_pinned) == "b", name


def test_held_dram_blocks_survive_eviction_pressure_until_released():
    evicted: list[bytes] = []
    store = BlockStore(Slab(2 * 64, 64, pin=False), make_policy("lru"), on_evicted=evicted.append)
    put(store, K[:1], [b"0" * 64])
    assert store.hold("ctx", [K[0], K[9]], expires_at=100.0) == 1   # K[9] is not here: not held
    for i in range(1, 5):                                           # K[0] is the least recently used
        put(store, [K[i]], [bytes([i]) * 64])
    assert K[0] in store and evicted == K[1:4]
    with pytest.raises(StoreFull):                                  # one slot held, one evictable
        store.reserve(K[5:7], [1, 1], 1)
    assert store.expire_holds(99.0) == [] and store.expire_holds(100.0) == ["ctx"]
    put(store, [K[5]], [b"5"])
    assert K[0] not in store                                        # evictable once expired
    assert not store.unhold("ctx")


async def test_deleting_a_held_block_frees_it():
    store = BlockStore(Slab(2 * 64, 64, pin=False), make_policy("lru"))
    put(store, K[:2], [b"a" * 64, b"b" * 64])
    store.hold("ctx", K[:2], expires_at=100.0)
    assert await store.delete(K[:1]) == 1
    assert store.slab.num_free == 1 and not store.holds.is_pinned(K[0]) and store.holds.is_pinned(K[1])
    put(store, K[2:3], [b"c"])
    with pytest.raises(StoreFull):                                  # K[1] still held: one slot left
        store.reserve(K[3:5], [1, 1], 1)


async def test_the_ssd_tier_keeps_held_blocks_and_the_journal_restores_them(tmp_path):
    size = 1000
    ssd = SsdTier(tmp_path, capacity_bytes=3 * (size + 64), fsync=False)
    store = BlockStore(Slab(2 * size, size, pin=False), make_policy("lru"), ssd)
    writer = asyncio.get_running_loop().create_task(ssd.run_writer())
    keys = chain(8, seed=3)
    put(store, keys[:1], [block(keys[0], size)])
    store.hold("ctx", keys[:1], expires_at=1e12)    # queued for the SSD at once (write-through)
    for key in keys[1:]:                            # spills fill the SSD over and over
        put(store, [key], [block(key, size)])
        await ssd.flush()
    assert keys[0] in ssd and ssd.num_evicted > 0
    assert (tmp_path / PIN_JOURNAL).is_file()
    await ssd.stop()
    await writer

    # A new store on the same directory (a restart without persisting DRAM): still held.
    ssd2 = SsdTier(tmp_path, capacity_bytes=3 * (size + 64), fsync=False)
    again = BlockStore(Slab(2 * size, size, pin=False), make_policy("lru"), ssd2)
    ssd2.scan()
    assert again.restore_holds(ssd2.journal.load(), now=0.0) == 1
    assert again.holds.is_pinned(keys[0])
    writer = asyncio.get_running_loop().create_task(ssd2.run_writer())
    for key in chain(6, seed=4):
        put(again, [key], [block(key, size)])
        await ssd2.flush()
    assert keys[0] in again
    got = await again.promote(keys[0])
    assert bytes(again.view(got)) == block(keys[0], size)
    await ssd2.stop()
    await writer
    assert again.restore_holds(ssd2.journal.load(), now=2e12) == 0   # expired while it was down


async def test_pin_op_on_the_data_port_survives_kill_9(role_procs, tmp_path):
    args = ["--port", "0", "--data-port", "0", "--dram", str(2 * SLOT), "--slot-bytes", str(SLOT),
            "--ssd-dir", str(tmp_path), "--ssd", str(3 * (SLOT + 64)), "--no-ssd-fsync", "--log-level", "warning"]
    store = role_procs("store", *args)
    client = await StoreClient.connect(store.addresses["data"])
    keys, other = chain(2, seed=5), chain(6, seed=6)
    await client.put(keys, [block(k, SLOT // 2) for k in keys])
    reply = await client.frames.request(Op.PIN, {"keys": "".join(k.hex() for k in keys) + other[0].hex(),
                                                 "pin": "ctx-1", "expires_at": 4e9})
    assert reply.meta["num_held"] == 2
    bad = client.frames.request(Op.PIN, {"keys": keys[0].hex(), "pin": "", "expires_at": 4e9})
    with pytest.raises(Exception, match="pin"):
        await bad
    for _ in range(50):                             # the write-through reaches the SSD
        if len(list(tmp_path.glob("*/*.blk"))) >= 2:
            break
        await asyncio.sleep(0.05)
    await client.close()
    store.send(signal.SIGKILL)                      # no graceful persist: only the SSD tier is left

    again = role_procs("store", *args)
    client = await StoreClient.connect(again.addresses["data"])
    try:
        for key in other:                           # pressure on both tiers
            await client.put([key], [block(key, SLOT // 2)])
        assert await client.exists(keys) == [True, True]
        assert [bytes(b) for b in await client.get(keys)] == [block(k, SLOT // 2) for k in keys]
        _, body = http_get(again.url() + "/health")
        assert json.loads(body)["held_blocks"] == 2 and json.loads(body)["holds"] == 1
        reply = await client.frames.request(Op.UNPIN, {"pin": "ctx-1"})
        assert reply.meta["released"] is True
        assert (await client.frames.request(Op.UNPIN, {"pin": "ctx-1"})).meta["released"] is False
    finally:
        await client.close()
