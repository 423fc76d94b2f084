"""--kv-compression int8 through live processes: the store keeps (and its SSD tier writes) the
encoded blocks in slots sized for them, a prefix hit loads and dequantizes them, and the tokens are
exactly those of the monolithic reference that puts the reused prefix KV through the same codec
(model/kv_codec.py). A prefill whose encoding differs from its store's is refused at start-up."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest
import torch

from mooncake_kernels.kv_codec import KVCodec, decode_layers, encoded_layer_bytes
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.kv_codec import compressed_prefix_run
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.app import StoreEncodingMismatch, store_id
from mooncake_lite.prefill.config import Config
from mooncake_lite.prefill.remote_store import RemoteStore
from mooncake_lite.store.client import StoreClient
from tests.pd.client import generate

pytestmark = pytest.mark.timeout(240)

BS = 16
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 16            # the tiny preset
BLOCK = LAYERS * encoded_layer_bytes(BS, KV_HEADS, HEAD_DIM)   # 4160 B, a quarter of float32's 16384
COMMON = ("--model", "tiny", "--block-size", str(BS), "--port", "0", "--no-profile", "--threads", "1")


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefix_kv(model, tokens):
    """[layers, 2, len(tokens), kv_heads, head_dim]: the KV a plain prefill of ``tokens`` computes."""
    runner = ModelRunner(model, num_blocks=blocks_needed(len(tokens), BS), block_size=BS)
    table = runner.allocator.allocate(runner.cache.num_blocks)
    runner.prefill(tokens, table, 0)
    return runner.cache.kv[:, :, table].flatten(2, 3)[:, :, :len(tokens)]


async def test_int8_prefix_hit_matches_the_codec_reference(role_procs, tmp_path, record_property):
    model = build_model("tiny", seed=0)
    # Slots exactly one encoded block: a plain float32 block (16 KiB) would not fit them.
    store = role_procs("store", "--port", "0", "--data-port", "0", "--kv-compression", "int8",
                       "--slot-bytes", str(BLOCK), "--dram", str(64 * BLOCK), "--ssd-queue", "1MiB",
                       "--ssd-dir", str(tmp_path / "ssd"))
    with ThreadPoolExecutor(2) as pool:      # each waits for its own ready line
        decode, prefill = pool.map(lambda spec: role_procs(*spec), [
            ("decode", *COMMON, "--num-blocks", "64"),
            ("prefill", *COMMON, "--num-blocks", "64", "--prefill-chunk", "24", "--kv-compression", "int8",
             "--store", store.addresses["data"])])
    # A prompt on which int8 prefix KV changes the greedy tokens (the tiny preset's top two logits
    # come within ~1e-3 at the 6th token), so equal tokens show the encoded prefix was what loaded.
    shared, toks, n = prompt(4 * BS, 182), prompt(4 * BS, 182) + prompt(7, 1182), 8
    codec_tokens, _ = compressed_prefix_run(model, toks, 4, BS, KVCodec("int8"), n)
    plain = reference_greedy(model, toks, n)
    assert codec_tokens != plain
    data = decode.addresses["data"]
    async with aiohttp.ClientSession() as session:
        first = await generate(session, prefill.url(), decode.url(), data, shared + prompt(9, 32), 5)
        assert first.error is None and first.prefill["num_prefix_tokens"] == 0
        assert first.tokens == reference_greedy(model, shared + prompt(9, 32), 5)   # nothing reused yet
        for _ in range(50):   # write-back is asynchronous
            out = await generate(session, prefill.url(), decode.url(), data, toks, n)
            if out.prefill["num_prefix_tokens"]:
                break
            await asyncio.sleep(0.1)
    assert out.prefill["num_prefix_tokens"] == 4 * BS
    assert out.tokens == codec_tokens
    agreement = sum(a == b for a, b in zip(out.tokens, plain)) / len(plain)
    record_property("int8_token_agreement_vs_uncompressed", agreement)   # reported: may be below 1
    assert agreement < 1

    # The store holds the encoded block: its size is the encoded one and it decodes to the
    # codec's round trip of the prefix's KV as the reference computed it (within float noise).
    keys = prefix_hash(toks, BS, 0)[:4]
    client = await StoreClient.connect(store.addresses["data"])
    try:
        blocks = await client.get(keys)
    finally:
        await client.close()
    assert [b.nbytes for b in blocks] == [BLOCK] * 4
    raw = torch.frombuffer(bytearray(blocks[0]), dtype=torch.uint8).view(LAYERS, -1)
    kv = decode_layers(raw, (BS, KV_HEADS, HEAD_DIM), KVCodec("int8"), torch.float32)
    exact = prefix_kv(model, shared)[:, :, :BS]           # block 0 of every layer, float32
    step = exact.abs().amax(dim=(2, 4), keepdim=True) / 127  # per layer, K/V and head
    assert bool(((kv - exact).abs() <= step / 2 + 1e-4).all())
    assert not torch.equal(kv, exact)

    # A prefill set otherwise would misread these blocks: the store's HELLO names its encoding
    # and the start-up check (the one `mooncake --role prefill` exits 2 on) refuses it.
    plain_cfg = Config(model="tiny", block_size=BS, store=store.addresses["data"])
    remote = RemoteStore(plain_cfg.store, None, LAYERS, 1)
    try:
        with pytest.raises(StoreEncodingMismatch, match="keeps KV blocks as int8 .* reads and writes none"):
            await store_id(plain_cfg, remote, check=True)
    finally:
        await remote.close()

    # SIGTERM persists DRAM blocks to the SSD tier: the files carry the encoded bytes too.
    assert store.stop() == 0
    files = list(Path(tmp_path / "ssd").rglob("*.blk"))
    assert len(files) >= 4
    assert all(BLOCK < f.stat().st_size < BLOCK + 256 for f in files)   # header + one encoded block


def test_the_simulator_keeps_twice_the_blocks_in_equal_dram_and_loads_them_faster():
    from mooncake_lite.sim.costs import get_hardware
    hw = get_hardware("llama2-70b-a800")
    coded = hw.with_kv_compression("int8")
    assert hw.with_kv_compression("none") is hw
    assert coded.dram_blocks() == pytest.approx(2 * hw.dram_blocks(), abs=1)
    assert coded.block_bytes() < hw.block_bytes() / 1.99
    assert coded.prefix_load_seconds(4096) == pytest.approx(hw.prefix_load_seconds(4096) * coded.store_kv_factor)
    assert coded.kv_bytes_per_token == hw.kv_bytes_per_token    # the prefill→decode stream is not coded


def test_the_bench_reports_agreement_bytes_and_capacity(capsys):
    import orjson

    from mooncake_lite.bench.model.kv_compression import main
    assert main(["--model", "tiny", "--prompts", "2", "--max-tokens", "2", "--codecs", "int8", "--trace", "",
                 "--dram", "1MiB", "--json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    acc = out["accuracy"]["int8"]
    assert acc["prompts"] == 2 and 0 <= acc["greedy_token_agreement"] <= 1 and acc["logit_max_abs_err"] > 0
    plain, coded = out["blocks"]["block_bytes"]["none"], out["blocks"]["block_bytes"]["coded"]
    assert (plain, coded) == (16384, BLOCK)
    assert out["blocks"]["store_blocks_at_dram"] == {"dram": 1 << 20, "none": 64, "coded": (1 << 20) // BLOCK}


async def test_compressed_store_keeps_encoded_blocks_and_loads_any_layer_range_decoded():
    from mooncake_kernels.kv_codec import round_trip
    from mooncake_lite.prefill.store_io import CompressedStore, MemoryStore
    shape = (BS, KV_HEADS, HEAD_DIM)
    inner = MemoryStore((0, LAYERS), encoded_layer_bytes(*shape))
    store = CompressedStore(inner, KVCodec("int8"), shape, torch.bfloat16)
    blocks = torch.randn(2, LAYERS, 2, *shape).to(torch.bfloat16)
    keys = [b"k0" * 8, b"k1" * 8]
    # Block bytes are head-major ([layers][kv_heads][2][bs][hd], transfer/kv_layout.py).
    plain = blocks.movedim(-2, -4).contiguous()
    await store.put_layers(keys, [memoryview(b.view(torch.uint8).numpy()) for b in plain], 0, LAYERS)
    assert len(inner) == 2 and await store.match(keys + [b"zz" * 8]) == 2
    assert len(inner._blocks[keys[0]]) == BLOCK                   # kept encoded
    views = await store.get_layers(keys, 1, 2)                          # layers 1..2, model dtype
    got = torch.stack([torch.frombuffer(bytearray(v), dtype=torch.bfloat16).view(2, KV_HEADS, 2, BS, HEAD_DIM)
                       .movedim(-4, -2) for v in views])
    assert torch.equal(got, round_trip(blocks, KVCodec("int8"))[:, 1:3])
