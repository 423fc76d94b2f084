"""In-process unit tests of the slab, the block pool and the SSD tier (no sockets)."""

from __future__ import annotations

import pytest

from mooncake_lite.store.blocks import BadRequest, BlockStore, StoreFull
from mooncake_lite.store.eviction import make_policy
from mooncake_lite.store.slab import Slab
from mooncake_lite.store.ssd import FILE_HEADER, SsdTier

K = [bytes([i]) * 16 for i in range(10)]


def put(store: BlockStore, keys, data, num_layers=1, first_pos=0) -> int:
    ticket = store.reserve(keys, [len(d) for d in data], num_layers, first_pos)
    views = store.ticket_views(ticket, memoryview(bytearray(1 << 12)))
    flat = b"".join(data)
    pos = 0
    for v in views:
        v[:] = flat[pos:pos + v.nbytes]
        pos += v.nbytes
    return store.commit(ticket)


def read(store: BlockStore, key: bytes) -> bytes | None:
    found, _ = store.lookup_dram([key])
    return None if found[0] is None else bytes(store.view(found[0]))


def test_slab_slots_views_and_errors():
    slab = Slab(4 * 100, 100, pin=False)
    assert [slab.alloc() for _ in range(4)] == [0, 1, 2, 3] and slab.alloc() is None
    slab.free(2)
    slab.free(3)
    with pytest.raises(ValueError, match="freed twice"):
        slab.free(3)
    assert [slab.alloc(), slab.alloc()] == [2, 3]  # FIFO: freed together, handed out together
    views = slab.views([(0, 100), (100, 100), (250, 10), (260, 5)])
    assert [v.nbytes for v in views] == [200, 15]
    with pytest.raises(ValueError, match="outside"):
        slab.view(1, 101)
    with pytest.raises(ValueError):
        Slab(50, 100, pin=False)


@pytest.mark.parametrize("shared", [False, True])
def test_a_big_slab_is_faulted_in_in_the_background(monkeypatch, shared):
    """Past SYNC_POPULATE_BYTES the slab is populated by a thread after the constructor returns;
    once it says so, writing every slot faults (almost) no page in any more."""
    import resource

    from mooncake_lite.store import slab as slab_module
    from mooncake_lite.transfer import shm
    if shared and not shm.is_supported():
        pytest.skip("no memfd here")
    monkeypatch.setattr(slab_module, "SYNC_POPULATE_BYTES", 0)
    slab = Slab(32 << 20, 1 << 20, pin=False, shared=shared)
    assert slab._populator.done.wait(60) and slab.is_populated
    if not slab._populator.resident:
        pytest.skip("MADV_POPULATE_WRITE is not available here")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for slot in range(slab.num_slots):
        slab.view(slot)[:] = bytes(slab.slot_bytes)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < (32 << 20) // 4096 // 8, f"{faults} page faults writing a populated slab"


def test_put_is_invisible_until_commit_and_cancel_frees():
    store = BlockStore(Slab(4 * 64, 64, pin=False), make_policy("lru"))
    ticket = store.reserve(K[:2], [64, 10], 1)
    assert K[0] not in store and store.slab.num_free == 2
    store.cancel(ticket)
    assert store.slab.num_free == 4 and store.match(K[:2]) == 0
    assert put(store, K[:3], [b"a" * 64, b"b" * 64, b"c" * 5]) == 3
    assert put(store, K[:2], [b"x" * 64, b"y" * 64]) == 0  # existing keys are not overwritten
    assert read(store, K[0]) == b"a" * 64 and read(store, K[2]) == b"c" * 5
    assert store.slab.num_free == 1


def test_bad_puts():
    store = BlockStore(Slab(2 * 64, 64, pin=False), make_policy("lru"))
    with pytest.raises(BadRequest, match="--slot-bytes"):
        store.reserve(K[:1], [65], 1)
    with pytest.raises(BadRequest, match="divisible"):
        store.reserve(K[:1], [63], 2)
    with pytest.raises(BadRequest):
        store.reserve(K[:2], [1], 1)
    with pytest.raises(StoreFull):
        store.reserve(K[:3], [1, 1, 1], 1)
    assert store.stats.full_errors == 1 and store.slab.num_free == 2


