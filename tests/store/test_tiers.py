"""Eviction order per policy, SSD spill and promotion, corruption, restart recovery (real processes)."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_lite.store.client import StoreClient
from mooncake_lite.store.ssd import FILE_HEADER
from tests.store.helpers import block, chain, metric

SLOT = 64 << 10


def store_args(*extra: str, slots: int = 4) -> list[str]:
    return ["--port", "0", "--data-port", "0", "--dram", str(slots * SLOT), "--slot-bytes", str(SLOT), *extra]


async def held(client: StoreClient, keys: list[bytes]) -> list[int]:
    return [i for i, ok in enumerate(await client.exists(keys)) if ok]


@pytest.mark.parametrize("policy, expected", [
    # 4 slots. Put chain a (positions 0..2) and b0; read a1, a2, b0; then put c0, then c1.
    ("lru", ["a2", "b0", "c0", "c1"]),           # a0, then a1: least recently used
    ("lfu", ["a1", "a2", "b0", "c1"]),           # a0 (1 use), then c0 (1 use, newer than nothing else)
    ("length-aware", ["a0", "b0", "c0", "c1"]),  # a2 (position 2), then a1 (position 1)
])
async def test_eviction_order_per_policy(role_procs, policy, expected):
    store = role_procs("store", *store_args("--eviction", policy))
    client = await StoreClient.connect(store.addresses["data"])
    a, b, c = chain(3, seed=10), chain(1, seed=11), chain(2, seed=12)
    names = {**{k: f"a{i}" for i, k in enumerate(a)}, b[0]: "b0", **{k: f"c{i}" for i, k in enumerate(c)}}
    try:
        await client.put(a, [block(k, 1000) for k in a])
        await client.put(b, [block(b[0], 1000)])
        await client.get([a[1], a[2]])
        await client.get([b[0]])
        for i, key in enumerate(c):  # one at a time so each insert evicts exactly one block
            await client.put([key], [block(key, 1000)], first_pos=i)
        everything = a + b + c
        assert sorted(names[everything[i]] for i in await held(client, everything)) == expected
    finally:
        await client.close()
    assert metric(store.url(), "mooncake_store_evictions_total", 'tier="dram"') == 2


async def test_full_store_without_ssd_evicts_and_reports(role_procs):
    store = role_procs("store", *store_args(slots=2))
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(5, seed=13)
    try:
        for k in keys:
            await client.put([k], [block(k, 5000)])
        assert await held(client, keys) == [3, 4]
        assert (await client.get(keys[:1]))[0] is None
    finally:
        await client.close()


async def test_spill_to_ssd_and_promotion(role_procs, tmp_path):
    store = role_procs("store", *store_args("--ssd-dir", str(tmp_path), "--ssd", "10MiB", slots=2))
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(6, seed=14)
    data = [block(k, 40_000 + i) for i, k in enumerate(keys)]
    try:
        for k, d in zip(keys, data):
            await client.put([k], [d], num_layers=1)
        assert await client.match(keys) == 6  # every block is in some tier
        await wait_for_files(tmp_path, 4)
        got = await client.get(keys)  # 4 come back from the SSD (promoted, evicting others)
        assert [bytes(g) for g in got] == data
        got = await client.get(keys[:1])  # a0 was promoted then evicted again: SSD copy kept
        assert bytes(got[0]) == data[0]
    finally:
        await client.close()
    assert metric(store.url(), "mooncake_store_hits_total", 'tier="ssd"') >= 4
    assert metric(store.url(), "mooncake_store_misses_total", 'tier="dram"') >= 4
    assert metric(store.url(), "mooncake_store_misses_total", 'tier="ssd"') == 0
    assert metric(store.url(), "mooncake_store_ssd_writes_total") >= 4
    assert metric(store.url(), "mooncake_store_blocks", 'tier="ssd"') >= 4


async def wait_for_files(root, count: int) -> list:
    for _ in range(200):
        files = sorted(root.glob("*/*.blk"))
        if len(files) >= count:
            return files
        await asyncio.sleep(0.025)
    raise AssertionError(f"expected {count} SSD files, found {len(list(root.glob('*/*.blk')))}")


async def test_corrupted_ssd_block_is_not_served(role_procs, tmp_path):
    store = role_procs("store", *store_args("--ssd-dir", str(tmp_path), slots=1))
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(3, seed=15)
    try:
        for k in keys:
            await client.put([k], [block(k, 30_000)])
        await wait_for_files(tmp_path, 2)
        victim = tmp_path / keys[0].hex()[:2] / f"{keys[0].hex()}.blk"
        raw = bytearray(victim.read_bytes())
        raw[FILE_HEADER.size + 1234] ^= 0xFF  # flip one payload byte; header and length stay valid
        victim.write_bytes(bytes(raw))
        got = await client.get(keys[:2])
        assert got[0] is None, "a block failing its checksum must never be served"
        assert bytes(got[1]) == block(keys[1], 30_000)
        assert not victim.exists()
        assert await client.exists(keys[:1]) == [False]
    finally:
        await client.close()
    assert metric(store.url(), "mooncake_store_corrupt_blocks_total") == 1
    assert metric(store.url(), "mooncake_store_misses_total", 'tier="ssd"') == 1


@pytest.mark.parametrize("persist", [True, False])
async def test_restart_recovers_from_ssd(role_procs, tmp_path, persist):
    flag = "--persist-on-exit" if persist else "--no-persist-on-exit"
    args = store_args("--ssd-dir", str(tmp_path), flag, slots=2)
    store = role_procs("store", *args)
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(5, seed=16)
    data = [block(k, 20_000) for k in keys]
    for k, d in zip(keys, data):
        await client.put([k], [d], num_layers=4)
    await wait_for_files(tmp_path, 3)
    await client.close()
    assert store.stop() == 0
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "leftover.tmp").write_bytes(b"half a write")  # a crash mid-write

    again = role_procs("store", *args)
    client = await StoreClient.connect(again.addresses["data"])
    try:
        expected = keys if persist else keys[:3]  # without persist only spilled blocks survive
        assert await client.exists(expected) == [True] * len(expected)
        got = await client.get(expected)
        assert [bytes(g) for g in got] == data[:len(expected)]
        layers = await client.get_layers(expected[:1], first_layer=1, num_layers=2)
        assert bytes(layers[0]) == data[0][5_000:15_000]  # num_layers survived the restart
    finally:
        await client.close()
    assert not (tmp_path / "ab" / "leftover.tmp").exists()


async def test_tampered_ssd_header_is_not_served_and_spares_the_batch(role_procs, tmp_path):
    """Issue #15: a changed num_layers in an SSD header was served (wrong layer slices), or broke
    the whole batched get (num_layers 0). Now the checksum covers the header."""
    import struct
    store = role_procs("store", *store_args("--ssd-dir", str(tmp_path), slots=3))
    client = await StoreClient.connect(store.addresses["data"])
    keys = chain(6, seed=17)
    data = [block(k, 30_000) for k in keys]
    try:
        for k, d in zip(keys, data):
            await client.put([k], [d], num_layers=4)
        await wait_for_files(tmp_path, 3)       # keys 0-2 spilled; 3-5 in DRAM
        for key, num_layers in ((keys[0], 3), (keys[1], 0)):
            path = tmp_path / key.hex()[:2] / f"{key.hex()}.blk"
            raw = bytearray(path.read_bytes())
            struct.pack_into("<I", raw, 8, num_layers)   # num_layers sits after magic, version, chain_pos
            path.write_bytes(bytes(raw))
        batch = [keys[0], keys[1], keys[2], keys[5]]
        layers = await client.get_layers(batch, first_layer=1, num_layers=2)
        assert layers[0] is None and layers[1] is None, "a tampered header must never be served"
        assert bytes(layers[2]) == data[2][7_500:22_500] and bytes(layers[3]) == data[5][7_500:22_500]
        got = await client.get(batch)
        assert got[0] is None and got[1] is None and bytes(got[2]) == data[2] and bytes(got[3]) == data[5]
        assert await client.exists(keys[:2]) == [False, False]
    finally:
        await client.close()
    assert metric(store.url(), "mooncake_store_corrupt_blocks_total") == 2


async def test_odd_entries_in_the_ssd_dir_do_not_stop_the_store(role_procs, tmp_path):
    keys = chain(3, seed=18)
    odd = tmp_path / keys[0].hex()[:2] / f"{keys[0].hex()}.blk"
    odd.mkdir(parents=True)                          # a directory named like a block file
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "README").write_text("hello")
    store = role_procs("store", *store_args("--ssd-dir", str(tmp_path), slots=1))
    client = await StoreClient.connect(store.addresses["data"])
    try:
        for k in keys:
            await client.put([k], [block(k, 20_000)])
        got = await client.get(keys[1:])   # (key 0's own SSD write fails on that directory: dropped)
        assert [bytes(g) for g in got] == [block(k, 20_000) for k in keys[1:]]
    finally:
        await client.close()
    assert odd.is_dir()
    logs = store.logs()
    assert f"{keys[0].hex()}.blk" in logs and "lost+found" in logs and "README" in logs
