"""A KV peer that takes every frame and answers it: where a prefill's start-up profile streams the
KV of the chunks it times (``prefill/profiling.py``), so the price it registers holds what sending
costs.

The profile runs before any decode is known. A served chunk writes a frame per layer from the
event loop while the next layer computes, and its decode reads them on the same machine: sent to
a peer process, a 512-token chunk took 5-15% longer than sent nowhere on an Intel Xeon with 2
vCPU (docs/results/2026-12-04-xeon-2vcpu.md). This peer is a child process, as a decode is, so
its reads take a CPU and not the prefill's loop. It answers without looking at the payload:
nothing is kept.

It runs as long as its stdin is open: its parent gone, even by ``kill -9``, it exits. It listens on
127.0.0.1 only and takes only the token it was given (``MOONCAKE_SINK_TOKEN``).
"""

from __future__ import annotations

import asyncio
import os
import sys

from mooncake_lite.common.service import announce_ready, run
from mooncake_lite.transfer.connection import FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import FLAG_REPLY, Frame, Limits
from mooncake_lite.transfer.server import server_address, start_server

TOKEN_ENV = "MOONCAKE_SINK_TOKEN"
META_BYTES = 64 << 10     # a KV frame's meta is a few dozen bytes
PAYLOAD_BYTES = 1 << 30   # the largest frame it takes: a layer of a long chunk of a large model


class Sink(FrameHandler):
    """Answers every frame ``ok``; counts them (tests)."""

    def __init__(self) -> None:
        self.num_frames = 0
        self.num_bytes = 0

    def frame_received(self, conn: FrameConnection, frame: Frame) -> None:
        self.num_frames += 1
        self.num_bytes += sum(v.nbytes for v in frame.payload)
        try:
            conn.send(frame.op, frame.request_id, {"ok": True}, flags=FLAG_REPLY)
        except ConnectionError:
            pass   # the sender is gone: nothing to answer


async def start_sink(token: str | None, host: str = "127.0.0.1") -> tuple[asyncio.Server, Sink]:
    sink = Sink()
    limits = Limits(max_meta_bytes=META_BYTES, max_payload_bytes=PAYLOAD_BYTES, max_inflight_bytes=PAYLOAD_BYTES)
    return await start_server(sink, host, 0, token=token, limits=limits, name="profile"), sink


async def _serve() -> None:
    server, _ = await start_sink(os.environ.get(TOKEN_ENV))
    announce_ready("sink", data=server_address(server))
    # until the parent closes our stdin (or dies): a thread blocks on it, the loop serves
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    server.close()


if __name__ == "__main__":
    sys.exit(run(_serve))   # on uvloop, as a decode reads its frames
