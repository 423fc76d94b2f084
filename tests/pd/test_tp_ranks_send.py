"""A tensor-parallel prefill's ranks send their own KV heads (docs/store.md §2f): rank 0 no
longer gathers the others' heads of computed layers, the decode receives each rank's slice on
that rank's own connection and gives the reference tokens. (A CPP group of TP stages that loses
a rank: tests/pd/test_tp.py, on the processes its cluster already runs.)"""

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mooncake_lite.decode.batcher import DecodeBatcher
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.decode.kv_receiver import start_kv_server
from mooncake_lite.instance.tp_ranks import RankPlan, TPGroup
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.tp_comms import GroupAddress, free_port
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks
from mooncake_lite.prefill.service import PrefillService
from mooncake_lite.prefill.store_io import MemoryStore
from mooncake_lite.transfer.server import server_address
from tests.pd.harness import Cluster, prompt
from tests.pd.test_e2e import BS

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


@pytest.fixture(scope="module")
def tp2_group():
    """Rank 0 of a TP=2 "tiny" prefill in this process, rank 1 a spawned process."""
    plan = RankPlan("tiny", "float32", 0, ("cpu", "cpu"), 1, None, 64, BS,
                    GroupAddress("127.0.0.1", free_port(), 2, 30.0, "gloo"))
    group = TPGroup(plan)
    yield group
    group.stop()


@contextlib.asynccontextmanager
async def tp_prefill(model, runner):
    """The in-process TP=1 decode of ``tests/pd/harness.py``'s clusters, fed by a prefill on
    ``runner`` (a TP leader's); the decode's KV intake spied on: (connection, heads) per frame."""
    decode_runner = ModelRunner(model, num_blocks=128, block_size=BS)
    engine = DecodeEngine(decode_runner, DecodeBatcher(decode_runner.allocator, BS), ThreadPoolExecutor(1))
    frames: list[tuple[int, int, tuple[int, int] | None]] = []
    kv_layer = engine.kv_layer

    def spy(conn_id, tid, layer, start, n, kv, traceparent=None, heads=None):
        frames.append((conn_id, layer, None if heads is None else (heads.start, heads.stop)))
        return kv_layer(conn_id, tid, layer, start, n, kv, traceparent, heads)
    engine.kv_layer = spy
    server = await start_kv_server(engine, "127.0.0.1", 0, None)
    step_task = asyncio.create_task(engine.run())
    links = DecodeLinks(None)
    layer_bytes = 2 * BS * model.args.num_kv_heads * model.args.head_dim * 4
    stage = StageEngine(runner, MemoryStore((0, model.args.num_layers), layer_bytes), ThreadPoolExecutor(1))
    service = PrefillService(stage, links, block_size=BS, hash_seed=0, chunk_size=20)
    try:
        c = Cluster(engine, service, server_address(server), server)
        c.frames = frames
        yield c
    finally:
        step_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step_task
        await stage.drain_puts()
        await links.close()
        server.close()


async def test_each_rank_sends_its_own_heads_and_rank_0_gathers_none(model, tp2_group):
    """Computed layers reach the decode as one frame per rank, rank 1's on its own connection,
    and rank 0 receives none of rank 1's KV for them; the tokens are the reference's. With the
    ranks' sending off (the gather it replaced), rank 0 receives every layer of rank 1's heads."""
    runner = tp2_group.runner
    toks = prompt(45, 3)   # 3 chunks of 20: frames of every chunk from both ranks
    kv_per_token_head = 2 * model.args.head_dim * 4
    async with tp_prefill(model, runner) as c:
        before = runner.gathered_bytes["gather_kv"]
        tokens, reason, error = await c.request("direct", toks, 4)
        assert error is None and tokens == reference_greedy(model, toks, 4)
        assert runner.gathered_bytes["gather_kv"] == before   # nothing of rank 1's came through rank 0
        by_heads = {heads: {conn for conn, _, h in c.frames if h == heads} for _, _, heads in c.frames}
        assert set(by_heads) == {(0, 1), (1, 2)}   # each rank's head, never a gathered whole
        assert by_heads[(0, 1)].isdisjoint(by_heads[(1, 2)])   # on connections of their own
        assert len(c.frames) == 2 * model.args.num_layers * 3

        runner.ranks_send = False
        try:
            c.frames.clear()
            toks = prompt(45, 5)   # no prefix in the store: every layer of every token computed
            tokens, _, error = await c.request("gathered", toks, 4)
            assert error is None and tokens == reference_greedy(model, toks, 4)
            through_rank0 = runner.gathered_bytes["gather_kv"] - before
            assert through_rank0 == model.args.num_layers * len(toks) * kv_per_token_head   # rank 1's one head
            assert len({conn for conn, _, _ in c.frames}) == 1   # rank 0 sent both heads' frames
        finally:
            runner.ranks_send = True


async def test_a_rank_whose_decode_refuses_fails_the_stream_with_its_reason(model, tp2_group):
    """Rank 1's frames refused (the decode no longer waits for the transfer): the prefill's
    END reports the rank's failure instead of waiting for the decode's timeout."""
    async with tp_prefill(model, tp2_group.runner) as c:
        real = c.decode.kv_layer

        def refuse_rank1(conn_id, tid, layer, start, n, kv, traceparent=None, heads=None):
            if heads is not None and heads.start == 1:
                from mooncake_lite.decode.engine import KVError
                raise KVError("unknown_transfer", "refused for the test")
            return real(conn_id, tid, layer, start, n, kv, traceparent, heads)
        c.decode.kv_layer = refuse_rank1
        t0 = time.monotonic()
        with pytest.raises(Exception, match="tensor-parallel rank 1"):
            await c.request("refused", prompt(21, 4), 2, kv_timeout_s=120)
        assert time.monotonic() - t0 < 60   # answered, not left to the decode's 120 s timeout
