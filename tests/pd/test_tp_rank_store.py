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
from mooncake_lite.model.tp_comms import GroupAddress, free_port
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.rank_store import follower_stores, remote_prefix_store
from tests.conftest import start_role
from tests.pd.harness import cluster, prompt
from tests.pd.test_e2e import BS

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


@pytest.fixture(scope="module")
def store():
    proc = start_role("store", "--port", "0", "--data-port", "0", "--dram", "16MiB", "--slot-bytes", "64KiB")
    yield proc.addresses["data"]
    proc.stop()


@pytest.fixture(scope="module")
def tp2(store):
    """Rank 0 of a TP=2 "tiny" prefill in this process, rank 1 a spawned process with its own
    connection to ``store``."""
    plan = RankPlan("tiny", "float32", 0, ("cpu", "cpu"), 1, None, 64, BS,
                    GroupAddress("127.0.0.1", free_port(), 2, 30.0, "gloo"),
                    rank_store=follower_stores(store, None, None, 2))
    group = TPGroup(plan)
    yield group.runner
    group.stop()


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
    async with prefill_on(model, store) as one:   # TP=1 reads what the two ranks wrote
        keys = prefix_hash(prompt(2 * BS, 24), BS, 0)
        for _ in range(100):   # rank 1's put is its own, in the background: whole once it lands
            if await one.prefill.stage.match(keys) == 2:
                break
            await asyncio.sleep(0.05)
        await _reuses(one, model, "r1", prompt(2 * BS, 24) + prompt(6, 26), 2 * BS)
        assert one.read_bytes[0] == 2 * model.args.num_layers * model.args.num_kv_heads * layer_bytes
