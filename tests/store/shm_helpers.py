"""What the same-node fast path's tests share: the store they run against (its flags; started
once for them by ``shm_store`` in ``conftest.py``) and checks on a client's traffic and leases."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_lite.store.client import StoreClient
from mooncake_lite.transfer import shm
from tests.store.helpers import metric

SLOT = 256 << 10
TOKEN = "s3cret"
needs_shm = pytest.mark.skipif(not shm.is_supported(), reason="no memfd_create or /proc here")
# 16 slots, a 1 MiB staging area, leases that run out quickly.
STORE_ARGS = ("--port", "0", "--data-port", "0", "--dram", "4MiB", "--slot-bytes", "256KiB",
              "--shm-staging", "1MiB", "--lease-ttl", "1s", "--cluster-token", TOKEN)


def no_socket_bytes(client: StoreClient) -> None:
    """Make any block bytes on the socket fail the test."""
    async def refuse(*args, **kwargs):
        raise AssertionError("block bytes went over TCP")
    client._read_batch_tcp = refuse   # type: ignore[method-assign]
    request = client.frames.request

    async def checked(op, meta=None, payload=(), sink=None):
        assert not payload, "a put sent its blocks on the socket"
        return await request(op, meta, payload, sink)
    client.frames.request = checked   # type: ignore[method-assign]


async def leases_all_ended(store) -> None:
    """Wait (2 s at most) for the store to end every lease, then check it did."""
    for _ in range(100):
        if metric("http://" + store.addresses["http"], "mooncake_store_leases") == 0:
            break
        await asyncio.sleep(0.02)
    assert metric("http://" + store.addresses["http"], "mooncake_store_leases") == 0
