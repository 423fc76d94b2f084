"""Prefill -> decode in one process over loopback sockets: exact tokens, and cheap failures in bulk."""

import asyncio

import pytest
import torch

from mooncake_lite.common.protocol import GenerateRequest, PrefillRequest, Sampling
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.engine import PrefillAborted
from mooncake_lite.transfer.client import FrameClient, RemoteError
from mooncake_lite.transfer.kv_stream import OP_KV_END, OP_KV_LAYER, layer_frame_meta
from tests.pd.harness import cluster, prompt

pytestmark = pytest.mark.timeout(120)

BS = 8


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def assert_clean(c):
    """Nothing held anywhere: every block back, no pending transfer, no live request."""
    assert c.decode.runner.allocator.num_free == c.decode.runner.allocator.num_blocks
    assert c.decode.pending == {} and c.decode.requests == {} and c.decode.batcher.seqs == {}
    assert c.prefill.stage.runner.allocator.num_free == c.prefill.stage.runner.allocator.num_blocks
    assert c.prefill.stage.jobs == {} and c.prefill.queue == {}


@pytest.mark.parametrize("chunk", [5, 16, 1000])
async def test_tokens_equal_reference_with_chunks_and_prefix_reuse(model, chunk):
    shared = prompt(3 * BS, 1)
    prompts = [shared + prompt(7, 2), shared + prompt(BS + 1, 3), prompt(BS, 4), shared + prompt(7, 2)]
    async with cluster(model, block_size=BS, chunk=chunk) as c:
        for i, toks in enumerate(prompts):
            got, reason, err = await c.request(f"r{i}", toks, 6)
            assert (reason, err) == ("length", None)
            assert got == reference_greedy(model, toks, 6)
            await c.prefill.stage.drain_puts()
        assert_clean(c)


async def test_prefix_hit_computes_only_new_tokens(model):
    shared = prompt(4 * BS, 11)
    async with cluster(model, block_size=BS, chunk=BS) as c:
        await c.request("a", shared + [1, 2, 3], 4)
        await c.prefill.stage.drain_puts()
        events = c.decode.add_request(GenerateRequest("b", "t-b", len(shared) + 2, Sampling(max_tokens=4)))
        res = await c.prefill.prefill(PrefillRequest("b", "t-b", tuple(shared + [9, 9]), c.data,
                                                     Sampling(max_tokens=4)))
        assert (res.num_prefix_tokens, res.num_computed_tokens) == (4 * BS, 2)
        tokens = [res.first_token]
        while (ev := await events.get()).finish_reason is None:
            tokens.append(ev.token)
        assert tokens == reference_greedy(model, shared + [9, 9], 4)
        # a fully cached prompt still computes its last token (the first token needs its logits)
        again = await c.request("c", shared, 3)
        assert again[0] == reference_greedy(model, shared, 3)


async def test_many_concurrent_requests_share_the_decode_batch(model):
    prompts = [prompt(5 + 3 * i, 100 + i) for i in range(12)]
    lengths = [3 + i % 5 for i in range(12)]
    async with cluster(model, block_size=BS, chunk=16) as c:
        results = await asyncio.gather(*(c.request(f"r{i}", p, n)
                                         for i, (p, n) in enumerate(zip(prompts, lengths))))
        for p, n, (tokens, reason, err) in zip(prompts, lengths, results):
            assert err is None and tokens == reference_greedy(model, p, n)
        assert_clean(c)


async def _open_stream(c, rid, prompt_len, timeout=30.0):
    events = c.decode.add_request(GenerateRequest(rid, f"t-{rid}", prompt_len, Sampling(max_tokens=4), timeout))
    host, port = c.data.rsplit(":", 1)
    return events, await FrameClient.connect(host, int(port))


