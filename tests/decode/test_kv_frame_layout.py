"""Layer frames name their KV layout version and heads (transfer/kv_stream.py): decode reads the
frames of this layout (and an older prefill's, which carried every head), and refuses a frame of
an unknown version or of a head range it cannot place, before taking its payload."""

from __future__ import annotations

import pytest

from mooncake_lite.decode.kv_receiver import start_kv_server
from mooncake_lite.transfer.client import FrameClient, RemoteError
from mooncake_lite.transfer.kv_layout import LAYOUT_VERSION, HeadRange, LayoutError
from mooncake_lite.transfer.kv_stream import OP_KV_LAYER, frame_heads, layer_frame_meta
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


async def test_decode_refuses_an_unknown_version_and_a_sub_range_then_streams_on(engine):
    eng = engine
    server = await start_kv_server(eng, "127.0.0.1", 0, TOKEN)
    host, port = server_address(server).rsplit(":", 1)
    reserve(eng, "t1")
    client = await FrameClient.connect(host, int(port), token=TOKEN)
    try:
        for meta in ({**layer_frame_meta("t1", 0, 0, 4), "kvl": 2},
                     layer_frame_meta("t1", 0, 0, 4, HeadRange(0, 1))):
            with pytest.raises(RemoteError) as err:
                await client.request(OP_KV_LAYER, meta, [kv_bytes(eng, 4)])
            assert err.value.code == "bad_layout"
        await stream_request(eng, client, "t1")      # nothing of the refused frames was taken
        assert "t1" not in eng.pending
    finally:
        await client.close()
        server.close()
