"""A prefill on its store's node loads prefix KV layer by layer straight from the store's mapped
slab, under the lease its MATCH took (issue 17 item 1): no request per layer, tokens equal the
reference, the lease handed back once the loads are over; a lease that ended at the store while
the prefill still read (its slots recycled) sends the loads back to asking the store, or to
recomputing, and the tokens still equal the reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.app import figures
from mooncake_lite.prefill.remote_store import RemoteStore
from mooncake_lite.store.client import StoreClient
from mooncake_lite.store.protocol import Op
from mooncake_lite.transfer import shm
from tests.conftest import start_role
from tests.pd.harness import cluster
from tests.pd.test_inprocess import assert_clean
from tests.store.helpers import block, chain, metric

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not shm.is_supported(), reason="no memfd_create or /proc here")]
BS = 8
SLOTS = 16


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=7)


@pytest.fixture(scope="module")
def store(model):
    """A same-node store whose slots hold exactly one block of the tiny model (16 of them)."""
    a = model.args
    slot = BS * 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4
    proc = start_role("store", "--port", "0", "--data-port", "0", "--dram", str(SLOTS * slot),
                      "--slot-bytes", str(slot))
    proc.slot = slot
    yield proc
    proc.stop()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _remote(model, store) -> tuple[RemoteStore, list[tuple[Op, dict]]]:
    """The prefill's store adapter, every op it sends recorded."""
    a = model.args
    remote = RemoteStore(store.addresses["data"], None, a.num_layers, 2 * BS * a.num_kv_heads * a.head_dim * 4)
    client = await remote.client()
    assert client.transport == "shm"
    sent: list[tuple[Op, dict]] = []
    request = client.frames.request

    async def recorded(op, meta=None, payload=(), sink=None):
        sent.append((op, dict(meta or {})))
        return await request(op, meta, payload, sink)
    client.frames.request = recorded   # type: ignore[method-assign]
    return remote, sent


async def _no_leases(store, remote: RemoteStore) -> None:
    """Every lease handed back: none left in the adapter, the client's mapping or the store."""
    url = "http://" + store.addresses["http"]
    for _ in range(200):
        if metric(url, "mooncake_store_leases") == 0:
            break
        await asyncio.sleep(0.02)
    assert metric(url, "mooncake_store_leases") == 0
    assert remote.num_leases == 0 and (await remote.client()).shm.num_leases == 0


async def test_prefix_loads_read_the_slab_under_the_match_lease(model, store):
    remote, sent = await _remote(model, store)
    shared = _prompt(3 * BS, 1)
    first, second = shared + _prompt(5, 2), shared + _prompt(BS + 3, 3)
    try:
        async with cluster(model, block_size=BS, chunk=16, store=remote) as c:
            got, _, err = await c.request("warm", first, 4)
            assert err is None and got == reference_greedy(model, first, 4)
            await c.prefill.stage.drain_puts()
            sent.clear()
            got, reason, err = await c.request("hit", second, 6)
            assert (reason, err) == ("length", None) and got == reference_greedy(model, second, 6)
            stats = figures(c.prefill)
            assert stats["prefix_tokens_total"] == 3 * BS and stats["prefix_load_fallbacks_total"] == 0
            ops = [op for op, _ in sent]
            # One MATCH that pinned the prefix, no get per layer: every layer came from the slab.
            assert ops.count(Op.MATCH) == 1 and sent[ops.index(Op.MATCH)][1].get("lease_s")
            assert Op.GET_LAYERS not in ops and Op.GET not in ops
            await c.prefill.stage.drain_puts()
            await _no_leases(store, remote)
            assert Op.RELEASE in [op for op, _ in sent]
            assert_clean(c)
    finally:
        await remote.close()