async def test_stream_stopping_midway_fails_the_request_and_frees_memory_thousands_of_times(model):
    kvh, hd = model.args.num_kv_heads, model.args.head_dim
    async with cluster(model, block_size=BS, decode_blocks=64) as c:
        for i in range(1500):
            n = 1 + i % 20
            events, client = await _open_stream(c, f"f{i}", n)
            for layer in range(1 + i % (model.args.num_layers - 1)):   # some layers, never all; link dies
                kv = torch.randn(2, n, kvh, hd)
                await client.request(OP_KV_LAYER, layer_frame_meta(f"t-f{i}", layer, 0, n),
                                     [kv.numpy().tobytes()])
            client.conn.abort(None)
            ev = await asyncio.wait_for(events.get(), 5)
            assert ev.finish_reason == "error" and "broke midway" in ev.error
        assert_clean(c)
        # the instance still serves correctly afterwards
        toks = prompt(13, 5)
        assert (await c.request("ok", toks, 5))[0] == reference_greedy(model, toks, 5)


async def test_bad_frames_are_refused_without_harm(model):
    kvh, hd = model.args.num_kv_heads, model.args.head_dim
    async with cluster(model, block_size=BS) as c:
        events, client = await _open_stream(c, "x", 4)
        with pytest.raises(RemoteError, match="unknown_transfer"):
            await client.request(OP_KV_LAYER, layer_frame_meta("nope", 0, 0, 4), [bytes(2 * 4 * kvh * hd * 4)])
        with pytest.raises(RemoteError, match="bad_payload"):
            await client.request(OP_KV_LAYER, layer_frame_meta("t-x", 0, 0, 4), [b"123"])
        with pytest.raises(RemoteError, match="bad_range"):
            await client.request(OP_KV_LAYER, layer_frame_meta("t-x", 0, 2, 4), [bytes(2 * 4 * kvh * hd * 4)])
        with pytest.raises(RemoteError, match="bad_layer"):
            await client.request(OP_KV_LAYER, layer_frame_meta("t-x", 99, 0, 4), [bytes(2 * 4 * kvh * hd * 4)])
        with pytest.raises(RemoteError, match="bad_token"):
            await client.request(OP_KV_END, {"tid": "t-x", "first_token": 10**6})
        assert c.decode.abort("x")
        assert (await events.get()).finish_reason == "abort"
        await client.close()
        assert_clean(c)


async def test_dead_prefill_times_out_pending_requests(model):
    async with cluster(model, block_size=BS) as c:
        queues = [c.decode.add_request(GenerateRequest(f"w{i}", f"t-w{i}", 10, Sampling(max_tokens=3), 0.05))
                  for i in range(120)]
        for q in queues:
            ev = await asyncio.wait_for(q.get(), 5)
            assert ev.finish_reason == "error" and "did not arrive within 0.05s" in ev.error
        assert_clean(c)


async def test_decode_refusing_midway_makes_prefill_abandon(model):
    """Decode drops the request while its KV streams in (e.g. client gone): prefill stops, frees."""
    async with cluster(model, block_size=BS, chunk=4) as c:
        for i in range(300):
            rid = f"a{i}"
            c.decode.add_request(GenerateRequest(rid, f"t-{rid}", 40, Sampling(max_tokens=3)))
            task = asyncio.ensure_future(c.prefill.prefill(
                PrefillRequest(rid, f"t-{rid}", tuple(prompt(40, i)), c.data, Sampling(max_tokens=3))))
            for _ in range(i % 7):
                await asyncio.sleep(0)
            c.decode.abort(rid)
            with pytest.raises(PrefillAborted, match="unknown_transfer"):
                await task
        assert_clean(c)


async def test_dead_decode_makes_prefill_abandon(model):
    async with cluster(model, block_size=BS, chunk=4) as c:
        c.decode.add_request(GenerateRequest("d", "t-d", 60, Sampling(max_tokens=3)))
        task = asyncio.ensure_future(c.prefill.prefill(
            PrefillRequest("d", "t-d", tuple(prompt(60, 1)), c.data, Sampling(max_tokens=3))))
        await asyncio.sleep(0.01)
        c.server.close()
        client = await c.prefill.links.get(c.data)
        client.conn.abort(None)     # the decode side of the link is gone
        with pytest.raises((PrefillAborted, ConnectionError)):
            await task
        assert c.prefill.stage.jobs == {}
        assert c.prefill.stage.runner.allocator.num_free == c.prefill.stage.runner.allocator.num_blocks


