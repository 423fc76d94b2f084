"""Block events to every conductor: one :class:`BlockEventPublisher` each, each its own task.

A store reports to every conductor of ``--conductor URL1,URL2,...`` and, with ``--discovery``, to
every conductor listed in etcd (where it announces itself too, under ``/mooncake/stores/``, so
a restarted conductor knows which stores to wait for). Each conductor has its own pending events
(bounded: past ``max_pending`` the oldest are dropped and a full sync follows), its own backoff
and its own full syncs, so a conductor that is down or slow costs the others nothing; one that
joins later starts with a full sync of the inventory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection

import aiohttp

from mooncake_lite.common import discovery
from mooncake_lite.common.membership import Conductor, follow_conductors
from mooncake_lite.common.protocol import StoreCapacity
from mooncake_lite.store.events import BlockEventPublisher

log = logging.getLogger(__name__)


class BlockEventFanout:
    """The publisher interface of the store (record, full sync, run, flush), for every conductor."""

    def __init__(self, conductor: Conductor | None, *, interval: float, keepalive: float,
                 capacity: StoreCapacity | None = None) -> None:
        self.conductor = conductor
        self.interval, self.keepalive, self.capacity = interval, keepalive, capacity
        self.publishers: dict[str, BlockEventPublisher] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.inventory: Callable[[], Collection[bytes]] | None = None
        self.usage: Callable[[], dict[str, float]] | None = None
        self._address = ""
        self._session: aiohttp.ClientSession | None = None
        for url in conductor.urls if conductor else ():
            self._add(url)

    def _add(self, url: str) -> BlockEventPublisher:
        token = self.conductor.token if self.conductor else None
        pub = BlockEventPublisher(url, self._address, token=token, interval=self.interval, keepalive=self.keepalive,
                                  inventory=self.inventory, capacity=self.capacity)
        pub.usage = lambda: self.usage() if self.usage else {}
        self.publishers[url] = pub
        if self._session is not None:
            self.tasks[url] = asyncio.create_task(pub.run(self._session), name=f"block-events {url}")
        return pub

    def set_urls(self, urls: tuple[str, ...]) -> None:
        """Report to exactly these conductors from now on (a new one gets a full sync first)."""
        for url in set(self.publishers) - set(urls):
            log.info("block events: conductor %s left the list; no longer reporting to it", url)
            del self.publishers[url]
            task = self.tasks.pop(url, None)
            if task is not None:
                task.cancel()
        for url in urls:
            if url not in self.publishers:
                self._add(url)

    # ---- the publisher interface the store uses ---------------------------------------------------
    def stored(self, key: bytes) -> None:
        for pub in self.publishers.values():
            pub.stored(key)

    def evicted(self, key: bytes) -> None:
        for pub in self.publishers.values():
            pub.evicted(key)

    def enable_full_sync(self, inventory: Callable[[], Collection[bytes]]) -> None:
        self.inventory = inventory
        for pub in self.publishers.values():
            pub.enable_full_sync(inventory)

    @property
    def store_address(self) -> str:
        return self._address

    @store_address.setter
    def store_address(self, address: str) -> None:
        self._address = address
        for pub in self.publishers.values():
            pub.store_address = address

    @property
    def num_pending(self) -> int:
        return max((pub.num_pending for pub in self.publishers.values()), default=0)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Every conductor's loop (and, with discovery, the store's entry and the conductors'
        list in etcd) until cancelled."""
        self._session = session
        for url, pub in self.publishers.items():
            self.tasks[url] = asyncio.create_task(pub.run(session), name=f"block-events {url}")
        background = []
        conductor = self.conductor
        if conductor is not None and conductor.discovery:
            etcd = discovery.client(session, conductor.discovery)
            background = [asyncio.create_task(discovery.announce(
                              etcd, discovery.STORES + self._address, {"address": self._address}, conductor.token)),
                          follow_conductors(session, conductor, self.set_urls)]
        try:
            await asyncio.Event().wait()
        finally:
            for task in [*self.tasks.values(), *background]:
                task.cancel()
            for task in [*self.tasks.values(), *background]:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.tasks.clear()

    async def flush(self, session: aiohttp.ClientSession) -> bool:
        """Post what is pending to every conductor at once; True when every post succeeded."""
        results = await asyncio.gather(*(pub.flush(session) for pub in self.publishers.values()))
        return all(results)
