"""A tensor-parallel prefill's ranks send their own KV heads (docs/store.md §2f): rank 0 no
longer gathers the others' heads of computed layers, the decode receives each rank's slice on
that rank's own connection and gives the reference tokens. (A CPP group of TP stages that loses
a rank: tests/pd/test_tp.py, on the processes its cluster already runs.)"""

import contextlib
import time

import pytest

from mooncake_lite.instance.tp_ranks import RankPlan, TPGroup
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.common.ports import free_port
from mooncake_lite.model.tp_comms import GroupAddress
from mooncake_lite.model.weights import build_model
from tests.pd.harness import cluster, prompt
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
    """``tests/pd/harness.py``'s cluster (a TP=1 decode), fed by a prefill on ``runner`` (a TP
    leader's); the decode's KV intake spied on: (connection, layer, heads) per frame."""
    async with cluster(model, block_size=BS, chunk=20, decode_blocks=128, prefill_runner=runner) as c:
        frames: list[tuple[int, int, tuple[int, int] | None]] = []
        kv_layer = c.decode.kv_layer

        def spy(conn_id, tid, layer, start, n, kv, traceparent=None, heads=None):
            frames.append((conn_id, layer, None if heads is None else (heads.start, heads.stop)))
            return kv_layer(conn_id, tid, layer, start, n, kv, traceparent, heads)
        c.decode.kv_layer = spy
        c.frames = frames
        yield c


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
