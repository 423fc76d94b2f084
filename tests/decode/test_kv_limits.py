"""The decode KV data port allocates only what a frame may legitimately carry (issue #15): a frame
is checked against the reserved request it names before any payload memory exists, so a peer
announcing gigabytes gets its connection closed, a frame for an unknown transfer is refused
without allocating, and a well-behaved prefill keeps streaming meanwhile."""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mooncake_lite.common.protocol import GenerateRequest, Sampling
from mooncake_lite.decode.batcher import DecodeBatcher
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.decode.kv_receiver import start_kv_server
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from mooncake_lite.transfer.client import FrameClient, RemoteError
from mooncake_lite.transfer.framing import HEADER, MAGIC, VERSION
from mooncake_lite.transfer.kv_stream import OP_KV_END, OP_KV_LAYER, layer_frame_meta
from mooncake_lite.transfer.server import server_address
from tests.transfer.peers import closed_within, frame

pytestmark = pytest.mark.timeout(60)

ANNOUNCED = 8 << 30    # what the bad peer announces (8 GiB)
TOKEN = "tok"


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def engine():
    runner = ModelRunner(build_model("tiny"), num_blocks=16, block_size=8)
    return DecodeEngine(runner, DecodeBatcher(runner.allocator, 8), ThreadPoolExecutor(1))


def reserve(engine: DecodeEngine, tid: str, prompt_len: int = 12) -> None:
    engine.add_request(GenerateRequest(f"r-{tid}", tid, prompt_len, Sampling(max_tokens=2)))


def kv_bytes(engine: DecodeEngine, n: int) -> bytes:
    args = engine.runner.args
    kv = torch.randn(2, n, args.num_kv_heads, args.head_dim, dtype=engine.runner.dtype)
    return kv.view(torch.uint8).numpy().tobytes()


async def stream_request(engine: DecodeEngine, client: FrameClient, tid: str, prompt_len: int = 12) -> None:
    """What a prefill does: every layer in two chunks, then END with the first token."""
    for layer in range(engine.runner.args.num_layers):
        for start, n in ((0, 5), (5, prompt_len - 5)):
            reply = await client.request(OP_KV_LAYER, layer_frame_meta(tid, layer, start, n), [kv_bytes(engine, n)])
            assert reply.meta == {"ok": True}
            await asyncio.sleep(0)
    await client.request(OP_KV_END, {"tid": tid, "first_layer": 0, "end_layer": engine.runner.args.num_layers,
                                     "first_token": 3})


async def test_a_frame_announcing_gigabytes_allocates_nothing_and_a_good_prefill_still_streams(engine, caplog):
    server = await start_kv_server(engine, "127.0.0.1", 0, TOKEN)
    host, port = server_address(server).rsplit(":", 1)
    reserve(engine, "bad")
    reserve(engine, "good")
    base = rss()
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        meta = frame(0, 1, {"token": TOKEN})
        body = b'{"tid":"bad","layer":0,"start":0,"n":8}'
        with caplog.at_level(logging.WARNING):
            writer.write(meta + HEADER.pack(MAGIC, VERSION, OP_KV_LAYER, 0, 2, len(body), ANNOUNCED) + body
                         + b"\0" * 100_000)
            good = await FrameClient.connect(host, int(port), token=TOKEN, name="prefill")
            await stream_request(engine, good, "good")
            grown = rss() - base
            assert await closed_within(reader, 3)
        writer.close()
        assert grown < 50 << 20, f"RSS grew by {grown >> 20} MiB"
        assert "good" not in engine.pending     # every layer arrived: the request joined the batch
        assert "exceeds" in caplog.text and "closing connection" in caplog.text
        await good.close()
    finally:
        server.close()


async def test_frames_are_checked_against_the_request_they_name_before_allocation(engine, caplog):
    server = await start_kv_server(engine, "127.0.0.1", 0, TOKEN)
    host, port = server_address(server).rsplit(":", 1)
    reserve(engine, "t1", prompt_len=12)
    client = await FrameClient.connect(host, int(port), token=TOKEN)
    try:
        # Unknown transfer: refused (its bytes read and dropped, never kept), the link stays up.
        with pytest.raises(RemoteError) as err:
            await client.request(OP_KV_LAYER, layer_frame_meta("nope", 0, 0, 4), [kv_bytes(engine, 4)])
        assert err.value.code == "unknown_transfer"
        # More tokens than the request's prompt, or a payload that does not match "n".
        with pytest.raises(RemoteError) as err:
            await client.request(OP_KV_LAYER, layer_frame_meta("t1", 0, 0, 13), [kv_bytes(engine, 13)])
        assert err.value.code == "bad_range"
        with pytest.raises(RemoteError) as err:
            await client.request(OP_KV_LAYER, layer_frame_meta("t1", 0, 0, 4), [kv_bytes(engine, 5)])
        assert err.value.code == "bad_payload"
        with pytest.raises(RemoteError) as err:
            await client.request(OP_KV_END, {"tid": "t1", "first_token": 1}, [b"xyz"])
        assert err.value.code == "bad_payload"
        await stream_request(engine, client, "t1")
        assert "t1" not in engine.pending
    finally:
        await client.close()
        server.close()


async def test_a_payload_larger_than_any_request_could_carry_closes_the_connection(engine, caplog):
    server = await start_kv_server(engine, "127.0.0.1", 0, TOKEN)
    host, port = server_address(server).rsplit(":", 1)
    reserve(engine, "t1")
    try:
        # The cache holds 128 tokens: a layer frame of 1000 tokens cannot be legitimate.
        client = await FrameClient.connect(host, int(port), token=TOKEN)
        with caplog.at_level(logging.WARNING), pytest.raises(ConnectionError):
            await client.request(OP_KV_LAYER, layer_frame_meta("t1", 0, 0, 1000), [kv_bytes(engine, 1000)])
        assert "exceeds" in caplog.text
        # A meta far bigger than any KV frame's, after the handshake: closed too.
        client = await FrameClient.connect(host, int(port), token=TOKEN)
        with caplog.at_level(logging.WARNING), pytest.raises(ConnectionError):
            await client.request(OP_KV_LAYER, {"tid": "t1", "pad": "x" * (200 << 10)})
        assert "meta of" in caplog.text
    finally:
        server.close()


async def test_idle_unauthenticated_connections_are_closed_cheaply(engine, caplog):
    server = await start_kv_server(engine, "127.0.0.1", 0, TOKEN, handshake_timeout=0.5)
    host, port = server_address(server).rsplit(":", 1)
    base = rss()
    peers = []
    try:
        for _ in range(100):
            peers.append(await asyncio.open_connection(host, int(port)))
        await asyncio.sleep(0.1)
        grown = rss() - base
        with caplog.at_level(logging.WARNING):
            closed = await asyncio.gather(*(closed_within(r, 3) for r, _ in peers))
        assert all(closed)
        assert grown < 10 << 20, f"RSS grew by {grown >> 20} MiB"
        assert "no handshake within 0.5s" in caplog.text
        good = await FrameClient.connect(host, int(port), token=TOKEN)
        reserve(engine, "t2")
        await stream_request(engine, good, "t2")
        await good.close()
    finally:
        for _, w in peers:
            w.close()
        server.close()
