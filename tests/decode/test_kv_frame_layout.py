"""Layer frames name their KV layout version and heads (transfer/kv_stream.py): decode reads the
frames of this layout (and an older prefill's, which carried every head), refuses a frame of an
unknown version before taking its payload, and writes frames of head sub-ranges (one TP prefill
rank's each) from any number of senders at their heads' place."""

from __future__ import annotations

import pytest
import torch

from mooncake_lite.decode.kv_receiver import start_kv_server
from mooncake_lite.transfer.client import FrameClient, RemoteError
from mooncake_lite.transfer.kv_layout import LAYOUT_VERSION, HeadRange, LayoutError
from mooncake_lite.transfer.kv_stream import OP_KV_END, OP_KV_LAYER, frame_heads, layer_frame_meta
from mooncake_lite.transfer.server import server_address
from tests.decode.test_kv_limits import TOKEN, engine, kv_bytes, reserve, stream_request  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


def test_layer_frames_carry_the_version_and_the_heads_they_hold():
    meta = layer_frame_meta("t", 2, 0, 5)
    assert meta["kvl"] == LAYOUT_VERSION and "heads" not in meta and frame_heads(meta, 4) == HeadRange(0, 4)
    meta = layer_frame_meta("t", 2, 0, 5, HeadRange(1, 3))
    assert meta["heads"] == [1, 3] and frame_heads(meta, 4) == HeadRange(1, 3)
    assert frame_heads({"tid": "t"}, 3) == HeadRange(0, 3)       # an older prefill's frame
    with pytest.raises(LayoutError, match="version 7"):
        frame_heads({"kvl": 7}, 4)
    with pytest.raises(LayoutError, match="outside a block of 4 heads"):
        frame_heads({"kvl": 1, "heads": [2, 6]}, 4)


async def test_decode_refuses_an_unknown_version_then_streams_on(engine):
    eng = engine
    server = await start_kv_server(eng, "127.0.0.1", 0, TOKEN)
    host, port = server_address(server).rsplit(":", 1)
    reserve(eng, "t1")
    client = await FrameClient.connect(host, int(port), token=TOKEN)
    try:
        with pytest.raises(RemoteError) as err:
            await client.request(OP_KV_LAYER, {**layer_frame_meta("t1", 0, 0, 4), "kvl": 2}, [kv_bytes(eng, 4)])
        assert err.value.code == "bad_layout"
        await stream_request(eng, client, "t1")      # nothing of the refused frame was taken
        assert "t1" not in eng.pending
    finally:
        await client.close()
        server.close()


async def test_head_slices_from_two_senders_are_written_at_their_heads_and_join_once_whole(engine):
    """Two connections (two TP prefill ranks) each send one KV head of every layer: the request
    joins only when both are in, the cache holds each head where it belongs, and a head sent
    twice or a payload of the wrong width is refused."""
    eng, prompt = engine, 12
    args = eng.runner.args
    assert args.num_kv_heads == 2
    server = await start_kv_server(eng, "127.0.0.1", 0, TOKEN)
    host, port = server_address(server).rsplit(":", 1)
    reserve(eng, "t1", prompt)
    slots = torch.as_tensor(eng.pending["t1"].seq.block_ids)
    slots = (slots[:, None] * eng.runner.block_size + torch.arange(eng.runner.block_size)).reshape(-1)[:prompt]
    kv = torch.randn(args.num_layers, 2, prompt, 2, args.head_dim, dtype=eng.runner.dtype)
    ranks = [await FrameClient.connect(host, int(port), token=TOKEN) for _ in range(2)]
    try:
        for head, client in enumerate(ranks):
            for layer in range(args.num_layers):
                part = kv[layer, :, :, head:head + 1].contiguous()
                meta = layer_frame_meta("t1", layer, 0, prompt, HeadRange(head, head + 1))
                reply = await client.request(OP_KV_LAYER, meta, [part.view(torch.uint8).numpy().tobytes()])
                assert reply.meta == {"ok": True}
            if head == 0:
                with pytest.raises(RemoteError) as err:   # head 0 again
                    await client.request(OP_KV_LAYER, layer_frame_meta("t1", 0, 0, 1, HeadRange(0, 1)),
                                         [kv[0, :, :1, :1].contiguous().view(torch.uint8).numpy().tobytes()])
                assert err.value.code == "duplicate"
                with pytest.raises(RemoteError) as err:   # one head's frame carrying two heads' bytes
                    await client.request(OP_KV_LAYER, layer_frame_meta("t1", 0, 0, 1, HeadRange(1, 2)),
                                         [kv_bytes(eng, 1)])
                assert err.value.code == "bad_payload"
                await client.request(OP_KV_END, {"tid": "t1", "first_layer": 0, "end_layer": args.num_layers,
                                                 "first_token": None})
                assert "t1" in eng.pending and eng.pending["t1"].progress() == f"0 of {args.num_layers} layers complete"
        await ranks[1].request(OP_KV_END, {"tid": "t1", "first_layer": 0, "end_layer": args.num_layers,
                                           "first_token": 3})   # the last sender carries token 1
        assert "t1" not in eng.pending          # joined
        for layer in range(args.num_layers):    # every head at its place, bit for bit
            assert torch.equal(eng.runner.gather_kv(layer, slots), kv[layer])
    finally:
        for client in ranks:
            await client.close()
        server.close()
