"""One conductor leads the jobs that must run once in the cluster (``--discovery``): background
hot-block replication. Chosen through etcd, moved when the leader dies.

Election: each conductor holds a lease and tries to create ``/mooncake/leader`` under it in a
transaction that succeeds only if the key does not exist (create revision 0). The one that
created it leads while it keeps its lease alive; the others try again every third of the TTL, so
when the leader dies (its lease runs out a TTL after its last renewal) or stops (it revokes the
lease: at once), another leads within a TTL and a third. The entry is signed with the cluster
token like every other (``common/discovery.py``): a forged one is skipped and never named leader.

A leader cut off from etcd stops leading a margin before its lease may have run out (it counts
from the time it sent its last renewal that etcd answered), so two conductors never lead at once
from their own clocks' point of view; while etcd is away nobody leads, and the jobs pause.
Context expiry needs no leader: every cached context is on its own etcd lease, which etcd ends
once for the cluster (``contexts/shared.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from mooncake_lite.common import discovery
from mooncake_lite.common.etcd import Etcd, EtcdError

log = logging.getLogger(__name__)
KEY = discovery.ROOT + "leader"
MARGIN_S = 1.0


class Leadership:
    """Whether this conductor (``me``, its URL) leads now; :meth:`run` keeps trying (a task)."""

    def __init__(self, token: str | None, ttl_s: int = discovery.LEASE_TTL_S) -> None:
        self.token, self.ttl_s = token, ttl_s
        self.me: str | None = None
        self.until: float | None = None      # loop time this conductor leads until, unless renewed
        self.holder: str | None = None       # the leader as this conductor last read it

    @property
    def is_leader(self) -> bool:
        return self.until is not None and asyncio.get_running_loop().time() < self.until

    async def run(self, etcd: Etcd, me: str) -> None:
        self.me, lease, delay = me, None, 0.5
        value = discovery.sign(self.token, KEY, {"url": me})
        try:
            while True:
                try:
                    lease = await self._round(etcd, lease, value)
                    delay = 0.5
                    await asyncio.sleep(self.ttl_s / 3)
                except EtcdError as exc:   # the lease is kept: the next round renews it if it still can
                    if delay == 0.5:
                        log.warning("leader election: %s; retrying", exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, discovery.RETRY_MAX_S)
        finally:
            self.until = None
            if lease is not None:
                with contextlib.suppress(EtcdError, asyncio.CancelledError):
                    await asyncio.shield(etcd.revoke(lease))

    async def _round(self, etcd: Etcd, lease: int | None, value: bytes) -> int | None:
        """Renew the lease (granting one when etcd no longer knows it), then lead on or try to."""
        sent_at = asyncio.get_running_loop().time()
        if lease is not None and not await etcd.keepalive(lease):
            if self.until is not None:
                log.warning("leader election: this conductor's lease ran out; no longer the leader")
            lease, self.until = None, None
        if lease is None:
            lease = await etcd.grant(self.ttl_s)
        if self.until is None:
            created, held = await etcd.create(KEY, value, lease)
            if not created:
                self._read_holder(held)
                return lease
            log.info("leader election: this conductor (%s) is now the leader", self.me)
            self.holder = self.me
        self.until = sent_at + self.ttl_s - MARGIN_S
        return lease

    def _read_holder(self, held: bytes | None) -> None:
        if held is None:   # gone between the compare and the read: the next round tries again
            return
        try:
            holder = str(discovery.verify(self.token, KEY, held).get("url"))
        except ValueError as exc:
            log.error("leader election: skipped the entry %s in etcd: %s", KEY, exc)
            holder = None
        if holder != self.holder:
            log.info("leader election: the leader is %s", holder)
        self.holder = holder


LEADER = web.AppKey("leader", Leadership)
