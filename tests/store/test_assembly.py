"""Blocks assembled from layer slices (store/assembly.py): in process against the real block pool,
then once through a store process (the PUT handler, the client, /metrics)."""

from __future__ import annotations

import pytest

from mooncake_lite.store.blocks import BadRequest, BlockStore, StoreFull
from mooncake_lite.store.client import RemoteError, StoreClient
from mooncake_lite.store.eviction import make_policy
from mooncake_lite.store.slab import Slab
from tests.store.helpers import block, chain, metric

LAYERS, LAYER = 4, 64           # blocks of 4 layers of 64 bytes
K = chain(6, seed=7)


def make_store(num_slots: int = 8, **kw) -> tuple[BlockStore, list[bytes]]:
    events: list[bytes] = []
    store = BlockStore(Slab(num_slots * LAYERS * LAYER, LAYERS * LAYER, pin=False), make_policy("lru"),
                       on_stored=events.append)
    if kw:
        store.assembly.__init__(store, **kw)
    return store, events


def whole(key: bytes) -> bytes:
    return block(key, LAYERS * LAYER)


def put_slice(store: BlockStore, keys, first: int, count: int, now: float = 0.0, data=None) -> int:
    """One slice put: reserve, write the bytes where the views say, commit."""
    data = data or [whole(k)[first * LAYER:(first + count) * LAYER] for k in keys]
    ticket = store.assembly.reserve(keys, [len(d) for d in data], first, count, LAYERS, 0, now)
    for view, d in zip(store.assembly.views(ticket, memoryview(bytearray(1 << 12))), data):
        view[:] = d
    return store.assembly.commit(ticket)


def read(store: BlockStore, key: bytes) -> bytes | None:
    found, _ = store.lookup_dram([key])
    return None if found[0] is None else bytes(store.view(found[0]))


def test_block_visible_only_once_every_layer_range_is_in():
    store, events = make_store()
    assert put_slice(store, K[:2], 2, 2) == 0                  # layers 2..3 first: order does not matter
    assert store.match(K[:2]) == 0 and read(store, K[0]) is None and events == []
    assert store.assembly.num_partial == 2 and store.slab.num_free == 6   # each holds its slot
    assert put_slice(store, K[:2], 0, 1) == 0
    assert store.match(K[:1]) == 0
    assert put_slice(store, K[:2], 1, 1) == 2                   # the last range: both whole
    assert store.match(K[:2]) == 2 and events == K[:2] and store.assembly.num_partial == 0
    assert [read(store, k) for k in K[:2]] == [whole(k) for k in K[:2]]
    assert bytes(store.view(store.lookup_dram([K[0]])[0][0], 2, 1)) == whole(K[0])[2 * LAYER:3 * LAYER]
    assert store.slab.num_free == 6 and store.assembly.stats.assembled == 2


def test_slices_of_a_held_block_and_covered_ranges_are_no_ops():
    store, events = make_store()
    put_slice(store, K[:1], 0, 4)                               # a slice of every layer: whole at once
    assert read(store, K[0]) == whole(K[0])
    assert put_slice(store, K[:1], 1, 2, data=[b"x" * 2 * LAYER]) == 0
    assert read(store, K[0]) == whole(K[0]) and store.assembly.num_partial == 0
    put_slice(store, K[1:2], 0, 2)
    assert put_slice(store, K[1:2], 0, 1, data=[b"y" * LAYER]) == 0    # covered: its bytes dropped
    assert put_slice(store, K[1:2], 2, 2) == 1 and read(store, K[1]) == whole(K[1])
    assert events == K[:2] and store.assembly.stats.slices_dropped == 2


