"""Bounded memory per peer and timeouts on every framed connection (issue #15, findings 1, 2, 7):
a tiny meta and no payload before HELLO, a handshake deadline, a stall timeout on half-received
frames, a per-server in-flight budget, and a fuzz of the parser that never raises anything but
FrameError nor allocates beyond its bounds."""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_lite.transfer.client import FrameClient
from mooncake_lite.transfer.connection import STAGING_BYTES, FrameConnection, FrameHandler
from mooncake_lite.transfer.framing import (FLAG_REPLY, HEADER, HEADER_BYTES, MAGIC, VERSION, Frame, FrameError,
                                            Limits, decode_header)
from mooncake_lite.transfer.server import AuthGate, server_address, start_server
from tests.transfer.peers import FakeTransport, closed_within, frame

pytestmark = pytest.mark.timeout(60)

OP_ECHO = 7


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Echo(FrameHandler):
    def __init__(self) -> None:
        self.frames = 0

    def frame_received(self, conn, frame: Frame) -> None:
        self.frames += 1
        conn.send(frame.op, frame.request_id, frame.meta, frame.payload, flags=FLAG_REPLY)


async def start(handler, **kw):
    server = await start_server(handler, "127.0.0.1", 0, **kw)
    host, port = server_address(server).rsplit(":", 1)
    return server, host, int(port)


async def test_big_metas_before_hello_cost_nothing_and_idle_peers_are_cut_at_the_handshake_deadline(caplog):
    server, host, port = await start(Echo(), token="tok", limits=Limits(handshake_timeout=0.5))
    base = rss()
    peers = []
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(100):
                reader, writer = await asyncio.open_connection(host, port)
                # Announce a 4 MiB meta (the old pre-HELLO limit) and send a little of it.
                writer.write(HEADER.pack(MAGIC, VERSION, 0, 0, 1, 4 << 20, 0) + b'{"token": "')
                peers.append((reader, writer))
            await asyncio.sleep(0.1)
            grown = rss() - base
            good = await FrameClient.connect(host, port, token="tok")   # still served meanwhile
            assert (await good.request(OP_ECHO, {"ok": 1})).meta == {"ok": 1}
            closed = await asyncio.gather(*(closed_within(r, 3) for r, _ in peers))
        assert grown < 10 << 20, f"100 pre-HELLO peers grew RSS by {grown >> 20} MiB"
        assert all(closed)
        assert "meta" in caplog.text and "before the handshake" in caplog.text
        # A peer that sends nothing at all is cut at the handshake deadline.
        reader, writer = await asyncio.open_connection(host, port)
        with caplog.at_level(logging.WARNING):
            assert await closed_within(reader, 3)
        assert "no handshake within 0.5s" in caplog.text
        writer.close()
        assert (await good.request(OP_ECHO, {"ok": 2})).meta == {"ok": 2}   # authenticated: kept
        await good.close()
    finally:
        for _, writer in peers:
            writer.close()
        server.close()


async def test_hello_with_payload_or_slow_hello_is_refused(caplog):
    server, host, port = await start(Echo(), limits=Limits(handshake_timeout=0.5))
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(HEADER.pack(MAGIC, VERSION, 0, 0, 1, 0, 1 << 30))   # HELLO announcing 1 GiB
        with caplog.at_level(logging.WARNING):
            assert await closed_within(reader, 2)
        assert "payload sent before the handshake" in caplog.text
        writer.close()
        # Dripping a HELLO byte by byte does not extend the deadline.
        reader, writer = await asyncio.open_connection(host, port)
        hello = frame(0, 1, {"token": None})
        t0 = asyncio.get_running_loop().time()
        for byte in hello[:20]:
            if reader.at_eof() or writer.is_closing():
                break
            try:
                writer.write(bytes([byte]))
            except (RuntimeError, ConnectionError):
                break
            await asyncio.sleep(0.05)
        assert await closed_within(reader, 2)
        assert asyncio.get_running_loop().time() - t0 < 2
        writer.close()
    finally:
        server.close()