async def test_kv_timeout_counts_inactivity_not_total_time(model):
    """A stream that keeps moving outlives kv_timeout_s; one that stalls (link still open) fails."""
    kvh, hd = model.args.num_kv_heads, model.args.head_dim
    async with cluster(model, block_size=BS) as c:
        events, client = await _open_stream(c, "slow", 6, timeout=1.0)
        for layer, start in [(0, t) for t in range(6)] + [(1, 0), (1, 1)]:   # 8 x 0.3 s > 1 s in all
            await asyncio.sleep(0.3)
            await client.request(OP_KV_LAYER, layer_frame_meta("t-slow", layer, start, 1),
                                 [torch.randn(2, 1, kvh, hd).numpy().tobytes()])
        assert events.empty() and "t-slow" in c.decode.pending
        ev = await asyncio.wait_for(events.get(), 10)           # then it stalls
        assert ev.finish_reason == "error" and "within 1s (1 of 4 layers complete)" in ev.error
        await client.close()
        assert_clean(c)


async def test_bfloat16_kv_travels_exactly():
    """bf16 KV through the store layout and the wire: tokens equal the monolithic bf16 run."""
    from mooncake_lite.model.generate import generate
    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.model.sampling import SamplingParams
    bf16 = build_model("tiny", dtype=torch.bfloat16, seed=2)
    async with cluster(bf16, block_size=BS, chunk=1000) as c:
        for i in range(3):
            toks = prompt(20 + 7 * i, 40 + i)
            got, _, err = await c.request(f"b{i}", toks, 6)
            want = generate(ModelRunner(bf16, num_blocks=16, block_size=BS), toks, SamplingParams(max_tokens=6))
            assert err is None and got == want
        assert_clean(c)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
async def test_seeded_sampling_equals_the_monolithic_run(model, top_p):
    from mooncake_lite.model.generate import generate
    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.model.sampling import SamplingParams
    async with cluster(model, block_size=BS) as c:
        for seed in range(4):
            toks = prompt(15 + seed, 60 + seed)
            s = Sampling(max_tokens=10, temperature=1.5, top_p=top_p, seed=seed)
            got, _, err = await c.request(f"s{seed}", toks, 10, sampling=s)
            want = generate(ModelRunner(model, num_blocks=16, block_size=BS), toks,
                            SamplingParams(temperature=1.5, top_p=top_p, seed=seed, max_tokens=10))
            assert err is None and got == want


async def test_a_decode_refusing_keepalives_for_another_reason_keeps_the_queued_request(model):
    """Only "no such transfer" drops a queued request: a decode that answers keepalives with any
    other error (say, one older than KV_ALIVE: bad_op) still gets the request's KV."""
    from mooncake_lite.decode.engine import KVError

    def old_decode(tid):
        raise KVError("bad_op", "unknown operation 23 on the KV data socket")

    async with cluster(model, block_size=BS) as c:
        c.prefill.keepalive_s = 0.05
        c.decode.kv_alive = old_decode
        await c.prefill.hold()
        toks = prompt(12, 72)
        waiting = asyncio.ensure_future(c.request("queued", toks, 4))
        await asyncio.sleep(0.3)                     # several keepalives refused meanwhile
        assert "queued" not in c.prefill._aborted
        c.prefill.unhold()
        tokens, reason, err = await waiting
        assert err is None and tokens == reference_greedy(model, toks, 4)
        assert_clean(c)


async def test_slow_work_before_the_first_kv_frame_keeps_decode_waiting(model):
    """A prefill that starts at once but spends longer than decode's kv_timeout before its
    first KV frame (a slow hot-spot migration, a slow prefix lookup) is kept alive too."""
    async with cluster(model, block_size=BS) as c:
        c.prefill.keepalive_s = 0.05                 # 10 keepalives per kv_timeout: margin for a busy CI
        match = c.prefill.stage.match

        async def slow_match(keys):
            await asyncio.sleep(1.5)                 # 3x the decode's kv_timeout below
            return await match(keys)

        c.prefill.stage.match = slow_match
        toks = prompt(12, 73)
        tokens, reason, err = await c.request("slow", toks, 4, kv_timeout_s=0.5)
        assert err is None and tokens == reference_greedy(model, toks, 4)
        assert_clean(c)


