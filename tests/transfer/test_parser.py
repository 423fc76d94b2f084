"""The frame parser fed in random chunk sizes (no sockets): every split of the byte stream must
give back exactly the frames that were sent, through staged, direct and big-meta paths."""

from __future__ import annotations

import random

import pytest

from mooncake_lite.transfer.connection import STAGING_BYTES, FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import encode_frame
from tests.transfer.peers import FakeTransport


class Collect(FrameHandler):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.frames = []

    def payload_sink(self, conn, header, meta):
        if self.rng.random() < 0.3:
            return None
        cuts = sorted(self.rng.sample(range(header.payload_len + 1), k=min(3, header.payload_len + 1)))
        bounds = [0, *cuts, header.payload_len]
        return [memoryview(bytearray(b - a)) for a, b in zip(bounds, bounds[1:])]

    def frame_received(self, conn, frame) -> None:
        self.frames.append((frame.op, frame.request_id, frame.meta, frame.payload_bytes()))


@pytest.mark.parametrize("seed", range(6))
async def test_random_splits_reassemble_every_frame(seed):
    rng = random.Random(seed)
    sent, stream = [], bytearray()
    for i in range(60):
        meta_len = rng.choice([0, 10, 1000, STAGING_BYTES // 2 + rng.randrange(1, 40_000)])
        meta = {"pad": "m" * meta_len, "i": i} if meta_len else None
        payload = rng.randbytes(rng.choice([0, 1, 100, 70_000, 300_000, 1_000_000, 2_100_000]))
        parts = [payload[: len(payload) // 3], payload[len(payload) // 3:]]
        stream += b"".join(bytes(p) for p in encode_frame(i % 200, i, meta, parts))
        sent.append((i % 200, i, meta or {}, payload))
    handler = Collect(rng)
    conn = FrameConnection(handler)
    conn.connection_made(FakeTransport())
    pos = 0
    while pos < len(stream):
        buf = conn.get_buffer(-1)
        n = min(len(stream) - pos, buf.nbytes, rng.choice([1, 7, 28, 4096, 65_536, 1 << 20]))
        buf[:n] = stream[pos:pos + n]
        conn.buffer_updated(n)
        pos += n
    assert not conn.transport.closed
    assert handler.frames == sent
    assert conn.is_idle
