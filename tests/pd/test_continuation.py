"""A continued request (issue #37): prompt + the k tokens already sent, ``num_generated`` = k,
through prefill and decode in one process, goes on exactly as the uninterrupted run did: greedy,
seeded, with penalties and min_tokens, and under a grammar. Then the decode's write-back: the
generated tokens' full blocks are in the store under the keys a prefill of prompt + output uses."""

import dataclasses

import pytest
import torch

from mooncake_lite.common.protocol import Sampling
from mooncake_lite.model.generate import generate
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.sampling import params_from_wire
from mooncake_lite.model.weights import build_model
from tests.pd.harness import cluster, prompt

pytestmark = pytest.mark.timeout(180)

BS = 8
N = 14          # tokens each run generates
STOP = 7        # a stop id, masked by min_tokens until the last position


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def cases(toks: list[int]) -> dict[str, Sampling]:
    llguidance = pytest.importorskip("llguidance")
    return {
        "greedy": Sampling(max_tokens=N),
        "seeded": Sampling(max_tokens=N, temperature=1.3, top_p=0.9, seed=11),
        "penalties": Sampling(max_tokens=N, temperature=0.9, seed=5, presence_penalty=0.8, frequency_penalty=0.6,
                              repetition_penalty=1.3, penalty_ids=tuple(sorted(set(toks))), min_tokens=N - 1,
                              stop_token_ids=(STOP,)),
        # the letters' count is the grammar's state: a matcher not advanced over the k ids would
        # allow a-e again where only x-z may come
        "grammar": Sampling(max_tokens=N, temperature=1.0, seed=3,
                            grammar=llguidance.LLMatcher.grammar_from_regex("[a-e]{4}[x-z]{20}")),
    }


async def test_a_continued_request_equals_the_uninterrupted_run(model):
    from mooncake_lite.model.grammar import Grammars
    toks = prompt(13, 91)
    async with cluster(model, block_size=BS) as c:
        c.decode.runner.grammars = c.prefill.stage.runner.grammars = Grammars("tiny", model.args.vocab_size)
        for name, s in cases(toks).items():
            whole, reason, err = await c.request(f"{name}-w", toks, N, sampling=s)
            assert (len(whole), reason, err) == (N, "length", None), name
            if s.grammar is None:   # the monolithic run draws alike (the reference has no grammar)
                runner = ModelRunner(model, num_blocks=16, block_size=BS)
                assert whole == generate(runner, toks, params_from_wire(s)), name
            for k in (1, 5, N - 1):
                cont = dataclasses.replace(s, num_generated=k)
                rest, reason, err = await c.request(f"{name}-{k}", toks + whole[:k], N, sampling=cont)
                assert (whole[:k] + rest, reason, err) == (whole, "length", None), (name, k)
            if name in ("seeded", "penalties", "grammar"):   # the check can fail: not counted, it differs
                naive = dataclasses.replace(s, max_tokens=N - 5)
                rest, _, _ = await c.request(f"{name}-naive", toks + whole[:5], N - 5, sampling=naive)
                assert whole[:5] + rest != whole, name
        assert c.decode.requests == {} and c.decode.runner.allocator.num_free == c.decode.runner.allocator.num_blocks


async def test_a_continuation_that_does_not_fit_its_prompt_is_refused(model):
    from mooncake_lite.common.protocol import GenerateRequest
    async with cluster(model, block_size=BS) as c:
        with pytest.raises(ValueError, match="num_generated"):
            c.decode.add_request(GenerateRequest("r", "t", 4, Sampling(max_tokens=8, num_generated=4)))
        with pytest.raises(ValueError, match="num_generated"):
            c.decode.add_request(GenerateRequest("r", "t", 20, Sampling(max_tokens=8, num_generated=8)))
        assert c.decode.requests == {}