async def test_a_request_decode_drops_before_its_first_kv_frame_is_not_computed(model):
    async with cluster(model, block_size=BS) as c:
        c.prefill.keepalive_s = 0.05
        match, chunks = c.prefill.stage.match, []

        async def slow_match(keys):
            await asyncio.sleep(0.6)
            return await match(keys)

        run_chunk = c.prefill.stage.run_chunk

        async def counted(*args, **kwargs):
            chunks.append(args)
            return await run_chunk(*args, **kwargs)

        c.prefill.stage.match, c.prefill.stage.run_chunk = slow_match, counted
        events = c.decode.add_request(GenerateRequest("gone", "t-gone", 9, Sampling(max_tokens=2)))
        pending = asyncio.ensure_future(c.prefill.prefill(
            PrefillRequest("gone", "t-gone", tuple(prompt(9, 74)), c.data, Sampling(max_tokens=2))))
        await asyncio.sleep(0.1)
        c.decode.abort("gone")                       # its client went away during the prefix lookup
        assert (await events.get()).finish_reason == "abort"
        with pytest.raises(PrefillAborted, match="before its first KV frame"):
            await pending
        assert chunks == []
        assert_clean(c)


async def test_queued_prefill_keeps_decode_waiting_and_drops_what_decode_dropped(model):
    async with cluster(model, block_size=BS) as c:
        c.prefill.keepalive_s = 0.1
        await c.prefill.hold()              # the prefill is busy with something else
        toks = prompt(12, 70)
        waiting = asyncio.ensure_future(c.request("queued", toks, 4, kv_timeout_s=0.8))
        dropped_events = c.decode.add_request(GenerateRequest("gone", "t-gone", 9, Sampling(max_tokens=2)))
        dropped = asyncio.ensure_future(c.prefill.prefill(
            PrefillRequest("gone", "t-gone", tuple(prompt(9, 71)), c.data, Sampling(max_tokens=2))))
        await asyncio.sleep(0.3)
        c.decode.abort("gone")                       # e.g. its client disconnected
        assert (await dropped_events.get()).finish_reason == "abort"
        for _ in range(25):                          # 2.5 s in the queue, 3x the decode's kv_timeout
            await asyncio.sleep(0.1)
            assert not waiting.done()
        assert dropped.done()                        # the keepalive learned that decode dropped it: out at once
        c.prefill.unhold()
        tokens, reason, err = await waiting
        assert err is None and tokens == reference_greedy(model, toks, 4)
        with pytest.raises(PrefillAborted, match="while queued"):
            await dropped
        assert_clean(c)


async def test_a_qwen3_with_wide_heads_and_qk_norm_streams_exact_tokens(tmp_path):
    """Qwen3's heads are wider than hidden / heads: the KV frames, the paged caches and the prefix
    store are sized by the head, and the disaggregated tokens equal the monolithic ones and
    transformers' own greedy run on the same weights."""
    from tests.model.hf_fixtures import VOCAB, hf_greedy, save_qwen3
    hf = save_qwen3(tmp_path, seed=7)
    model = build_model(str(tmp_path))
    assert model.args.head_dim * model.args.num_heads != model.args.dim and model.args.qk_norm
    shared = [t % VOCAB for t in prompt(2 * BS, 21)]
    prompts = [shared + [5, 6, 7], shared + [9, 10]]
    async with cluster(model, block_size=BS, chunk=5) as c:
        for i, toks in enumerate(prompts):
            got, reason, err = await c.request(f"q{i}", toks, 6)
            assert (reason, err) == ("length", None)
            assert got == reference_greedy(model, toks, 6) == hf_greedy(hf, toks, 6)
            await c.prefill.stage.drain_puts()
        assert_clean(c)
