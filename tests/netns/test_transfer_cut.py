"""Issue #16 item 5, the data plane: a transfer to or from a store whose node is cut off must fail
within a bounded time with an error, never hang. Two stores on two nodes (no model: fast)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from mooncake_lite.cluster.netns import Link, Nodes
from mooncake_lite.store.client import NoAnswer, RemoteError, StoreClient
from tests.netns.conftest import needs_netns

pytestmark = [needs_netns, pytest.mark.timeout(120)]
BOUND = 5.0    # seconds: far beyond a round trip on a 1 Gbit link; a transfer still open is hung
DEADLINE = 3.0  # the clients' request deadline (the store's pull gets 0.8 of it): within BOUND


def _store(nodes: Nodes, i: int):
    node = nodes[i]
    return nodes.start(node, f"store-{node.name}", [sys.executable, "-m", "mooncake_lite", "--role", "store",
                                                   "--host", node.address, "--dram", "64MiB", "--slot-bytes", "1MiB",
                                                   "--drain-timeout", "1s"])


def test_replicating_from_a_cut_store_fails_within_a_bound():
    with Nodes.create(2, Link.parse("1gbit")) as nodes:
        near, far = _store(nodes, 0), _store(nodes, 1)

        async def run() -> None:
            here = await StoreClient.connect(near.addresses["data"], shm=False, timeout=DEADLINE)
            there = await StoreClient.connect(far.addresses["data"], shm=False, timeout=DEADLINE)
            keys = [os.urandom(16) for _ in range(4)]
            await there.put(keys, [bytes(1 << 20)] * 4)
            assert (await here.replicate(keys[:2], far.addresses["data"]))["num_copied"] == 2   # the link works
            nodes.cut(nodes[1])
            with pytest.raises(RemoteError) as err:   # the store's error reply, not our own deadline
                await asyncio.wait_for(here.replicate(keys[2:], far.addresses["data"]), BOUND)
            assert err.value.code == "peer_error" and far.addresses["data"] in err.value.message
            with pytest.raises(NoAnswer, match=f"store {far.addresses['data']} get: no answer"):
                await asyncio.wait_for(there.get(keys[:1]), BOUND)   # our own read from it: bounded too
            await asyncio.wait_for(there.close(), BOUND)             # and so is closing towards it
            await here.close()

        asyncio.run(run())
