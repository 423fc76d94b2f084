"""Tenant limits with several conductors (``--discovery``, or ``--peers``): each holds a share of them.

The choice: each limit is divided among the live conductors listed in etcd (or, with a static
``--peers`` list, those of it answering ``/health``: :func:`follow_peers`), not counted exactly
through etcd. An exact count needs an etcd transaction at every admission and every end (two
round trips to etcd's leader on each request's path), and leaves a choice between no limits and
no service while etcd is away; a share costs nothing per request and holds from the last list
while etcd is away. What it gives up: a tenant whose requests the balancer does not spread
evenly is refused before its whole limit is in use (round robin spreads them), a limit under the
number of conductors leaves some with a share of 0, and while the list changes, old and new
shares overlap for a moment (the overshoot is measured: docs/operations.md, HA).

The conductors are ordered by URL; this one's place in that order picks its share
(``TenantLedger.divide``). A conductor cut off from etcd keeps its share while that may be an etcd
outage (no lease runs down while etcd is down, so nobody is counted out). Once etcd may have
dropped its entry (its lease TTL after the last renewal it sent, less a margin), it asks the
conductors it last knew (``GET /internal/v1/etcd``): if one of them reaches etcd, this is a
partition, the others have (or soon will have) taken its share, and it holds none (its limited
tenants' requests refused until it reaches etcd again); if none does, it keeps its share. With
``--peers`` there is no arbiter: conductors cut off from each other each count the others out and
take the whole limit (a partition overshoots up to the number of conductors); use etcd where that matters.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from mooncake_lite.common import discovery
from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.scheduler.tenants import TenantLedger

log = logging.getLogger(__name__)
MARGIN_S = 1.5        # gives the share up this long before etcd may drop our entry
ASK_TIMEOUT_S = 0.5
PERIOD_S = 0.25


class Limits:
    """This conductor's share of the tenant limits, from the conductors listed in etcd."""

    def __init__(self, ledger: TenantLedger, identity: dict[str, object],
                 ttl_s: float = discovery.LEASE_TTL_S) -> None:
        self.ledger, self.identity, self.ttl_s = ledger, identity, ttl_s
        self.url: str | None = None
        self.peers: list[str] = []
        self.renewed_at: float | None = None   # loop time the last renewal etcd answered was sent
        self.cut_off: str | None = None

    def listed(self, entries: dict[str, dict]) -> None:
        """The conductors' directory changed (keys are their URLs); only those serving what this
        one serves count (the instances refuse the others). They all serve by one tenant table, the
        one shared in etcd (``tenant_table.py``)."""
        self.peers = sorted(u for u, body in entries.items() if u != self.url and
                            all(body.get(k) == v for k, v in self.identity.items()))
        self._divide()

    def place(self, url: str) -> None:
        """This conductor's own URL, once its listener is bound."""
        self.url = url
        self.listed({u: self.identity for u in self.peers})

    def renewed(self, sent_at: float) -> None:
        self.renewed_at = sent_at
        if self.cut_off is not None:
            log.info("tenant limits: etcd reached again; this conductor holds its share again")
            self.cut_off = None
            self._divide()

    def reaches_etcd(self, now: float) -> bool:
        return self.renewed_at is not None and now - self.renewed_at < self.ttl_s

    def _divide(self) -> None:
        urls = sorted({*self.peers, *([self.url] if self.url else [])})
        index = urls.index(self.url) if self.url in urls else 0
        self.ledger.divide(index, len(urls) or 1, self.cut_off)

    async def check(self, session: aiohttp.ClientSession, token: str | None, now: float) -> None:
        """Once etcd may have dropped our entry: give the share up if another conductor reaches etcd."""
        if self.cut_off is not None or self.renewed_at is None or \
                now - self.renewed_at < self.ttl_s - MARGIN_S or not self.peers:
            return
        answers = await asyncio.gather(*(_ask(session, token, peer) for peer in self.peers))
        reached = [peer for peer, ok in zip(self.peers, answers) if ok]
        if reached and self.cut_off is None and not self.reaches_etcd(asyncio.get_running_loop().time()):
            self.cut_off = f"cut off from etcd while {reached[0]} reaches it (a partition)"
            log.warning("tenant limits: %s; holding no share of the limits until etcd is reached again",
                        self.cut_off)
            self._divide()


async def follow_peers(limits: Limits, session: aiohttp.ClientSession, peers: tuple[str, ...],
                       address: asyncio.Future) -> None:
    """Without etcd (``--peers``): the live conductors are those of the list answering ``/health``
    at all (a 503 too: one rebuilding or draining still counts, so a conductor coming back never
    holds a share the others have not made room for; while it drains, its share goes unused)."""
    url = await address
    others = tuple(p for p in peers if p != url)
    if len(others) == len(peers):
        log.warning("tenant limits: --peers does not list this conductor (%s) as the others reach it; "
                    "the conductors' shares may overlap", url)
    limits.place(url)
    live: set[str] | None = None
    while True:
        answers = await asyncio.gather(*(_answers(session, peer) for peer in others))
        now = {peer for peer, ok in zip(others, answers) if ok}
        if now != live:
            log.info("tenant limits: %d live conductor(s) of --peers besides this one: %s", len(now), sorted(now))
            live = now
            limits.listed({peer: limits.identity for peer in now})
        await asyncio.sleep(PERIOD_S)


async def _answers(session: aiohttp.ClientSession, peer: str) -> bool:
    try:
        async with session.get(peer + "/health", timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)):
            return True
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def _ask(session: aiohttp.ClientSession, token: str | None, peer: str) -> bool:
    try:
        async with session.get(peer + "/internal/v1/etcd", headers=cluster_headers(token),
                               timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)) as resp:
            return resp.status == 200 and bool((await resp.json()).get("reaches_etcd"))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return False


LIMITS = web.AppKey("limits", Limits)


async def reaches_etcd(request: web.Request) -> web.Response:
    """``GET /internal/v1/etcd``: whether this conductor renewed its entry in etcd within the TTL."""
    limits = request.app[LIMITS]
    return web.json_response({"reaches_etcd": limits.reaches_etcd(asyncio.get_running_loop().time())})


async def watch(limits: Limits, session: aiohttp.ClientSession, token: str | None) -> None:
    while True:
        await asyncio.sleep(PERIOD_S)
        await limits.check(session, token, asyncio.get_running_loop().time())