async def test_the_decode_writes_generated_blocks_under_the_keys_a_continuation_looks_up(model):
    """A request's generated tokens fill blocks 1-4 (prompt 13 = one full block + 5, then 30
    tokens, the last one's KV never computed); the decode writes them back, so its continuation
    (prompt + 29 tokens) and the next turn (prompt + all 30 + more) load 5 blocks and compute the rest."""
    from mooncake_lite.common.protocol import GenerateRequest, PrefillRequest
    from mooncake_lite.decode.writeback import GeneratedBlocks
    toks, n = prompt(13, 17), 30
    async with cluster(model, block_size=BS) as c:
        store = c.prefill.stage.store
        c.decode.writeback = GeneratedBlocks(c.decode.runner, c.decode.executor, store, hash_seed=0)
        whole, _, err = await c.request("a", toks, n, sampling=Sampling(max_tokens=n))
        await c.decode.writeback.drain()
        await c.prefill.stage.drain_puts()
        assert err is None and len(store) == 5 and c.decode.writeback.num_written == 4
        for rid, ids, s in (("cont", toks + whole[:-1], Sampling(max_tokens=n, num_generated=n - 1)),
                            ("turn", toks + whole + [5, 6, 7], Sampling(max_tokens=3))):
            events = c.decode.add_request(GenerateRequest(rid, f"t-{rid}", len(ids), s))
            res = await c.prefill.prefill(PrefillRequest(rid, f"t-{rid}", tuple(ids), c.data, s))
            assert res.num_prefix_tokens == 5 * BS, rid
            while (await events.get()).finish_reason is None:
                pass
            if rid == "cont":
                assert res.first_token == whole[-1]
        await c.decode.writeback.drain()
        wb = c.decode.writeback
        # the turn's 3 tokens fill block 5 (positions 40..47: the prompt's 6 left over, then 2 of them)
        assert (wb.num_written, wb.num_failed, wb.num_dropped) == (5, 0, 0)
        wb.max_blocks = 0                      # overloaded: blocks are dropped and counted, never queued
        _, _, err = await c.request("b", prompt(13, 18), n, sampling=Sampling(max_tokens=n))
        assert err is None and (wb.num_written, wb.num_dropped, wb.num_in_flight) == (5, 4, 0)


async def test_under_kv_compression_the_written_back_blocks_are_encoded_as_the_prefills(model):
    """--kv-compression int8: the decode encodes the blocks it writes back with the prefill's codec,
    so the continuation loads them through the prefill's decoding like any prefix: 5 blocks
    reused, and its token after the seam is the uninterrupted run's."""
    from mooncake_kernels.kv_codec import KVCodec, encoded_layer_bytes
    from mooncake_lite.common.protocol import GenerateRequest, PrefillRequest
    from mooncake_lite.decode.writeback import GeneratedBlocks
    from mooncake_lite.prefill.store_io import CompressedStore, MemoryStore
    a, codec = model.args, KVCodec("int8")
    inner = MemoryStore((0, a.num_layers), encoded_layer_bytes(BS, a.num_kv_heads, a.head_dim))
    store = CompressedStore(inner, codec, (BS, a.num_kv_heads, a.head_dim), torch.float32)
    toks, n = prompt(13, 17), 30
    async with cluster(model, block_size=BS, store=store) as c:
        c.decode.writeback = GeneratedBlocks(c.decode.runner, c.decode.executor, inner, hash_seed=0, codec=codec)
        whole, _, err = await c.request("a", toks, n, sampling=Sampling(max_tokens=n))
        await c.decode.writeback.drain()
        await c.prefill.stage.drain_puts()
        assert err is None and len(inner) == 5 and c.decode.writeback.num_written == 4
        s = Sampling(max_tokens=n, num_generated=n - 1)
        ids = toks + whole[:-1]
        events = c.decode.add_request(GenerateRequest("cont", "t-cont", len(ids), s))
        res = await c.prefill.prefill(PrefillRequest("cont", "t-cont", tuple(ids), c.data, s))
        while (await events.get()).finish_reason is None:
            pass
        assert res.num_prefix_tokens == 5 * BS and res.first_token == whole[-1]


def test_an_mla_decode_writes_back_blocks_the_size_and_codec_of_its_prefills():
    """Under --kv-compression an MLA cache's rope key has a scale of its own (model_codec): the
    decode's write-back encodes with that codec and into the prefill's layer size, or its blocks
    would not decode as the prefill's."""
    from mooncake_lite.decode.app import generated_blocks
    from mooncake_lite.decode.config import Config as DecodeConfig
    from mooncake_lite.model.kv_codec import model_codec
    from mooncake_lite.prefill.app import stored_block_bytes
    from mooncake_lite.prefill.config import Config as PrefillConfig
    mla = build_model("tiny-mla", seed=0)
    runner = ModelRunner(mla, num_blocks=8, block_size=BS)
    wb = generated_blocks(DecodeConfig(model="tiny-mla", store="127.0.0.1:1", kv_compression="int8",
                                       block_size=BS), runner, None)
    assert wb.codec == model_codec("int8", mla.args) and wb.codec.rope_dim > 0
    layout = wb.puts.layout
    assert layout.num_layers * layout.num_heads * layout.head_bytes == stored_block_bytes(
        PrefillConfig(model="tiny-mla", kv_compression="int8", block_size=BS))
