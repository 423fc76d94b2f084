"""Hot blocks are copied in the background (issue #16 item 4): an in-process conductor with fake
prefill/decode instances and two real stores. Requests that keep reusing one prefix on one prefill
make the conductor copy it to the other prefill's store, so a later request there is a local hit
instead of a critical-path migration; a target store that cannot be reached is counted and
logged once."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.conductor.cluster.hot_replication import HOT as HOT_REPLICATION
from mooncake_lite.store.app import DATA
from mooncake_lite.store.app import make_app as store_app
from mooncake_lite.store.client import StoreClient
from mooncake_lite.store.config import Config as StoreConfig
from tests.conductor.fakes import KV_BYTES
from tests.conductor.test_api import TOK, client
from tests.store.helpers import block

pytestmark = pytest.mark.timeout(60)
PROMPT = "0123456789abcdefghij"     # 5 blocks of 4 tokens
BLOCK_BYTES = 4 * KV_BYTES          # what the conductor prices a tiny block at
HOT = {"hot_threshold": 3, "hot_replication_period": 0.05}


async def _store(aiohttp_server, conductor_url: str) -> str:
    """A real store (in process) posting its block events to the conductor; its data address."""
    app = store_app(StoreConfig(port=0, data_port=0, dram=1 << 20, slot_bytes=8192, pin_memory=False,
                                conductor=conductor_url, event_interval=0.05))
    await aiohttp_server(app)
    return app[DATA].address


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _ask(c) -> tuple[str, str]:
    raw = await c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2)
    return raw.headers["X-Mooncake-Prefill"], raw.headers["X-Mooncake-Route"]


async def _metrics(cluster) -> dict[str, float]:
    async with cluster.session.get(cluster.url + "/metrics") as resp:
        text = await resp.text()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("mooncake_conductor_hot_") and "_created" not in line}


async def _cluster_with_prefix(make_cluster, aiohttp_server, share: float, other_store: str | None):
    """p0 over store A holding the prompt's 5 blocks, p1 over ``other_store`` (None: a real store B)."""
    cluster = await make_cluster(prefill=0, decode=1, hot_replication_share=share, **HOT)
    a = await _store(aiohttp_server, cluster.url)
    b = other_store or await _store(aiohttp_server, cluster.url)
    await cluster.add("prefill", "p0", store=a)
    await cluster.add("prefill", "p1", store=b)
    keys = prefix_hash(TOK.encode(PROMPT), 4, 0)
    data = [block(k, BLOCK_BYTES) for k in keys]
    writer = await StoreClient.connect(a, shm=False)
    await writer.put(keys, data, num_layers=4)
    await writer.close()
    index = cluster.svc.scheduler.index
    await _until(lambda: index.prefix_len(keys, a) == len(keys), "store A's blocks in the index")
    return cluster, a, b, keys, data


@pytest.mark.parametrize("share", [0.1, 0.0])
async def test_a_hot_prefix_is_copied_to_the_other_prefill_before_it_is_needed(make_cluster, aiohttp_server,
                                                                               share):
    cluster, a, b, keys, data = await _cluster_with_prefix(make_cluster, aiohttp_server, share, None)
    index, c, links = cluster.svc.scheduler.index, client(cluster), cluster.svc.scheduler.costs.links
    links.min_bytes = 1                                     # time even this small copy
    for _ in range(HOT["hot_threshold"]):                   # the prefix gets hot, served on p0
        assert await _ask(c) == ("p0", "local-hit")
    if share:
        await _until(lambda: index.prefix_len(keys, b) == len(keys), "store B to report the copied blocks")
        reader = await StoreClient.connect(b, shm=False)
        assert [bytes(x) for x in await reader.get(keys)] == data
        await reader.close()
        m = await _metrics(cluster)
        assert m['mooncake_conductor_hot_replications_total{outcome="ok"}'] >= 1
        assert m["mooncake_conductor_hot_replicated_bytes_total"] == len(keys) * BLOCK_BYTES
        assert m["mooncake_conductor_hot_blocks"] == len(keys)
        assert links.bandwidth(a, b) > 0                    # the timed copy measured the A -> B link
    else:                                                   # off: no loop, nothing copied
        await asyncio.sleep(0.2)
        assert index.prefix_len(keys, b) == 0
        assert await _metrics(cluster) == {"mooncake_conductor_hot_blocks": 0.0,
                                           "mooncake_conductor_hot_replicated_bytes_total": 0.0}
    # p0 goes away (suspect: its heartbeats stop, a connection to it failed); p1 serves the prefix
    cluster.instances["p0"].is_heartbeating = False
    await asyncio.sleep(0.2)     # a heartbeat of p0's already on its way must land first: it would trust p0 again
    cluster.svc.membership.connection_failed("p0", "the test cut it off")
    assert await _ask(c) == ("p1", "local-hit" if share else "transfer")
    assert cluster.instances["p1"].requests[-1].migrate_from == (None if share else a)
    await c.close()


async def test_a_target_store_that_cannot_be_reached_is_counted_and_logged_once(make_cluster, aiohttp_server,
                                                                                caplog):
    caplog.set_level(logging.WARNING, "mooncake_lite.conductor.cluster.hot_replication")
    cluster, a, b, _, _ = await _cluster_with_prefix(make_cluster, aiohttp_server, 0.1, "127.0.0.1:1")
    c = client(cluster)
    for _ in range(HOT["hot_threshold"]):
        assert await _ask(c) == ("p0", "local-hit")
    hot = cluster.app[HOT_REPLICATION]
    failed = 'mooncake_conductor_hot_replications_total{outcome="failed"}'
    await _until(lambda: hot.failing, "the copy to the unreachable store to fail")
    await _until(lambda: not hot.in_flight, "the failed copy to end")
    # the same blocks are planned again once the recheck delay (5 s) has passed: fails again, not logged again
    hot.step(asyncio.get_running_loop().time() + 6)
    await _until(lambda: not hot.in_flight, "the second copy to end")
    m = await _metrics(cluster)
    assert m[failed] == 2 and m.get('mooncake_conductor_hot_replications_total{outcome="ok"}', 0) == 0
    warnings = [r for r in caplog.records if "hot-block replication" in r.getMessage()]
    assert len(warnings) == 1 and f"{a} -> {b}" in warnings[0].getMessage()
    await c.close()

