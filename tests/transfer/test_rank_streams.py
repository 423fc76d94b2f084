"""A follower rank's own KV streams (``transfer/rank_streams.py``): frames and END on its own
connection, and a decode that stops answering fails the stream within the bound, never hangs the
rank (rank 0 waits for it under the TP group's collective timeout)."""

import asyncio
import threading
import time

import torch

from mooncake_lite.transfer.connection import FrameHandler
from mooncake_lite.transfer.framing import FLAG_REPLY
from mooncake_lite.transfer.kv_stream import OP_KV_END, OP_KV_LAYER
from mooncake_lite.transfer.rank_streams import RankStreams, Route
from mooncake_lite.transfer.server import server_address, start_server


class Decode(FrameHandler):
    """Records (op, meta) and answers, or, ``silent``, never answers."""

    def __init__(self, silent: bool):
        self.silent, self.frames = silent, []

    def frame_received(self, conn, frame):
        self.frames.append((frame.op, frame.meta, sum(v.nbytes for v in frame.payload)))
        if not self.silent:
            conn.send(frame.op, frame.request_id, {"ok": True}, flags=FLAG_REPLY)


def serve(handler: FrameHandler) -> str:
    """``handler`` on a loopback socket of its own loop thread; its address."""
    loop, ready = asyncio.new_event_loop(), threading.Event()
    address = []

    async def start():
        address.append(server_address(await start_server(handler, "127.0.0.1", 0)))
        ready.set()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(start(), loop)
    ready.wait(10)
    return address[0]


def test_a_rank_sends_its_heads_then_its_end_without_a_first_token():
    decode = Decode(silent=False)
    streams = RankStreams(None)
    route = Route("t1", serve(decode), start=5).to_json()
    kv = torch.arange(2 * 3 * 1 * 4, dtype=torch.float32).view(2, 3, 1, 4)
    streams.send(route, 0, kv, range(1, 2))
    streams.send(route, 1, kv, range(1, 2))
    assert streams.end("t1", 0, 2, within_s=10) is None
    ops = [(op, meta.get("layer"), meta.get("heads"), meta.get("start"), n) for op, meta, n in decode.frames]
    assert sorted(ops[:2]) == [(OP_KV_LAYER, 0, [1, 2], 5, kv.nbytes), (OP_KV_LAYER, 1, [1, 2], 5, kv.nbytes)]
    assert ops[2][0] == OP_KV_END and decode.frames[2][1]["first_token"] is None
    assert streams.end("t1", 0, 2, within_s=10) is None   # ended: nothing more to wait for


def test_a_decode_that_stops_answering_fails_the_stream_within_the_bound():
    decode = Decode(silent=True)
    streams = RankStreams(None, request_timeout_s=60)
    streams.send(Route("t2", serve(decode), 0).to_json(), 0, torch.zeros(2, 4, 1, 4), range(0, 1))
    t0 = time.monotonic()
    error = streams.end("t2", 0, 1, within_s=1.0)
    assert error is not None and "no answer" in error
    assert time.monotonic() - t0 < 5
