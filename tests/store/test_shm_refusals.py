"""What the same-node fast path refuses, against a real store process: an offer that is not
this node's store's falls back to TCP, the token is still required, staged offsets outside the
staging area are bad requests, the slab is read-only to clients."""

from __future__ import annotations

import asyncio
import os

import pytest

from mooncake_lite.store import shm_client
from mooncake_lite.store.client import RemoteError, StoreClient
from mooncake_lite.store.protocol import Op, keys_to_hex
from mooncake_lite.transfer import shm
from mooncake_lite.transfer.client import FrameClient
from mooncake_lite.transfer.framing import HEADER_BYTES, Limits, decode_header, encode_frame
from tests.store.helpers import chain
from tests.store.shm_helpers import TOKEN, needs_shm

pytestmark = needs_shm


async def test_tcp_fallback_when_shm_is_refused(shm_store, role_procs, monkeypatch):
    address = shm_store.addresses["data"]
    off = role_procs("store", "--port", "0", "--data-port", "0", "--dram", "1MiB", "--slot-bytes", "256KiB",
                     "--shm", "off")
    keys, data = chain(2, seed=6), [b"x" * 5000, b"y" * 7]
    client = await StoreClient.connect(off.addresses["data"])
    assert "shm" not in client.frames.hello and client.transport == "tcp"
    assert await client.put(keys, data) == 2 and [bytes(g) for g in await client.get(keys)] == data
    await client.close()

    async def offer_with(**changes):
        frames = await FrameClient.connect(*address.rsplit(":", 1), token=TOKEN)
        frames.hello["shm"] = {**frames.hello["shm"], **changes}
        try:
            return await shm_client.attach(frames)
        finally:
            await frames.close()
    assert (await offer_with()).fast is not None   # the untouched offer is usable here
    for other_layout in (True, 3):   # a store whose single-block channel speaks another layout
        assert (await offer_with(fast=other_layout)).fast is None
    assert await offer_with(nonce="00" * 16) is None   # not the memory the store announced
    assert await offer_with(fd=10_000) is None          # cannot be opened
    assert await offer_with(pid=(1 << 22) + 1) is None  # no such process
    assert await offer_with(host="another-node") is None
    monkeypatch.setattr(shm, "host_identity", lambda: "other/boot/netns")   # another node
    client = await StoreClient.connect(address, token=TOKEN)
    assert client.transport == "tcp"
    assert await client.put(keys, data) == 2 and [bytes(g) for g in await client.get(keys)] == data
    await client.close()


async def test_auth_still_required(shm_store):
    address = shm_store.addresses["data"]
    with pytest.raises(RemoteError) as err:
        await StoreClient.connect(address, token="wrong")
    assert err.value.code == "unauthorized"
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"".join(bytes(p) for p in encode_frame(Op.SHM_ATTACH, 1, {})))
    header = decode_header(await reader.readexactly(HEADER_BYTES), Limits())
    meta = await reader.readexactly(header.meta_len)
    assert header.is_error and b"handshake_required" in meta and b"fd" not in meta
    writer.close()
    with pytest.raises(RemoteError) as err:
        await FrameClient.connect(host, int(port), token=None)
    assert err.value.code == "unauthorized"


async def test_staging_bounds_and_read_only_slab(shm_store):
    client = await StoreClient.connect(shm_store.addresses["data"], token=TOKEN)
    area = client.shm.staging.size
    keys = chain(2, seed=7)

    async def staged(offsets, sizes=(100, 100), payload=(), op=Op.PUT):
        meta = {"keys": keys_to_hex(keys[:len(sizes)]), "sizes": list(sizes), "staged": offsets}
        return await client.frames.request(op, meta, payload)
    hostile = [[area - 50, 0], [-1, 0], [0, area], [2 ** 62, 0], ["0", 0], [True, 0], [0], [0, 0, 0], None, 7]
    try:
        for offsets in hostile:
            with pytest.raises(RemoteError) as err:
                await staged(offsets)
            assert err.value.code == "bad_request", offsets
        with pytest.raises(RemoteError, match="no payload"):
            await staged([0, 200], payload=[b"z" * 200])
        with pytest.raises(RemoteError, match="already"):
            await client.frames.request(Op.SHM_ATTACH, {})
        assert await client.exists(keys) == [False, False]   # nothing refused was stored
        client.shm.staging.mapping.view[area - 200:area] = b"q" * 200
        assert (await staged([area - 200, area - 100])).meta["num_new"] == 2   # the last byte is fine
        assert [bytes(g) for g in await client.get(keys)] == [b"q" * 100] * 2
        # The slab cannot be mapped writable nor written, even through its descriptor.
        offer = client.frames.hello["shm"]
        with pytest.raises(shm.ShmError):
            shm.open_offer(offer, writable=True)
        fd = os.open(f"/proc/{offer['pid']}/fd/{offer['fd']}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"!", offer["slab_offset"])
        finally:
            os.close(fd)
        # A client without a staging area (TCP) cannot send a staged put either.
        tcp = await StoreClient.connect(shm_store.addresses["data"], token=TOKEN, shm=False)
        with pytest.raises(RemoteError, match="staging area"):
            await tcp.frames.request(Op.PUT, {"keys": keys_to_hex(keys[:1]), "sizes": [1], "staged": [0]})
        await tcp.close()
    finally:
        await client.close()