def test_pins_block_eviction_and_deferred_free():
    events = []
    store = BlockStore(Slab(2 * 64, 64, pin=False), make_policy("lru"), on_evicted=events.append)
    put(store, K[:2], [b"0" * 64, b"1" * 64])
    found, _ = store.lookup_dram([K[0]])
    store.lookup_dram([K[1]])  # K[0] is now least recently used
    lease = store.pin([found[0]], expires_at=10.0)
    put(store, [K[2]], [b"2"])
    assert events == [K[1]] and K[0] in store
    with pytest.raises(StoreFull):  # K[0] pinned, K[2] evictable: two new keys cannot fit
        store.reserve(K[3:5], [1, 1], 1)
    assert K[2] in store  # the refused put evicted nothing
    assert store.slab.num_free == 0
    store.unpin(lease)
    put(store, [K[3]], [b"3"])
    assert events[-1] == K[0]


async def test_delete_while_pinned_frees_at_unpin():
    store = BlockStore(Slab(2 * 64, 64, pin=False), make_policy("lfu"))
    put(store, K[:1], [b"z" * 64])
    found, _ = store.lookup_dram(K[:1])
    lease = store.pin(found, expires_at=5.0)
    view = store.view(found[0])
    assert await store.delete(K[:1]) == 1
    assert K[0] not in store and store.slab.num_free == 1  # hidden at once, memory still leased
    assert bytes(view) == b"z" * 64
    expired = []
    lease.on_expire = lambda: expired.append(True)
    assert store.expire_leases(4.9) == 0 and store.expire_leases(5.0) == 1
    assert expired == [True] and store.slab.num_free == 2 and store.num_leases == 0


def test_layer_spans():
    store = BlockStore(Slab(2 * 64, 64, pin=False), make_policy("length-aware"))
    put(store, K[:1], [bytes(range(64))], num_layers=4)
    found, _ = store.lookup_dram(K[:1])
    assert bytes(store.view(found[0], 1, 2)) == bytes(range(16, 48))
    with pytest.raises(BadRequest):
        store.view(found[0], 3, 2)


async def test_ssd_tier_write_read_corrupt_capacity_scan(tmp_path):
    dropped = []
    ssd = SsdTier(tmp_path, capacity_bytes=2 * (FILE_HEADER.size + 100), fsync=False, on_dropped=dropped.append)
    ssd.scan()
    for i in range(3):
        assert ssd.enqueue(K[i], bytes([i]) * 100, 2, chain_pos=i)
        assert K[i] in ssd  # readable while queued
        await ssd._write_pending(K[i])
    assert dropped == [K[0]] and len(ssd) == 2  # LRU capacity eviction
    data, num_layers, pos = await ssd.read(K[2])
    assert bytes(data) == bytes([2]) * 100 and (num_layers, pos) == (2, 2)
    path = ssd.path_of(K[1])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert await ssd.read(K[1]) is None and ssd.num_corrupt == 1 and not path.exists()
    again = SsdTier(tmp_path, capacity_bytes=1 << 20)
    assert again.scan() == [K[2]]
    assert not ssd.enqueue(K[5], b"x" * (1 << 21), 1)  # can never fit
    assert await again.remove(K[2]) and len(again) == 0


@pytest.mark.gpu
def test_pinned_slab_with_cuda():
    import torch
    slab = Slab(4 << 20, 1 << 20)  # pin=None: pinned because CUDA is present
    assert slab.is_pinned and torch.from_numpy(__import__("numpy").asarray(slab.view(0))).is_pinned()
    slab.view(1, 4)[:] = b"abcd"
    assert bytes(slab.view(1, 4)) == b"abcd"


async def test_evicted_block_dropped_when_the_ssd_queue_is_full(tmp_path):
    evicted = []
    ssd = SsdTier(tmp_path, capacity_bytes=1 << 20, fsync=False, max_pending_bytes=100)
    store = BlockStore(Slab(2 * 64, 64, pin=False), make_policy("lru"), ssd, on_evicted=evicted.append)
    put(store, K[:2], [b"a" * 64, b"b" * 60])
    put(store, [K[2]], [b"c"])  # K[0] (64 B) is queued for the SSD: still in the store
    assert evicted == [] and K[0] in store and K[0] in ssd
    put(store, [K[3]], [b"d"])  # K[1] (60 B) would exceed the 100-byte queue: dropped
    assert evicted == [K[1]] and K[1] not in store and ssd.num_dropped == 1
    await ssd._write_pending(K[0])
    assert ssd.path_of(K[0]).exists() and ssd.pending_bytes == 0