@pytest.mark.parametrize("recycled", [False, True])
async def test_a_lease_ended_midway_falls_back_and_the_tokens_are_the_reference(model, store, recycled):
    """At layer 2 the store ends the lease behind the prefill's back (as if it ran out) and
    frees the prefix's slots: the blocks are put again (``recycled=False``: the prefill asks the
    store for the rest) or other blocks overwrite every slot (``recycled=True``: the prefix is
    gone, the prefill recomputes it). A slot read after its generation changed would give
    other bytes, so reference tokens mean no stale read was used."""
    remote, sent = await _remote(model, store)
    other = await StoreClient.connect(store.addresses["data"], shm=False)
    shared = _prompt(3 * BS, 10 + recycled)
    first, second = shared + _prompt(5, 20), shared + _prompt(BS + 3, 30)
    loads_from_slab = remote.get_layers
    recycled_now = asyncio.Event()   # layer 3's load (launched while 2's waits) reads after it too

    async def sabotaged(keys, first_layer, num_layers, out=None):
        if first_layer > 2:
            await recycled_now.wait()
        if first_layer == 2 and not sabotaged.done:
            sabotaged.done = True
            client = await remote.client()
            lease = remote._leases[keys[0]][0]
            # The store ends it; the client still believes it holds the lease.
            assert (await client.frames.request(Op.RELEASE, {"lease_id": lease.lease_id})).meta["released"]
            held = [bytes(v) for v in await other.get(keys)]
            assert await other.delete(keys) == len(keys)     # slots freed: their generations move on
            if recycled:
                junk = chain(SLOTS, seed=99)
                await other.put(junk, [block(k, store.slot) for k in junk])
            else:
                await other.put(list(keys), held, num_layers=model.args.num_layers)
            recycled_now.set()
        return await loads_from_slab(keys, first_layer, num_layers, out=out)
    sabotaged.done = False
    try:
        async with cluster(model, block_size=BS, chunk=16, store=remote) as c:
            got, _, err = await c.request("warm", first, 4)
            assert err is None and got == reference_greedy(model, first, 4)
            await c.prefill.stage.drain_puts()
            remote.get_layers = sabotaged   # type: ignore[method-assign]
            sent.clear()
            got, reason, err = await c.request("hit", second, 6)
            assert sabotaged.done
            assert (reason, err) == ("length", None) and got == reference_greedy(model, second, 6)
            stats = figures(c.prefill)
            asked = [m.get("first_layer") for op, m in sent if op == Op.GET_LAYERS]
            if recycled:
                assert stats["prefix_load_fallbacks_total"] == 1 and stats["prefix_tokens_total"] == 0
            else:   # layers 0-1 from the slab, 2-3 asked of the store: nothing recomputed
                assert sorted(asked) == [2, 3]
                assert stats["prefix_load_fallbacks_total"] == 0 and stats["prefix_tokens_total"] == 3 * BS
            await c.prefill.stage.drain_puts()
            await _no_leases(store, remote)
            assert_clean(c)
    finally:
        await other.close()
        await remote.close()


async def test_leases_of_one_prefix_are_handed_back_shortest_first(model, store):
    """Two matches of one chain (3 and 5 blocks): the 3-block loads ending hands back the
    3-block lease, and the 5-block one still reads from the slab without asking."""
    remote, sent = await _remote(model, store)
    client = await remote.client()
    keys = chain(5, seed=40)
    size = store.slot
    try:
        await client.put(keys, [block(k, size) for k in keys], num_layers=model.args.num_layers)
        assert await remote.match(keys[:3]) == 3 and await remote.match(keys) == 5
        assert remote.num_leases == 2
        remote.prefix_loaded(keys[:3])
        assert [lease.num_keys for lease in remote._leases[keys[0]]] == [5]
        sent.clear()
        got = await remote.get_layers(keys, 1, 2)
        assert [bytes(v) for v in got] == [block(k, size)[size // 4:3 * size // 4] for k in keys]
        assert [op for op, _ in sent if op != Op.RELEASE] == []   # read under the 5-block lease
        remote.prefix_loaded(keys)
        remote.prefix_loaded(keys)   # nothing left to hand back: a no-op
        await _no_leases(store, remote)
    finally:
        await remote.close()
