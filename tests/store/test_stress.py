"""Many clients at once against a tiny DRAM tier with an SSD behind it: every block that comes
back must be byte-exact, whatever eviction, promotion and leasing did in between."""

from __future__ import annotations

import asyncio
import random

from mooncake_lite.store.client import RemoteError, StoreClient
from tests.store.helpers import block, chain, metric

SLOT = 64 << 10


async def worker(address: str, keys: list[bytes], seed: int, stats: dict) -> None:
    rng = random.Random(seed)
    client = await StoreClient.connect(address)
    try:
        for _ in range(120):
            picked = rng.sample(keys, rng.randint(1, 3))
            sizes = [SLOT - (k[0] % 7) * 1000 for k in picked]
            op = rng.random()
            if op < 0.4:
                try:
                    await client.put(picked, [block(k, s) for k, s in zip(picked, sizes)], num_layers=1)
                except RemoteError as exc:  # every slot leased by other clients' reads
                    assert exc.code == "full"
                    stats["full"] += 1
            elif op < 0.8:
                got = await client.get(picked)
                for k, s, g in zip(picked, sizes, got):
                    if g is not None:
                        assert bytes(g) == block(k, s), "a block came back with the wrong bytes"
                        stats["hits"] += 1
            elif op < 0.9:
                outs = [bytearray(SLOT) for _ in picked]
                got = await client.get(picked, out=outs)
                for k, s, g in zip(picked, sizes, got):
                    if g is not None:
                        assert bytes(g) == block(k, s)
                        stats["hits"] += 1
            else:
                n, lease_id = await client.match_and_pin(picked, lease_s=5)
                await client.release(lease_id)
    finally:
        await client.close()


async def test_concurrent_clients_always_get_exact_bytes(role_procs, tmp_path):
    store = role_procs("store", "--port", "0", "--data-port", "0", "--dram", str(6 * SLOT),
                       "--slot-bytes", str(SLOT), "--ssd-dir", str(tmp_path), "--no-ssd-fsync",
                       "--eviction", "lfu")
    keys = chain(24, seed=40)
    stats = {"hits": 0, "full": 0}
    await asyncio.gather(*(worker(store.addresses["data"], keys, seed, stats) for seed in range(5)))
    assert stats["hits"] > 20
    assert metric(store.url(), "mooncake_store_hits_total", 'tier="ssd"') > 0
    assert metric(store.url(), "mooncake_store_corrupt_blocks_total") == 0
    assert metric(store.url(), "mooncake_store_leases") == 0
