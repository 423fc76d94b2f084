"""A tensor-parallel prefill's ranks read and write the store themselves (docs/store.md §2f): each
rank loads its own KV heads of a cached prefix (the store sends only those heads) and writes its
own heads of new blocks, so rank 0 reads, hands out and gathers none of the other ranks' KV. A
prefix written at TP=1 is reused at TP=2 and the other way round, with the reference tokens.

Why live pieces: the follower rank is a process with its own store connection, and the store a
process assembling head slices; the prefill and decode run in this process over real sockets
(``tests/pd/harness.py``), so no role process is started beyond the store and the rank."""

import asyncio
import contextlib

import pytest
import torch

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.instance.tp_ranks import RankPlan, TPGroup
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.common.ports import free_port
from mooncake_lite.model.tp_comms import GroupAddress
from mooncake_lite.prefill.rank_store import follower_stores, remote_prefix_store
from mooncake_lite.store.client import StoreClient
from tests.conftest import start_role
from tests.pd.harness import cluster, prompt
from tests.pd.test_e2e import BS

from tests.pd.test_tp_ranks_send import model  # noqa: F401  (the "tiny" model, a fixture)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def store():
    proc = start_role("store", "--port", "0", "--data-port", "0", "--dram", "16MiB", "--slot-bytes", "64KiB")
    yield proc.addresses["data"]
    proc.stop()


def _group(store: str, tp: int):
    """Rank 0 of a TP=``tp`` "tiny" prefill in this process, the others spawned processes each
    with its own connection to ``store``."""
    group = TPGroup(RankPlan("tiny", "float32", 0, ("cpu",) * tp, 1, None, 64, BS,
                             GroupAddress("127.0.0.1", free_port(), tp, 30.0, "gloo"),
                             rank_store=follower_stores(store, None, None, tp)))
    yield group.runner
    group.stop()


@pytest.fixture   # one group at a time: rank 0 is this process, which holds one process group
def tp2(store):
    yield from _group(store, 2)


@pytest.fixture
def tp4(store):
    yield from _group(store, 4)   # the tiny model's 2 KV heads, each replicated on two ranks


@contextlib.asynccontextmanager
async def prefill_on(model, store, runner=None):
    """An in-process prefill (TP=1, or the TP leader ``runner``) on ``store``, feeding a TP=1
    decode; its results and rank 0's own store reads (bytes) recorded."""
    heads = None if runner is None else runner.layout.kv_heads
    on_store = remote_prefix_store(store, None, None, model.args, BS, torch.float32, heads)
    async with cluster(model, block_size=BS, chunk=20, decode_blocks=128, store=on_store,
                       prefill_runner=runner) as c:
        c.results, c.read_bytes, get_layers, prefill = [], [0], on_store.get_layers, c.prefill.prefill

        async def counted(*args, **kwargs):
            views = await get_layers(*args, **kwargs)
            c.read_bytes[0] += sum(v.nbytes for v in views)
            return views

        async def recorded(request):
            c.results.append(await prefill(request))
            return c.results[-1]
        on_store.get_layers, c.prefill.prefill = counted, recorded
        yield c
        await c.prefill.stage.drain_puts()
        await on_store.close()


async def _reuses(c, model, rid: str, toks: list[int], cached: int) -> None:
    tokens, _, error = await c.request(rid, toks, 4)
    assert error is None and tokens == reference_greedy(model, toks, 4)
    assert c.results[-1].num_prefix_tokens == cached
    assert c.prefill.stage.num_prefix_fallbacks == 0


