"""One KV layout whatever the TP degree (issue 33): a block written by the ranks of a TP=2 prefill
as two head slices is read back bit for bit as the three slices a TP=3 reader holds and as the
whole block a TP=1 reader loads, plain and int8/fp8-compressed, through a store process (socket
and shared-memory puts); CPP stages of TP ranks assemble the same way; a layout version the store
does not keep is refused."""

from __future__ import annotations

import itertools

import pytest
import torch

from mooncake_kernels.kv_codec import encode_heads, encoded_head_bytes, fp8_supported
from mooncake_lite.common.hashing import KEY_BYTES
from mooncake_lite.store.client import RemoteError, StoreClient
from mooncake_lite.store.protocol import Op
from mooncake_lite.transfer import shm
from mooncake_lite.transfer.kv_layout import BlockLayout, HeadRange
from mooncake_lite.transfer.tp_heads import rank_heads
from tests.conftest import start_role

pytestmark = pytest.mark.timeout(120)
LAYERS, HEADS, BS, HD = 3, 6, 4, 8
ENCODINGS = ["float32", "bfloat16", "int8"] + (["fp8"] if fp8_supported() else [])
TRANSPORTS = ["tcp", pytest.param("shm", marks=pytest.mark.skipif(not shm.is_supported(),
                                                                  reason="no memfd_create or /proc here"))]


@pytest.fixture(scope="module")
def store():
    proc = start_role("store", "--port", "0", "--data-port", "0", "--dram", str(1 << 20), "--slot-bytes", str(8192))
    yield proc
    proc.stop()


async def _client(store, transport: str) -> StoreClient:
    client = await StoreClient.connect(store.addresses["data"], shm=transport == "shm")
    assert client.transport == transport
    return client


def _kv(seed: int) -> torch.Tensor:
    """One block's KV, head-major ``[layers, heads, 2, bs, hd]``, heads of very different magnitudes."""
    g = torch.Generator().manual_seed(seed)
    mags = 10.0 ** (torch.rand(LAYERS, HEADS, 2, 1, 1, generator=g) * 4 - 2)
    return torch.randn(LAYERS, HEADS, 2, BS, HD, generator=g) * mags


def _bytes(kv: torch.Tensor, encoding: str) -> bytes:
    """What a rank holding exactly ``kv``'s heads writes: plain in the model dtype, or encoded by
    itself, with the scales of its own heads only."""
    if encoding in ("int8", "fp8"):
        from mooncake_kernels.kv_codec import KVCodec
        return encode_heads(kv, KVCodec(encoding)).numpy().tobytes()
    return kv.to(getattr(torch, encoding)).contiguous().view(torch.uint8).numpy().tobytes()


def _layout(encoding: str) -> BlockLayout:
    head = encoded_head_bytes(BS, HD) if encoding in ("int8", "fp8") else \
        2 * BS * HD * torch.empty((), dtype=getattr(torch, encoding)).element_size()
    return BlockLayout(LAYERS, HEADS, head)


def _keys(tag: str) -> list[bytes]:
    return [(tag * KEY_BYTES).encode()[:KEY_BYTES - 1] + bytes([i]) for i in range(2)]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_two_slices_read_as_three_and_as_one_bit_for_bit(store, transport, encoding):
    layout, kvs = _layout(encoding), [_kv(1), _kv(2)]
    keys = _keys(f"{transport}{encoding}")
    client = await _client(store, transport)
    try:
        for rank in range(2):                 # a TP=2 prefill: each rank puts its heads, all layers
            heads = rank_heads(HEADS, 2, rank)
            slices = [_bytes(kv[:, heads.start:heads.stop], encoding) for kv in kvs]
            await client.put(keys, slices, num_layers=LAYERS, layout=layout, heads=heads)
            assert await client.match(keys) == (0 if rank == 0 else 2)   # visible only once whole
        whole = await client.get(keys)          # a TP=1 reader
        assert [bytes(w) for w in whole] == [_bytes(kv, encoding) for kv in kvs]
        for rank in range(3):                 # a TP=3 reader: its heads, all layers, then one layer
            heads = rank_heads(HEADS, 3, rank)
            got = await client.get_layers(keys, 0, LAYERS, layout=layout, heads=heads)
            assert [bytes(g) for g in got] == [_bytes(kv[:, heads.start:heads.stop], encoding) for kv in kvs]
            out = [memoryview(bytearray(layout.slice_bytes(1, heads))) for _ in keys]
            got = await client.get_layers(keys, 2, 1, out=out, layout=layout, heads=heads)
            assert got[0].obj is out[0].obj
            assert [bytes(g) for g in got] == [_bytes(kv[2:3, heads.start:heads.stop], encoding) for kv in kvs]
    finally:
        await client.close()


