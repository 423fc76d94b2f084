"""Issue #16 item 5: a peer that stops answering (its node cut off: no reset, no FIN, nothing)
ends a connect, a request, a KV stream and a close within a bounded time, with an error naming
the peer and the op, never a hang. The peer here is a raw socket that goes mute."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from mooncake_lite.prefill.kv_sender import DecodeLinks, KVSender
from mooncake_lite.transfer.client import FrameClient, NoAnswer
from mooncake_lite.transfer.framing import FLAG_REPLY, OP_HELLO, encode_frame

pytestmark = pytest.mark.timeout(30)


class MutePeer:
    """A server that answers the HELLO (when ``hello``) and then nothing. With ``read=False`` it
    stops reading too, so a client's send buffer fills up as towards a cut link."""

    def __init__(self, *, hello: bool = True, read: bool = True) -> None:
        self.hello, self.read = hello, read
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> MutePeer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=1 << 16)
        self.port = self.server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        if self.hello:
            await reader.read(1 << 12)   # the client's HELLO (request id 1), one small frame
            writer.writelines(encode_frame(OP_HELLO, 1, {"ok": True}, flags=FLAG_REPLY))
        if not self.read:
            writer.transport.pause_reading()
            return
        while await reader.read(1 << 16):
            pass


async def test_a_handshake_without_answer_ends_naming_the_peer():
    async with MutePeer(hello=False) as peer:
        start = time.monotonic()
        with pytest.raises(NoAnswer) as err:
            await FrameClient.connect("127.0.0.1", peer.port, timeout=0.3, label=f"decode {peer.address}")
        assert str(err.value) == f"decode {peer.address} hello: no answer in 0.3 s"
        assert isinstance(err.value, OSError)          # callers falling back on a lost peer catch it
        assert time.monotonic() - start < 10


async def test_a_request_without_answer_ends_and_the_connection_stays_usable():
    async with MutePeer() as peer:
        client = await FrameClient.connect("127.0.0.1", peer.port)
        client.request_timeout = 0.2
        try:
            with pytest.raises(NoAnswer, match=rf"server {peer.address} get_layers: no answer in 0.2 s"):
                await client.request(7, {"keys": ""}, what="get_layers")
            with pytest.raises(NoAnswer, match=r"op 9: no answer in 0.1 s"):   # an explicit deadline wins
                await client.request(9, {}, timeout=0.1)
            assert not client.is_closed
        finally:
            await client.close()


async def test_a_kv_stream_to_a_mute_decode_fails_naming_it():
    async with MutePeer() as peer:
        links = DecodeLinks(None, connect_timeout_s=1.0, request_timeout_s=0.3)
        client = await links.get(peer.address)
        sender = KVSender(client, "t1")
        for layer in range(3):
            sender.send_layer(layer, 0, torch.zeros(2, 4, 2, 8))
        with pytest.raises(ConnectionError) as err:
            await sender.end(0, 3, first_token=5)
        assert f"decode {peer.address} kv_layer: no answer in 0.3 s" in str(err.value)
        assert client.is_closed               # dropped: the next request to that decode dials afresh
        assert (await links.get(peer.address)) is not client
        await links.close()


async def test_closing_towards_a_peer_that_reads_nothing_is_bounded():
    async with MutePeer(read=False) as peer:
        client = await FrameClient.connect("127.0.0.1", peer.port)
        client.request_timeout = 0.2
        with pytest.raises(NoAnswer):   # 64 MiB cannot all go out: the wait for room counts too
            await client.request(1, {}, [bytes(64 << 20)], what="put")
        start = time.monotonic()
        await client.close(timeout=0.2)
        assert client.is_closed and time.monotonic() - start < 10