async def test_a_stalled_frame_is_cut_and_well_behaved_clients_keep_going(caplog):
    server, host, port = await start(Echo(), limits=Limits(stall_timeout=0.4))
    good = await FrameClient.connect(host, port)
    try:
        stalled = []
        for partial in (HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 0, 1000)[:10],       # half a header
                        HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 100, 0) + b'{"a":',   # half a meta
                        HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 0, 100_000) + b"x" * 5000):  # half a body
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(frame(0, 1, {"token": None}) + partial)
            stalled.append((reader, writer))
        # The good client keeps being served while the others stall, and its own idle gaps
        # (nothing half-received) are not stalls.
        for i in range(3):
            assert (await good.request(OP_ECHO, {"i": i}, [b"p" * 70_000])).payload_bytes() == b"p" * 70_000
            await asyncio.sleep(0.25)
        with caplog.at_level(logging.WARNING):
            closed = await asyncio.gather(*(closed_within(r, 3) for r, _ in stalled))
        assert all(closed)
        assert "stalled" in caplog.text
        await asyncio.sleep(0.5)
        assert (await good.request(OP_ECHO, {"after": 1})).meta == {"after": 1}
    finally:
        for _, writer in stalled:
            writer.close()
        await good.close()
        server.close()


async def test_a_slow_but_moving_body_is_not_a_stall():
    server, host, port = await start(Echo(), limits=Limits(stall_timeout=0.3))
    try:
        reader, writer = await asyncio.open_connection(host, port)
        body = b"y" * 10
        writer.write(frame(0, 1, {"token": None}) + HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 0, len(body)))
        for byte in body:      # 10 bytes over ~1 s: each gap is under the stall timeout
            await asyncio.sleep(0.1)
            writer.write(bytes([byte]))
        got = b""
        while not got.endswith(body):
            chunk = await asyncio.wait_for(reader.read(65536), 2)
            assert chunk, "closed"
            got += chunk
        assert got.endswith(body)
        writer.close()
    finally:
        server.close()


async def test_the_in_flight_budget_closes_the_connection_that_would_exceed_it(caplog):
    handler = Echo()
    server, host, port = await start(handler, limits=Limits(max_inflight_bytes=1 << 20))
    try:
        first_r, first_w = await asyncio.open_connection(host, port)
        first_w.write(frame(0, 1, {"token": None}) + HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 0, 700_000)
                      + b"a" * 1000)
        await asyncio.sleep(0.1)
        second_r, second_w = await asyncio.open_connection(host, port)
        with caplog.at_level(logging.WARNING):
            second_w.write(frame(0, 1, {"token": None}) + HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 0, 700_000))
            assert await closed_within(second_r, 2)
        assert "in-flight budget" in caplog.text
        # The first one finishes its frame and is answered; then the budget is free again.
        first_w.write(b"a" * 699_000)
        got = b""
        while len(got) < 700_000:
            chunk = await asyncio.wait_for(first_r.read(1 << 20), 2)
            assert chunk
            got += chunk
        client = await FrameClient.connect(host, port)
        assert (await client.request(OP_ECHO, {}, [b"b" * 700_000])).payload_bytes() == b"b" * 700_000
        await client.close()
        first_w.close()
        second_w.close()
    finally:
        server.close()


async def test_idle_timeout_closes_only_idle_authenticated_connections(caplog):
    server, host, port = await start(Echo(), limits=Limits(idle_timeout=0.4))
    try:
        idle = await FrameClient.connect(host, port)
        busy = await FrameClient.connect(host, port)
        with caplog.at_level(logging.WARNING):
            for i in range(8):      # one request every 0.1 s keeps a connection open
                assert (await busy.request(OP_ECHO, {"i": i})).meta == {"i": i}
                await asyncio.sleep(0.1)
        assert idle.is_closed and not busy.is_closed
        assert "idle for 0.4s" in caplog.text
        again = await FrameClient.connect(host, port)   # a client just dials again
        assert (await again.request(OP_ECHO, {"x": 1})).meta == {"x": 1}
        for client in (busy, again):
            await client.close()
    finally:
        server.close()


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError):
        Limits(hello_meta_bytes=-1)
    with pytest.raises(ValueError):
        Limits(handshake_timeout=0)
    with pytest.raises(ValueError):
        Limits(max_inflight_bytes=0)


