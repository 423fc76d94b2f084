"""A conductor with ``--discovery etcd://HOST:PORT``: it announces itself, and follows who to expect.

Its entry (``/mooncake/conductors/<url>``: URL, model id, block size, hash seed; signed, under a
lease) is how instances and stores find it, and how they refuse one that serves another model,
block size or hash seed. It reads the instances' and stores' entries to know when its view is
complete after a start (``rebuild.py``); the instances and stores themselves dial it and report
(registration, heartbeats, block events), so liveness stays what their heartbeats say. While etcd
is away nothing changes: the conductor serves from the view it has.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from mooncake_lite.common import discovery
from mooncake_lite.conductor.cluster import leader, limits, tenant_table
from mooncake_lite.conductor.cluster.rebuild import Rebuild
from mooncake_lite.conductor.services import SERVICES

REBUILD = web.AppKey("rebuild", Rebuild)
# The conductor's own URL, once its listener is bound (``note_address``).
ADDRESS = web.AppKey("address", asyncio.Future)
DEFAULT_DISCOVERY_WAIT_S = 10.0


def setup(app: web.Application, discovery_url: str | None, rebuild_wait: float | None,
          identity: dict[str, object], token: str | None, peers: tuple[str, ...] = ()) -> None:
    """The view-rebuild gate for ``/health`` and, with discovery, the etcd tasks (``identity``:
    what the conductor's entry says it serves); with a static list of ``peers`` instead, the
    task that divides the tenant limits among those of them answering ``/health``."""
    wait = rebuild_wait if rebuild_wait is not None else (DEFAULT_DISCOVERY_WAIT_S if discovery_url else 0.0)
    app[REBUILD] = Rebuild(0.0, wait)
    app.on_startup.append(_start_clock)
    if discovery_url or peers:
        gate = app[SERVICES].tenants
        assert gate is not None, "make_services always gives the conductor a tenant gate"
        app[limits.LIMITS] = limits.Limits(gate.ledger, identity)
    if discovery_url:    # etcd names the peers (and wins over a static list)
        app[leader.LEADER] = leader.Leadership(token)
        app.router.add_get("/internal/v1/etcd", limits.reaches_etcd)
        app.cleanup_ctx.append(lambda app: _run(app, discovery_url, identity, token))
    elif peers:
        app.cleanup_ctx.append(lambda app: _follow(app, peers))


async def _start_clock(app: web.Application) -> None:
    app[REBUILD].started = asyncio.get_running_loop().time()


def note_address(app: web.Application, addresses: dict[str, str]) -> None:
    """Called once the listener is bound (the ready line's addresses): the URL to announce."""
    fut = app.get(ADDRESS)
    if fut is not None and not fut.done():
        fut.set_result("http://" + addresses["http"])


def is_rebuilt(app: web.Application) -> bool:
    """For ``/health``: whether the view is complete (or the bounded wait over)."""
    svc = app[SERVICES]
    inst = svc.membership.instances
    return app[REBUILD].complete(asyncio.get_running_loop().time(),
                                 lambda iid: iid in inst and inst[iid].is_alive, svc.scheduler.index.is_synced)


async def _run(app: web.Application, url: str, identity: dict[str, object], token: str | None) -> AsyncIterator[None]:
    svc, rebuild = app[SERVICES], app[REBUILD]
    app[ADDRESS] = address = asyncio.get_running_loop().create_future()
    etcd = discovery.client(svc.session, url)
    lists: dict[str, dict[str, dict]] = {discovery.INSTANCES: {}, discovery.STORES: {}}

    def listed(prefix: str, entries: dict[str, dict]) -> None:
        lists[prefix] = entries
        if all(d.loaded.is_set() or d.prefix == prefix for d in directories):
            stores = [str(e.get("address", name)) for name, e in lists[discovery.STORES].items()]
            rebuild.expect(lists[discovery.INSTANCES], stores)

    directories = [discovery.Directory(etcd, prefix, token, lambda entries, p=prefix: listed(p, entries))
                   for prefix in lists]
    shares = app[limits.LIMITS]
    conductors = discovery.Directory(etcd, discovery.CONDUCTORS, token, shares.listed)   # not one to wait for
    tasks = [asyncio.create_task(d.run(), name=f"discovery {d.prefix}") for d in [*directories, conductors]]
    tasks.append(asyncio.create_task(_announce(etcd, address, identity, token, shares), name="discovery announce"))
    tasks.append(asyncio.create_task(limits.watch(shares, svc.session, token), name="tenant limits"))
    tasks.append(asyncio.create_task(tenant_table.run(svc.tenants, etcd, token), name="shared tenant table"))
    tasks.append(asyncio.create_task(_lead(app[leader.LEADER], etcd, address), name="leader election"))
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _follow(app: web.Application, peers: tuple[str, ...]) -> AsyncIterator[None]:
    app[ADDRESS] = address = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(limits.follow_peers(app[limits.LIMITS], app[SERVICES].session, peers, address),
                               name="tenant limits among --peers")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _announce(etcd, address: asyncio.Future, identity: dict[str, object], token: str | None,
                    shares: limits.Limits) -> None:
    url = await address
    shares.place(url)
    entry = {"url": url, **identity}
    await discovery.announce(etcd, discovery.CONDUCTORS + url, entry, token, on_renewed=shares.renewed)


async def _lead(leadership: leader.Leadership, etcd, address: asyncio.Future) -> None:
    await leadership.run(etcd, await address)