async def test_each_rank_loads_and_writes_its_own_heads_at_any_degree(model, store, tp2):
    """Written at TP=1, reused at TP=2: rank 0 reads only its head from the store and hands out
    nothing; written back at TP=2 as one head slice per rank (rank 0 gathers none), reused at TP=1."""
    layer_bytes = 2 * BS * model.args.head_dim * 4   # one head of one layer of one block, float32
    shared = prompt(3 * BS, 21)
    async with prefill_on(model, store) as one:   # TP=1 writes the prefix
        await _reuses(one, model, "w1", shared + prompt(5, 22), 0)
    async with prefill_on(model, store, tp2) as two:
        before = dict(tp2.gathered_bytes)
        await _reuses(two, model, "r2", shared + prompt(7, 23), 3 * BS)
        # rank 0's head of every layer of the 3 blocks, from the store; nothing handed or gathered
        assert two.read_bytes[0] == 3 * model.args.num_layers * layer_bytes
        assert tp2.gathered_bytes == before
        await _reuses(two, model, "w2", prompt(2 * BS, 24) + prompt(3, 25), 0)   # TP=2 writes one
        assert tp2.gathered_bytes == before   # its blocks: each rank put its own head
        await _a_follower_that_cannot_load_makes_rank_0_recompute(two, model, store, prompt(2 * BS, 24))
    async with prefill_on(model, store) as one:   # TP=1 reads what the two ranks wrote
        await _whole(one, prompt(2 * BS, 24))
        await _reuses(one, model, "r1", prompt(2 * BS, 24) + prompt(6, 26), 2 * BS)
        assert one.read_bytes[0] == 2 * model.args.num_layers * model.args.num_kv_heads * layer_bytes


async def test_replicated_heads_are_loaded_by_every_holder_and_written_once(model, store, tp4):
    """TP=4 over 2 KV heads (each held by two ranks): a prefix written at TP=1 is reused, each
    holder loading its head and the first of them sending it; one TP=4 wrote (its first holders,
    once each) is reused at TP=1. Rank 0 reads its one head and hands out or gathers nothing."""
    layer_bytes = 2 * BS * model.args.head_dim * 4
    shared = prompt(2 * BS, 31)
    async with prefill_on(model, store) as one:
        await _reuses(one, model, "w1", shared + prompt(3, 32), 0)
    async with prefill_on(model, store, tp4) as four:
        before = dict(tp4.gathered_bytes)
        await _reuses(four, model, "r4", shared + prompt(9, 33), 2 * BS)
        assert four.read_bytes[0] == 2 * model.args.num_layers * layer_bytes
        await _reuses(four, model, "w4", prompt(3 * BS, 34) + prompt(2, 35), 0)
        assert tp4.gathered_bytes == before
    async with prefill_on(model, store) as one:
        await _whole(one, prompt(3 * BS, 34))
        await _reuses(one, model, "r1", prompt(3 * BS, 34) + prompt(4, 36), 3 * BS)


async def _a_follower_that_cannot_load_makes_rank_0_recompute(c, model, store: str, prefix: list[int]) -> None:
    """The prefix's blocks deleted right after rank 0 matched them (on this node rank 0 still
    reads them under its match's lease; rank 1, without one, finds them gone): the prefix is
    recomputed, not failed, and the tokens are the reference's."""
    await _whole(c, prefix)
    stage, deleter = c.prefill.stage, await StoreClient.connect(store)
    match = stage.store.match

    async def then_delete(keys):
        num = await match(keys)
        await deleter.delete(keys)
        return num
    stage.store.match = then_delete
    try:
        toks = prefix + prompt(4, 27)
        tokens, _, error = await c.request("gone", toks, 4)
        assert error is None and tokens == reference_greedy(model, toks, 4)
        assert stage.num_prefix_fallbacks == 1
    finally:
        stage.store.match = match
        await deleter.close()
    await _whole(c, prefix)   # written back again, by both ranks


async def _whole(c, tokens: list[int]) -> None:
    """Wait until the store holds every block of ``tokens`` whole: the followers' puts are their
    own, in the background, and a block shows only once every head slice is in."""
    keys = prefix_hash(tokens, BS, 0)
    for _ in range(100):
        if await c.prefill.stage.match(keys) == len(keys):
            return
        await asyncio.sleep(0.05)