# ---- the parser fuzzed, no sockets ---------------------------------------------------------------


FUZZ_LIMITS = Limits(max_meta_bytes=200_000, max_payload_bytes=3 << 20, hello_meta_bytes=4096,
                     handshake_timeout=None, stall_timeout=None, max_inflight_bytes=4 << 20)
HEADERS = st.builds(
    lambda magic, version, op, flags, rid, meta_len, payload_len: HEADER.pack(
        magic, version, op, flags, rid, meta_len, payload_len),
    st.sampled_from([MAGIC, MAGIC, MAGIC, b"MCKX", b"\x00\x00\x00\x00"]),
    st.sampled_from([VERSION, VERSION, VERSION, 0, 2, 255]),
    st.integers(0, 255), st.integers(0, 0xFFFF), st.integers(0, 2**64 - 1),
    st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1), st.sampled_from([4096, 4097, 200_000, 200_001])),
    st.one_of(st.integers(0, 5000), st.integers(0, 2**64 - 1), st.sampled_from([3 << 20, (3 << 20) + 1])))
CHUNKS = st.lists(st.one_of(HEADERS, st.binary(max_size=300), st.just(frame(0, 1, {"token": None}))),
                  min_size=1, max_size=8)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES))
def test_decode_header_raises_only_frame_error_and_returns_only_what_the_limits_allow(data):
    for authenticated in (True, False):
        try:
            header = decode_header(data, FUZZ_LIMITS, authenticated=authenticated)
        except FrameError:
            continue
        meta_cap = FUZZ_LIMITS.max_meta_bytes if authenticated else FUZZ_LIMITS.hello_meta_bytes
        assert header.meta_len <= meta_cap
        assert header.payload_len <= (FUZZ_LIMITS.max_payload_bytes if authenticated else 0)


async def test_the_parser_fuzzed_never_raises_nor_allocates_beyond_its_bounds(caplog):
    """Random headers, bytes and HELLOs, fed in random splits to a server-side connection (behind
    the real AuthGate) and a client-side one: the only way out is a protocol error, and the
    memory it allocates stays under staging + meta + payload bounds."""
    bound = STAGING_BYTES + FUZZ_LIMITS.max_meta_bytes + FUZZ_LIMITS.max_payload_bytes + (256 << 10)
    peaks = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(CHUNKS, st.lists(st.integers(1, 70_000), min_size=1, max_size=6), st.booleans())
    def fuzz(chunks, splits, server_side):
        stream = b"".join(chunks)
        if server_side:
            conn = FrameConnection(AuthGate(Echo(), None), FUZZ_LIMITS, authenticated=False)
        else:
            conn = FrameConnection(Echo(), FUZZ_LIMITS)
        transport = FakeTransport()
        tracemalloc.start()
        try:
            conn.connection_made(transport)
            pos, i = 0, 0
            while pos < len(stream) and not transport.closed:
                buf = conn.get_buffer(-1)
                n = min(len(stream) - pos, buf.nbytes, splits[i % len(splits)])
                buf[:n] = stream[pos:pos + n]
                conn.buffer_updated(n)
                pos += n
                i += 1
            conn.connection_lost(None)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()

    with caplog.at_level(logging.WARNING, logger="mooncake_lite.transfer.connection"):
        fuzz()
    assert max(peaks) < bound, f"peak {max(peaks)} over {bound}"
    # Every close was a protocol error, a peer dying mid-frame, or the auth gate refusing a
    # peer that skipped or failed its HELLO; never a crash in our code.
    assert "handler failed" not in caplog.text and "Traceback" not in caplog.text
    clean = ("protocol error", "mid-frame", "over the in-flight budget", "before the handshake",
             "wrong or missing cluster token")
    for record in caplog.records:
        assert any(reason in record.getMessage() for reason in clean), record.getMessage()


def test_struct_layout_unchanged():
    assert HEADER_BYTES == 28 and struct.calcsize("<4sBBHQIQ") == 28
