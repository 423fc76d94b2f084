"""Internal endpoints: instance registration and heartbeats, store block events (and the stores
gone silent, dropped from the index).

All guarded by the cluster token (when one is set). Answers are JSON; errors use the same
``{"error": {...}}`` shape as the public API. A bad message is refused as a whole — nothing is
half-applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from mooncake_lite.common.hashing import KEY_BYTES
from mooncake_lite.common.protocol import BlockEvents, Heartbeat, ProtocolError, Register, loads
from mooncake_lite.conductor.api.errors import ApiError
from mooncake_lite.conductor.cluster import others, status
from mooncake_lite.conductor.cluster.costs import InstanceCosts
from mooncake_lite.conductor.cluster.membership import RegistrationError
from mooncake_lite.conductor.services import SERVICES
from mooncake_lite.scheduler import BlockEvent
from mooncake_lite.scheduler.admission import unmeetable_slos

log = logging.getLogger(__name__)
M = TypeVar("M")   # a membership message (Register, Heartbeat)
R = TypeVar("R")

# (instance id, metric, cost model) already warned about: an instance that registers again
# with the same profile (a conductor restart, a 404 heartbeat) is not warned about twice.
SLO_WARNED = web.AppKey("slo_warned", set)
_FLAGS = {"ttft": "--ttft-slo", "tbt": "--tbt-slo"}


def add_routes(app: web.Application) -> None:
    app[SLO_WARNED] = set()
    app.router.add_post("/internal/v1/register", register)
    app.router.add_post("/internal/v1/heartbeat", heartbeat)
    app.router.add_post("/internal/v1/block_events", block_events)


def _bad(message: str) -> web.Response:
    return ApiError(400, message, code="bad_message").response()


async def _apply(request: web.Request, cls: type[M], apply: Callable[[M, float], R], *,
                 log_refusal: bool) -> tuple[M, R]:
    """The body decoded as a ``cls``, and what ``apply(message, now)`` (the membership) made of it.
    Raises the answer when the message is malformed (400) or the membership refuses it (400; 409:
    an instance of another cluster); nothing was applied then. ``log_refusal``: the membership's
    refusal is logged too (a registration's, which the operator must see; a heartbeat's would
    repeat every beat)."""
    try:
        msg = loads(cls, await request.read())
        return msg, apply(msg, asyncio.get_running_loop().time())
    except ProtocolError as exc:
        raise ApiError(400, str(exc), code="bad_message") from None
    except RegistrationError as exc:
        if log_refusal:
            log.warning("%s", exc.message)
        code = "cluster_mismatch" if exc.status == 409 else "bad_message"
        raise ApiError(exc.status, exc.message, code=code) from None


async def register(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    try:
        _, inst = await _apply(request, Register, svc.membership.register, log_refusal=True)
    except ApiError as exc:
        return exc.response()
    kv = svc.membership.kv_bytes_per_token
    if kv is not None and svc.scheduler.costs.kv_bytes_per_token != kv:
        svc.scheduler.costs = dataclasses.replace(svc.scheduler.costs, kv_bytes_per_token=kv)
    _warn_unmeetable_slos(request.app, inst.instance_id, inst.costs)
    dead_after = svc.membership.dead_after_s
    return web.json_response({"ok": True, "instance_id": inst.instance_id, "dead_after_s": dead_after,
                              "heartbeat_interval_s": dead_after / 4})


def _warn_unmeetable_slos(app: web.Application, instance_id: str, costs: InstanceCosts) -> None:
    """Say loudly, once per instance and profile, when an absolute SLO is beyond what the
    instance's own profile predicts for the smallest request alone: admission would reject
    every such request, and nothing else would tell the operator why."""
    cfg, warned = app[SERVICES].scheduler.config, app[SLO_WARNED]
    for miss in unmeetable_slos(cfg, costs.prefill, costs.decode):
        key = (instance_id, miss.metric, costs.prefill if miss.metric == "ttft" else costs.decode)
        if key in warned:
            continue
        warned.add(key)
        flag = _FLAGS[miss.metric]
        log.error("%s: %s takes %.3g s by its profile, above %s %.3g s: %s will be rejected by %s "
                  "admission; raise %s or use the relative default (%s-factor)", instance_id, miss.what,
                  miss.predicted_s, flag, miss.slo_s, miss.consequence, cfg.admission, flag, flag)


async def heartbeat(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    try:
        hb, inst = await _apply(request, Heartbeat, svc.membership.heartbeat, log_refusal=False)
        if inst is None:
            raise ApiError(404, f"unknown instance {hb.instance_id!r}: register again", code="unknown_instance")
    except ApiError as exc:
        return exc.response()
    svc.membership.trust(hb.instance_id, "it heartbeated")
    if svc.membership.tie_salt is not None:   # other conductors share the instance: show their work
        others.show(inst, asyncio.get_running_loop().time())
    return web.json_response({"ok": True})


async def block_events(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    index = svc.scheduler.index
    try:
        ev = loads(BlockEvents, await request.read())
        stored = _keys(ev.stored, "stored")
        evicted = _keys(ev.evicted, "evicted")
    except ProtocolError as exc:
        return _bad(str(exc))
    status.note_store_usage(request.app, ev.store, ev.usage)   # for `mooncake status`
    if svc.membership.stores.heard(ev.store, asyncio.get_running_loop().time(), ev.capacity):
        log.warning("store %s is back after being dropped as silent%s", ev.store,
                    "" if ev.full else "; asking it for a full sync")
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
    # events are applied meanwhile — partial knowledge beats none. dead_after_s: the store keeps
    # alive well within it, whatever --dead-after is.
    return web.json_response({"ok": True, "num_blocks": index.num_blocks(ev.store),
                              "resync": not index.is_synced(ev.store),
                              "dead_after_s": svc.membership.dead_after_s})


def drop_silent_stores(app: web.Application, now: float) -> None:
    """Drop from the block index every store silent for ``--dead-after`` (killed, cut off):
    its blocks must stop attracting requests. Called by the app's reaper."""
    svc = app[SERVICES]
    for store_id in svc.membership.stores.silent(now):
        dropped = svc.scheduler.index.drop_store(store_id)
        log.warning("store %s: nothing heard for more than %.1fs (no block events, no keepalive); dropped "
                    "its %d block(s) from the index", store_id, svc.membership.dead_after_s, dropped)


def _keys(hex_keys: tuple[str, ...], where: str) -> tuple[bytes, ...]:
    try:
        keys = tuple(bytes.fromhex(k) for k in hex_keys)
    except ValueError:
        raise ProtocolError(f"BlockEvents.{where}: keys must be hex strings") from None
    if any(len(k) != KEY_BYTES for k in keys):
        raise ProtocolError(f"BlockEvents.{where}: keys must be 16 bytes (32 hex digits)")
    return keys