@pytest.mark.parametrize("first, count, block_layers, size, why", [
    (3, 2, LAYERS, 2 * LAYER, "outside"),            # past the last layer
    (-1, 1, LAYERS, LAYER, "outside"),
    (0, 0, LAYERS, LAYER, "outside"),
    (0, 1, 5000, LAYER, "block_layers"),
    (0, 3, LAYERS, 100, "divisible"),                # not whole layers
    (0, 1, 8, LAYER, "does not fit"),                # the whole block would not fit a slot
    (1, 2, LAYERS, 2 * LAYER, "in part"),            # overlaps layers 0..1 in part
    (2, 1, LAYERS, 32, "does not match"),            # another layer size than the first slice's
    (2, 1, 3, 3 * LAYER // 3, "does not match"),     # another layer count
])
def test_hostile_slices_are_refused_and_reserve_nothing(first, count, block_layers, size, why):
    store, _ = make_store()
    put_slice(store, K[:1], 0, 2)
    free, partial = store.slab.num_free, store.assembly.partials[K[0]]
    with pytest.raises(BadRequest, match=why):
        store.assembly.reserve([K[1], K[0]], [size, size], first, count, block_layers, 0, 0.0)
    assert store.slab.num_free == free and list(store.assembly.partials) == [K[0]]   # K[1]'s slot given back
    assert (partial.arrived, partial.receiving, partial.num_writers) == (0b0011, 0, 0)
    assert store.assembly.stats.refused == 1


def test_partial_blocks_expire_and_are_bounded():
    store, events = make_store(max_partial=2, ttl_s=5.0)
    put_slice(store, K[:2], 0, 2, now=100.0)
    with pytest.raises(StoreFull, match="at most 2"):
        put_slice(store, K[2:3], 0, 2, now=101.0)
    assert store.slab.num_free == 6
    assert store.assembly.expire(104.9) == 0
    assert store.assembly.expire(105.0) == 2 and store.slab.num_free == 8
    assert put_slice(store, K[:1], 2, 2, now=106.0) == 0      # a late slice starts afresh: never whole
    assert store.match(K[:1]) == 0 and events == [] and store.assembly.stats.expired == 2


def test_an_expired_block_still_being_written_frees_its_slot_when_the_bytes_are_in():
    store, _ = make_store(ttl_s=1.0)
    ticket = store.assembly.reserve(K[:1], [2 * LAYER], 0, 2, LAYERS, 0, 0.0)
    assert store.assembly.expire(2.0) == 1 and store.slab.num_free == 7   # the payload still lands there
    assert store.assembly.commit(ticket) == 0 and store.slab.num_free == 8
    ticket = store.assembly.reserve(K[:1], [2 * LAYER], 0, 2, LAYERS, 0, 3.0)
    store.assembly.cancel(ticket)                               # the connection died mid-put
    assert store.slab.num_free == 8 and store.assembly.num_partial == 0


def test_a_whole_put_wins_over_a_block_half_assembled():
    store, events = make_store()
    put_slice(store, K[:1], 0, 2)
    ticket = store.reserve(K[:1], [LAYERS * LAYER], LAYERS)
    store.ticket_views(ticket, memoryview(bytearray(1 << 12)))[0][:] = whole(K[0])
    assert store.commit(ticket) == 1
    assert put_slice(store, K[:1], 2, 2) == 0 and store.assembly.num_partial == 0
    assert store.slab.num_free == 7 and events == K[:1]


def test_no_slot_for_a_new_partial_block_is_full():
    store, _ = make_store(num_slots=2, max_partial=4)
    put_slice(store, K[:2], 0, 1)                               # partial blocks are never evicted
    with pytest.raises(StoreFull, match="no free DRAM slot"):
        put_slice(store, K[2:3], 0, 1)
    assert put_slice(store, K[:2], 1, 3) == 2 and store.match(K[:2]) == 2


@pytest.fixture
def store_proc(role_procs):
    return role_procs("store", "--port", "0", "--data-port", "0", "--dram", "1MiB", "--slot-bytes", "4KiB")


async def test_slices_through_a_store_process(store_proc):
    """Two stages put their halves on their own connections; the block shows once both are in."""
    data_address, url = store_proc.addresses["data"], store_proc.url("http")
    stages = [await StoreClient.connect(data_address) for _ in range(2)]
    keys = chain(3, seed=8)
    try:
        first = [whole(k)[:2 * LAYER] for k in keys]
        assert await stages[0].put(keys, first, num_layers=2, first_layer=0, block_layers=LAYERS) == 0
        assert await stages[1].match(keys) == 0 and (await stages[1].get(keys[:1]))[0] is None
        assert metric(url, "mooncake_store_partial_blocks") == 3
        with pytest.raises(RemoteError) as err:
            await stages[1].put(keys[:1], [b"z" * 3 * LAYER], num_layers=3, first_layer=1, block_layers=LAYERS)
        assert err.value.code == "bad_request" and "in part" in err.value.message
        second = [whole(k)[2 * LAYER:] for k in keys]
        assert await stages[1].put(keys, second, num_layers=2, first_layer=2, block_layers=LAYERS) == 3
        assert [bytes(b) for b in await stages[0].get(keys)] == [whole(k) for k in keys]
        got = await stages[0].get_layers(keys, first_layer=1, num_layers=2)
        assert [bytes(g) for g in got] == [whole(k)[LAYER:3 * LAYER] for k in keys]
        assert metric(url, "mooncake_store_partial_blocks") == 0
        assert metric(url, "mooncake_store_blocks_assembled_total") == 3
        assert metric(url, "mooncake_store_slices_refused_total") == 1
    finally:
        for client in stages:
            await client.close()
