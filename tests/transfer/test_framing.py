"""Framed protocol over real loopback sockets: round trips, in-place receive, bad peers."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import pytest

from mooncake_lite.transfer.client import FrameClient, RemoteError
from mooncake_lite.transfer.connection import FrameHandler
from mooncake_lite.transfer.tcp import CONGESTION_CONTROLS
from mooncake_lite.transfer.framing import (FLAG_REPLY, HEADER, MAGIC, VERSION, Frame, FrameError, Limits,
                                            decode_header, encode_frame)
from mooncake_lite.transfer.server import server_address, start_server

OP_ECHO = 7
OP_SINK = 8


class EchoHandler(FrameHandler):
    """Echoes meta and payload; OP_SINK payloads land in a preallocated arena."""

    def __init__(self) -> None:
        self.arena = bytearray(8 << 20)
        self.aborted: list[int] = []
        self.frames = 0

    def payload_sink(self, conn, header, meta):
        if header.op == OP_SINK:
            return [memoryview(self.arena)[:header.payload_len]]
        return None

    def frame_received(self, conn, frame: Frame) -> None:
        self.frames += 1
        conn.send(frame.op, frame.request_id, frame.meta, frame.payload, flags=FLAG_REPLY)

    def frame_aborted(self, conn, header, meta) -> None:
        self.aborted.append(header.request_id)


async def start(handler, **kw):
    server = await start_server(handler, "127.0.0.1", 0, **kw)
    host, port = server_address(server).rsplit(":", 1)
    return server, host, int(port)


async def test_round_trip_scatter_gather_and_sink():
    assert "uvloop" in type(asyncio.get_running_loop()).__module__
    handler = EchoHandler()
    server, host, port = await start(handler)
    client = await FrameClient.connect(host, port)
    try:
        parts = [bytes(range(256)) * 4, b"", b"x" * 300_000, bytearray(b"tail")]
        reply = await client.request(OP_ECHO, {"sizes": [len(p) for p in parts]}, [memoryview(p) for p in parts])
        assert reply.meta == {"sizes": [1024, 0, 300_000, 4]}
        assert reply.payload_bytes() == b"".join(parts)

        data = bytes((i * 7) % 251 for i in range(3_000_001))
        out_a, out_b = bytearray(1_000_000), bytearray(2_000_001)
        reply = await client.request(OP_SINK, None, [data],
                                     sink=lambda h, m: [memoryview(out_a), memoryview(out_b)])
        assert bytes(handler.arena[:len(data)]) == data  # landed in the server's arena
        assert bytes(out_a + out_b) == data  # and in the caller's buffers on the way back
        assert reply.payload[0].obj is out_a
    finally:
        await client.close()
        server.close()


async def test_many_pipelined_requests_small_and_large():
    server, host, port = await start(EchoHandler())
    client = await FrameClient.connect(host, port)
    try:
        payloads = [bytes([i]) * ((i * 9973) % 200_000) for i in range(64)]
        replies = await asyncio.gather(*(client.request(OP_ECHO, {"i": i}, [p]) for i, p in enumerate(payloads)))
        assert [r.meta["i"] for r in replies] == list(range(64))
        assert all(r.payload_bytes() == p for r, p in zip(replies, payloads))
    finally:
        await client.close()
        server.close()


async def test_large_meta_is_received():
    server, host, port = await start(EchoHandler())
    client = await FrameClient.connect(host, port)
    try:
        meta = {"keys": ["%032x" % i for i in range(20_000)]}  # ~700 KB of JSON
        reply = await client.request(OP_ECHO, meta, [b"abc"])
        assert reply.meta == meta and reply.payload_bytes() == b"abc"
    finally:
        await client.close()
        server.close()


async def raw_send(port: int, data: bytes, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 5) if read else b""
    writer.close()
    return got


def hello() -> bytes:
    return b"".join(bytes(p) for p in encode_frame(0, 1, {"token": None}))


@pytest.mark.parametrize("garbage, reason", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 40, "bad magic"),
    (HEADER.pack(MAGIC, 99, 1, 0, 1, 0, 0), "unsupported protocol version"),
    (HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 0, 1 << 40), "exceeds the limit"),
    (HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 5, 0) + b"{nope", "not valid JSON"),
    (HEADER.pack(MAGIC, VERSION, OP_ECHO, 0, 2, 2, 0) + b"[]", "must be a JSON object"),
], ids=["http", "version", "oversized", "bad-json", "json-list"])
async def test_bad_frames_close_only_that_connection(garbage, reason, caplog):
    handler = EchoHandler()
    server, host, port = await start(handler, limits=Limits(max_payload_bytes=1 << 30))
    good = await FrameClient.connect(host, port)
    try:
        prefix = b"" if reason == "bad magic" else hello()
        with caplog.at_level(logging.WARNING):
            got = await raw_send(port, prefix + garbage)
        assert reason in caplog.text
        # The bad peer saw at most its HELLO reply, then EOF.
        assert len(got) < 100
        reply = await good.request(OP_ECHO, {"still": "alive"}, [b"ok"])
        assert reply.meta == {"still": "alive"} and reply.payload_bytes() == b"ok"
    finally:
        await good.close()
        server.close()


async def test_truncated_frame_is_dropped_and_reported():
    handler = EchoHandler()
    server, host, port = await start(handler)
    try:
        header = HEADER.pack(MAGIC, VERSION, OP_SINK, 0, 42, 0, 1_000_000)
        await raw_send(port, hello() + header + b"z" * 300_000, read=False)
        for _ in range(100):
            if handler.aborted:
                break
            await asyncio.sleep(0.02)
        assert handler.aborted == [42]
        assert handler.frames == 0
        client = await FrameClient.connect(host, port)
        assert (await client.request(OP_ECHO, {}, [b"after"])).payload_bytes() == b"after"
        await client.close()
    finally:
        server.close()


async def test_cluster_token_handshake(caplog):
    handler = EchoHandler()
    server, host, port = await start(handler, token="s3cret")
    try:
        with pytest.raises(RemoteError) as err:
            await FrameClient.connect(host, port, token="wrong")
        assert err.value.code == "unauthorized" and err.value.peer == f"server {host}:{port}"
        with pytest.raises(RemoteError):
            await FrameClient.connect(host, port)
        # No handshake at all: the payload is refused before any memory is allocated.
        with caplog.at_level(logging.WARNING):
            await raw_send(port, b"".join(bytes(p) for p in encode_frame(OP_SINK, 3, None, [b"q" * 10])))
        assert "before the handshake" in caplog.text
        # Meta-only frame before the handshake: error reply, connection closed.
        got = await raw_send(port, b"".join(bytes(p) for p in encode_frame(OP_ECHO, 4, {"a": 1})))
        assert b"handshake_required" in got
        assert handler.frames == 0
        ok = await FrameClient.connect(host, port, token="s3cret")
        assert (await ok.request(OP_ECHO, {"n": 1})).meta == {"n": 1}
        await ok.close()
    finally:
        server.close()


async def test_pending_requests_fail_when_server_goes_away():
    class Silent(FrameHandler):
        def frame_received(self, conn, frame):
            conn.abort(None)

    server, host, port = await start(Silent())
    client = await FrameClient.connect(host, port)
    with pytest.raises(ConnectionError):
        await client.request(OP_ECHO, {"x": 1})
    server.close()


def test_decode_header_rejects():
    limits = Limits(max_meta_bytes=10, max_payload_bytes=100)
    with pytest.raises(FrameError, match="meta of 11 bytes"):
        decode_header(HEADER.pack(MAGIC, VERSION, 1, 0, 1, 11, 0), limits)
    h = decode_header(HEADER.pack(MAGIC, VERSION, 1, FLAG_REPLY, 5, 10, 100), limits)
    assert (h.op, h.request_id, h.meta_len, h.payload_len, h.is_reply, h.is_error) == (1, 5, 10, 100, True, False)
    with pytest.raises(struct.error):
        decode_header(b"short", limits)


def _allowed_congestion_controls() -> set[bytes]:
    """Algorithms a throwaway socket accepts here (root may pick any available one)."""
    allowed = set()
    with socket.socket() as probe:
        for name in CONGESTION_CONTROLS:
            try:
                probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name)
                allowed.add(name)
            except OSError:
                pass
    return allowed


def _congestion_control(sock) -> bytes:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\x00")


async def test_data_connections_use_an_unpaced_congestion_control():
    # BBR pacing after idle gaps halves request/reply throughput; both ends must opt out of it.
    if not hasattr(socket, "TCP_CONGESTION"):
        pytest.skip("no TCP_CONGESTION on this platform")
    allowed = _allowed_congestion_controls()
    if not allowed:
        pytest.skip("the kernel allows none of " + ", ".join(n.decode() for n in CONGESTION_CONTROLS))
    expected = next(n for n in CONGESTION_CONTROLS if n in allowed)
    handler = EchoHandler()
    seen: list = []
    handler.connection_made = lambda conn: seen.append(conn)  # type: ignore[method-assign]
    server, host, port = await start(handler)
    client = await FrameClient.connect(host, port)
    try:
        await client.request(OP_ECHO, {"x": 1})
        assert _congestion_control(client.conn.transport.get_extra_info("socket")) == expected
        assert len(seen) == 1
        assert _congestion_control(seen[0].transport.get_extra_info("socket")) == expected
    finally:
        await client.close()
        server.close()


def test_tune_socket_turns_off_nagle():
    # On a plain socket (asyncio's transports set TCP_NODELAY themselves, so a connection
    # made through them could not tell whether tune_socket did).
    from mooncake_lite.transfer.tcp import tune_socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        assert not sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        tune_socket(sock)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.parametrize("bad", ["x", ":9", "h:", "h:0", "h:65536", "h:-1", "h:p", None, 7])
def test_split_address_refuses_anything_but_host_port(bad):
    from mooncake_lite.transfer.client import split_address
    with pytest.raises(ValueError, match="must be 'host:port'"):
        split_address(bad)


def test_split_address_takes_the_last_colon_as_the_port():
    from mooncake_lite.transfer.client import split_address
    assert split_address("127.0.0.1:9") == ("127.0.0.1", 9)
    assert split_address("[::1]:8101") == ("[::1]", 8101)