async def test_cpp_stages_of_tp_ranks_assemble_one_block(store):
    """Two stages (layers [0, 1) and [1, 3)) of TP=3 ranks: six slices, one block."""
    layout, kv = _layout("float32"), _kv(3)
    key = _keys("cpp")[:1]
    client = await _client(store, "tcp")
    try:
        cells = list(itertools.product([(0, 1), (1, 2)], range(3)))
        for i, ((first, count), rank) in enumerate(cells):
            heads = rank_heads(HEADS, 3, rank)
            data = _bytes(kv[first:first + count, heads.start:heads.stop], "float32")
            await client.put(key, [data], num_layers=count, first_layer=first, block_layers=LAYERS,
                             layout=layout, heads=heads)
            assert await client.match(key) == (1 if i == len(cells) - 1 else 0)
        assert bytes((await client.get(key))[0]) == _bytes(kv, "float32")
    finally:
        await client.close()


async def test_a_layout_the_store_does_not_keep_is_refused_naming_it(store):
    client = await _client(store, "tcp")
    try:
        assert client.frames.hello["kvl"] == 1
        key = _keys("vers")[:1]
        with pytest.raises(RemoteError, match="layout version 2 is not one this process reads"):
            await client.frames.request(Op.PUT, {"keys": key[0].hex(), "sizes": [96], "num_layers": 3,
                                                 "kvl": {"v": 2, "heads": 1, "rep": False}}, [bytes(96)])
        with pytest.raises(RemoteError, match="needs the block's layout"):
            await client.frames.request(Op.PUT, {"keys": key[0].hex(), "sizes": [96], "num_layers": 3,
                                                 "first_layer": 0, "block_layers": 3, "heads": [0, 1]}, [bytes(96)])
        assert await client.exists(key) == [False]
        # A replicated layout (MLA's latent) is one head every rank holds: rank 0 writes it once.
        rep = BlockLayout(LAYERS, 1, 32, is_replicated=True)
        await client.put(key, [bytes(range(96))], num_layers=LAYERS, layout=rep, heads=HeadRange(0, 1))
        assert bytes((await client.get(key))[0]) == bytes(range(96))
    finally:
        await client.close()


async def test_prefill_store_adapters_of_tp_ranks_write_and_read_at_other_degrees(store):
    """RemoteStore as a TP rank's (its layout and heads): two TP=2 ranks write back a block
    through the int8 CompressedStore, a TP=3 rank loads its heads of one layer, decoded."""
    from mooncake_kernels.kv_codec import KVCodec, decode_heads
    from mooncake_lite.prefill.remote_store import RemoteStore
    from mooncake_lite.prefill.store_io import CompressedStore
    layout, kv, key = _layout("int8"), _kv(4), _keys("adapter")[:1]
    codec = KVCodec("int8")

    def rank_store(tp: int, rank: int) -> tuple[CompressedStore, HeadRange]:
        heads = rank_heads(HEADS, tp, rank)
        inner = RemoteStore(store.addresses["data"], None, LAYERS, layout.slice_bytes(1, heads),
                            layout=layout, heads=heads)
        return CompressedStore(inner, codec, (BS, heads.num_heads, HD), torch.float32), heads

    for rank in range(2):
        writer, heads = rank_store(2, rank)
        plain = kv[:, heads.start:heads.stop].contiguous()
        await writer.put_layers(key, [memoryview(plain.view(torch.uint8).numpy())], 0, LAYERS)
        await writer.inner.close()
    reader, heads = rank_store(3, 1)
    got = (await reader.get_layers(key, 1, 1))[0]
    expected = decode_heads(encode_heads(kv[1:2], codec), (BS, HEADS, HD), codec, torch.float32)
    assert bytes(got) == expected[:, heads.start:heads.stop].contiguous().view(torch.uint8).numpy().tobytes()
    await reader.inner.close()


async def test_a_head_range_read_brings_only_those_heads_over_the_socket(store):
    """Over TCP the store sends a reader's heads of each layer, not the layer range the client
    then cut (a TP=3 rank reads a third of the bytes); a range without the blocks' layout or
    outside them is refused naming the field."""
    layout, kv, key = _layout("float32"), _kv(5), _keys("reads")[:1]
    client = await _client(store, "tcp")
    try:
        await client.put(key, [_bytes(kv, "float32")], num_layers=LAYERS, layout=layout)
        heads = rank_heads(HEADS, 3, 2)
        reply = await client.frames.request(Op.GET_LAYERS, {"keys": key[0].hex(), "first_layer": 1, "num_layers": 2,
                                                            "heads": heads.to_meta(), "kvl": layout.to_meta()})
        assert reply.meta["sizes"] == [layout.slice_bytes(2, heads)] == [2 * layout.layer_bytes // 3]
        assert bytes(reply.payload[0]) == _bytes(kv[1:3, heads.start:heads.stop], "float32")
        for meta, why in (({"heads": [0, 2]}, "needs the blocks' layout"),
                          ({"heads": [4, 7], "kvl": layout.to_meta()}, "outside a block of 6 heads"),
                          ({"heads": [0, 1], "kvl": {"v": 1, "heads": 5, "rep": False}}, "does not split into 5")):
            with pytest.raises(RemoteError, match=why):
                await client.frames.request(Op.GET_LAYERS, {"keys": key[0].hex(), "first_layer": 0,
                                                            "num_layers": 1} | meta)
    finally:
        await client.close()
