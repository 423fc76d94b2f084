"""Internal endpoints: instance registration and heartbeats, store block events.

All guarded by the cluster token (when one is set). Answers are JSON; errors use the same
``{"error": {...}}`` shape as the public API. A bad message is refused as a whole — nothing is
half-applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from aiohttp import web

from mooncake_lite.common.hashing import KEY_BYTES
from mooncake_lite.common.protocol import BlockEvents, Heartbeat, ProtocolError, Register, loads
from mooncake_lite.conductor.api import API
from mooncake_lite.conductor.errors import ApiError
from mooncake_lite.conductor.membership import RegistrationError
from mooncake_lite.scheduler import BlockEvent

log = logging.getLogger(__name__)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/internal/v1/register", register)
    app.router.add_post("/internal/v1/heartbeat", heartbeat)
    app.router.add_post("/internal/v1/block_events", block_events)


def _bad(message: str) -> web.Response:
    return ApiError(400, message, code="bad_message").response()


async def register(request: web.Request) -> web.Response:
    svc = request.app[API].svc
    try:
        reg = loads(Register, await request.read())
        inst = svc.membership.register(reg, asyncio.get_running_loop().time())
    except ProtocolError as exc:
        return _bad(str(exc))
    except RegistrationError as exc:
        log.warning("%s", exc.message)
        code = "cluster_mismatch" if exc.status == 409 else "bad_message"
        return ApiError(exc.status, exc.message, code=code).response()
    kv = svc.membership.kv_bytes_per_token
    if kv is not None and svc.scheduler.costs.kv_bytes_per_token != kv:
        svc.scheduler.costs = dataclasses.replace(svc.scheduler.costs, kv_bytes_per_token=kv)
    dead_after = svc.membership.dead_after_s
    return web.json_response({"ok": True, "instance_id": inst.instance_id, "dead_after_s": dead_after,
                              "heartbeat_interval_s": dead_after / 4})


async def heartbeat(request: web.Request) -> web.Response:
    svc = request.app[API].svc
    try:
        hb = loads(Heartbeat, await request.read())
    except ProtocolError as exc:
        return _bad(str(exc))
    if svc.membership.heartbeat(hb, asyncio.get_running_loop().time()) is None:
        return ApiError(404, f"unknown instance {hb.instance_id!r}: register again",
                        code="unknown_instance").response()
    return web.json_response({"ok": True})


async def block_events(request: web.Request) -> web.Response:
    svc = request.app[API].svc
    index = svc.scheduler.index
    try:
        ev = loads(BlockEvents, await request.read())
        stored = _keys(ev.stored, "stored")
        evicted = _keys(ev.evicted, "evicted")
    except ProtocolError as exc:
        return _bad(str(exc))
    if ev.full:   # the store's whole inventory follows: forget what we believed it held
        dropped = index.begin_full_sync(ev.store)
        log.info("store %s: full sync (%d key(s) in this part; %d forgotten)", ev.store, len(stored), dropped)
    # Stored before evicted: a key in both lists ends up absent, the safe side (a missing
    # entry only costs a missed reuse; a false one sends a prefill to look for a block in vain).
    if stored:
        index.apply(BlockEvent(ev.store, "stored", stored))
    if evicted:
        index.apply(BlockEvent(ev.store, "evicted", evicted))
    # A store we never had a full sync from (we restarted, it did not): ask for one. Its
    # events are applied meanwhile — partial knowledge beats none.
    return web.json_response({"ok": True, "num_blocks": index.num_blocks(ev.store),
                              "resync": not index.is_synced(ev.store)})


def _keys(hex_keys: tuple[str, ...], where: str) -> tuple[bytes, ...]:
    try:
        keys = tuple(bytes.fromhex(k) for k in hex_keys)
    except ValueError:
        raise ProtocolError(f"BlockEvents.{where}: keys must be hex strings") from None
    if any(len(k) != KEY_BYTES for k in keys):
        raise ProtocolError(f"BlockEvents.{where}: keys must be 16 bytes (32 hex digits)")
    return keys
