"""The store process: HTTP control plane (aiohttp) + the data port, wired in ``cleanup_ctx``.

HTTP: ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /blocks`` (every key held, hex; needs
the cluster token when one is set). The data port speaks ``store/protocol.py`` frames. On
SIGTERM: stop accepting data connections, finish in-flight operations, flush replies, write
DRAM-only blocks to the SSD tier (``--persist-on-exit``), finish SSD writes, send the last block
events, exit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from mooncake_lite.common.auth import cluster_token_middleware
from mooncake_lite.common.protocol import StoreCapacity
from mooncake_lite.store.blocks import BlockStore
from mooncake_lite.store.config import Config
from mooncake_lite.store.dataplane import META_BYTES, StoreHandler
from mooncake_lite.store.eviction import make_policy
from mooncake_lite.store.event_fanout import BlockEventFanout
from mooncake_lite.store.metrics import StoreCollector, make_registry, render
from mooncake_lite.store.replicate import Replicator
from mooncake_lite.store.slab import Slab, cuda_available
from mooncake_lite.store.ssd import SsdTier
from mooncake_lite.transfer.framing import Limits
from mooncake_lite.transfer.kv_layout import LAYOUT_VERSION
from mooncake_lite.transfer.server import server_address, start_server
from mooncake_lite.transfer.shm import is_supported as shm_supported

log = logging.getLogger(__name__)


@dataclass
class DataPlane:
    cfg: Config
    store: BlockStore
    publisher: BlockEventFanout
    address: str = ""
    handler: StoreHandler | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    # Built once: the collectors read the live objects at each scrape, and the GPU collector
    # starts NVML once per process, not once per scrape.
    registry: CollectorRegistry | None = None


DATA = web.AppKey("data", DataPlane)


def make_app(cfg: Config) -> web.Application:
    """Allocate the slab and re-index the SSD tier now (errors surface before serving)."""
    ssd = None
    if cfg.ssd_dir:
        # A block larger than a DRAM slot could never be promoted: count it as bad at start-up.
        ssd = SsdTier(cfg.ssd_dir, cfg.ssd, fsync=cfg.ssd_fsync, max_pending_bytes=cfg.ssd_queue,
                      max_block_bytes=cfg.slot_bytes)
    slab = _make_slab(cfg)
    # Reported with the block events, for the simulator's store (the conductor's cost export).
    capacity = StoreCapacity(slab.num_slots, ssd.capacity_bytes // slab.slot_bytes if ssd else 0, cfg.eviction)
    # Idle keepalive (to hear of a restarted conductor): a few seconds, sooner with fast events.
    publisher = BlockEventFanout(cfg.joins(), interval=cfg.event_interval, keepalive=min(5.0, 20 * cfg.event_interval),
                                 capacity=capacity)
    store = BlockStore(slab, make_policy(cfg.eviction), ssd, on_stored=publisher.stored, on_evicted=publisher.evicted)
    if ssd is not None:
        ssd.scan()
        num = store.restore_holds(ssd.journal.load(), time.time())   # context holds survive restarts
        if num:
            log.info("restored %d context hold(s) from %s", num, ssd.journal.path)
    # The first post is a full sync: the conductor learns what survived a restart (SSD) and
    # forgets what a previous run of this store held.
    publisher.enable_full_sync(store.keys)
    publisher.usage = lambda: usage(store)   # for `mooncake status`, via the conductor
    app = web.Application(middlewares=[cluster_token_middleware(cfg.cluster_token)])
    dp = app[DATA] = DataPlane(cfg, store, publisher)
    dp.registry = make_registry(StoreCollector(store, lambda: {
        "connections": len(dp.handler.connections) if dp.handler else 0,
        "events_pending": dp.publisher.num_pending}))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/blocks", blocks)
    app.cleanup_ctx.append(_data_plane)
    return app


def _make_slab(cfg: Config) -> Slab:
    pin = cuda_available() if cfg.pin_memory is None else cfg.pin_memory
    shared = cfg.shm == "auto" and not pin and shm_supported()
    if cfg.shm == "auto" and not shared:
        log.info("same-node fast path off: %s", "the slab is page-locked" if pin else "no memfd here")
    return Slab(cfg.dram, cfg.slot_bytes, pin=pin, shared=shared)


async def _data_plane(app: web.Application) -> AsyncIterator[None]:
    dp = app[DATA]
    cfg, store = dp.cfg, dp.store
    replicator = Replicator(store, token=cfg.cluster_token)
    dp.handler = StoreHandler(store, lease_ttl=cfg.lease_ttl, replicator=replicator, shm_staging=cfg.shm_staging)
    hello: dict[str, object] = {}
    limits = Limits(max_meta_bytes=META_BYTES, max_payload_bytes=cfg.max_frame,
                    handshake_timeout=cfg.data_handshake_timeout, stall_timeout=cfg.data_stall_timeout,
                    idle_timeout=cfg.data_idle_timeout or None, max_inflight_bytes=cfg.data_inflight)
    server = await start_server(dp.handler, cfg.host, cfg.data_port, token=cfg.cluster_token,
                                limits=limits, name="store-client", hello=hello)
    dp.address = replicator.self_address = dp.publisher.store_address = server_address(server, cfg.advertise_host)
    # The advertised data address is the store id its block events carry: a client that dialled
    # it under another name (127.0.0.1 for 10.0.0.7) learns the one the conductor knows.
    hello["store_id"] = dp.address
    # The largest block a put may carry: a prefill checks its model's blocks fit before serving.
    hello["slot_bytes"] = store.slab.slot_bytes
    hello["kv_compression"] = cfg.kv_compression   # one block encoding per cluster (prefills check)
    hello["kvl"] = LAYOUT_VERSION                  # and one block layout (it refuses puts of another)
    if dp.handler.shm.is_enabled:   # same-node clients map the slab instead of using the socket
        await dp.handler.shm.start()
        hello["shm"] = dp.handler.shm.offer()
    session = aiohttp.ClientSession()
    loop = asyncio.get_running_loop()
    dp.tasks = [loop.create_task(dp.handler.run_lease_sweeper(min(1.0, cfg.lease_ttl / 4))),
                loop.create_task(dp.publisher.run(session))]
    writer = loop.create_task(store.ssd.run_writer()) if store.ssd is not None else None
    log.info("store data port %s (eviction %s, %d slots of %d bytes, SSD %s)", dp.address, cfg.eviction,
             store.slab.num_slots, store.slab.slot_bytes, cfg.ssd_dir or "off")
    try:
        yield
    finally:
        await _drain(dp, server, replicator, session)
        if writer is not None:
            await writer


async def _drain(dp: DataPlane, server: asyncio.Server, replicator: Replicator, session: aiohttp.ClientSession) -> None:
    cfg, store, handler = dp.cfg, dp.store, dp.handler
    assert handler is not None
    deadline = time.monotonic() + cfg.drain_timeout
    server.close()
    handler.shm.close()
    # Let frames already arriving finish (a put cut in half would be lost) and their work end.
    while time.monotonic() < deadline and (handler.tasks or not all(c.is_idle for c in handler.connections)):
        await asyncio.sleep(0.01)
    for conn in list(handler.connections):
        conn.close()  # flushes queued replies, then closes
    closing = [conn.closed for conn in list(handler.connections)]
    if closing:
        await asyncio.wait(closing, timeout=max(0.1, deadline - time.monotonic()))
    for conn in list(handler.connections):
        conn.abort("store shutting down")
    await replicator.close()
    for task in dp.tasks:
        task.cancel()
    if store.ssd is not None:
        if cfg.persist_on_exit:
            # Bounded like the rest of the drain: a supervisor may not wait for 8 GiB of fsyncs.
            budget = max(1.0, deadline - time.monotonic())
            try:
                num = await asyncio.wait_for(store.persist(), budget)
                log.info("wrote %d DRAM block(s) to the SSD tier before exit", num)
            except asyncio.TimeoutError:
                log.warning("drain budget spent: some DRAM-only blocks were not written to the SSD tier")
        await store.ssd.stop()
    await dp.publisher.flush(session)
    await session.close()


def usage(store: BlockStore) -> dict[str, float]:
    """What the conductor's status view shows of this store (sent with the block events)."""
    ssd, stats = store.ssd, store.stats
    return {"dram_used_bytes": store.dram_used_bytes, "dram_capacity_bytes": store.slab.capacity_bytes,
            "dram_blocks": store.num_dram_blocks, "ssd_used_bytes": ssd.used_bytes if ssd else 0,
            "ssd_capacity_bytes": ssd.capacity_bytes if ssd else 0, "ssd_blocks": len(ssd) if ssd else 0,
            "hits_dram": stats.hits_dram, "hits_ssd": stats.hits_ssd, "misses": stats.misses}


async def health(request: web.Request) -> web.Response:
    dp = request.app[DATA]
    store = dp.store
    return web.json_response({"status": "ok", "role": "store", "data": dp.address,
                              "num_blocks": len(store.keys()), "num_dram_blocks": store.num_dram_blocks,
                              "dram_free_slots": store.slab.num_free, "dram_slots": store.slab.num_slots,
                              "slot_bytes": store.slab.slot_bytes, "eviction": dp.cfg.eviction,
                              "ssd": store.ssd is not None,
                              # every slab page faulted in (a big slab is, in the background)
                              "dram_resident": store.slab.is_populated,
                              # cached contexts' blocks, held against eviction (PIN)
                              "held_blocks": len(store.holds), "holds": len(store.holds.entries())})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=render(request.app[DATA].registry), content_type="text/plain", charset="utf-8")


async def blocks(request: web.Request) -> web.Response:
    dp = request.app[DATA]
    return web.json_response({"store": dp.address, "keys": sorted(k.hex() for k in dp.store.keys())})
