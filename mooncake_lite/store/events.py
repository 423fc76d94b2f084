"""Block events for the conductor's index: batched, coalesced, never on the data path.

``stored(key)`` / ``evicted(key)`` only record the latest event per key (O(1), no IO). A
background task POSTs the batch every ``interval`` seconds to
``{conductor}/internal/v1/block_events`` as ``BlockEvents{store, stored: [hex], evicted: [hex]}``.
If the conductor is down, the batch is kept (newer events win) and retried with backoff;
one log line per outage, not one per attempt.

Given an ``inventory`` (the store's held keys), the first post is a full sync
(``BlockEvents.full``, chunked), so a restarted store replaces whatever the conductor still
believed it held; and whenever the conductor answers ``"resync": true`` (it restarted and does
not know this store), the next post is a full sync again. An idle store posts an empty message
every ``keepalive`` seconds, so a quiet store hears about a restarted conductor too. The
conductor's answer carries its ``dead_after_s``; the keepalive then follows it (a third of it,
at most ``keepalive``), so a short ``--dead-after`` never drops a live idle store as silent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

import aiohttp
import orjson

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import BlockEvents, StoreCapacity, dumps

log = logging.getLogger(__name__)

STORED, EVICTED = True, False
SYNC_CHUNK_KEYS = 65536   # keys per full-sync message (~2.3 MB of JSON)


class BlockEventPublisher:
    def __init__(self, conductor_url: str | None, store_address: str, *, token: str | None = None,
                 interval: float = 0.2, max_pending: int = 1_000_000, timeout: float = 5.0,
                 inventory: Callable[[], Collection[bytes]] | None = None, keepalive: float = 5.0,
                 capacity: StoreCapacity | None = None) -> None:
        self.url = conductor_url.rstrip("/") + "/internal/v1/block_events" if conductor_url else None
        self.store_address = store_address
        self.headers = {"Content-Type": "application/json", **cluster_headers(token)}
        self.interval = interval
        self.max_pending = max_pending
        self.timeout = timeout
        self._pending: OrderedDict[bytes, bool] = OrderedDict()
        self.num_sent = self.num_failed_posts = self.num_dropped = 0
        self._is_down = False
        self.inventory = inventory
        self.keepalive = keepalive
        self.max_keepalive = keepalive   # the configured ceiling; the conductor's dead_after may lower it
        self._last_post = time.monotonic()
        self.num_full_syncs = 0
        self._needs_full = inventory is not None
        self.usage: Callable[[], dict[str, float]] | None = None   # the store's figures, sent with each post
        self.capacity = capacity   # sent with each post too (the conductor may restart)

    # ---- recording (called from the data path) ------------------------------------------------
    def stored(self, key: bytes) -> None:
        self._record(key, STORED)

    def evicted(self, key: bytes) -> None:
        self._record(key, EVICTED)

    def _record(self, key: bytes, kind: bool) -> None:
        if self.url is None:
            return
        self._pending[key] = kind
        self._pending.move_to_end(key)
        if len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)
            self.num_dropped += 1
            self._needs_full = self.inventory is not None   # the next post makes up for it

    def enable_full_sync(self, inventory: Callable[[], Collection[bytes]]) -> None:
        """Sync in full from ``inventory`` at the next post, and whenever the conductor asks."""
        self.inventory = inventory
        self._needs_full = True

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ---- publishing ---------------------------------------------------------------------------
    async def run(self, session: aiohttp.ClientSession) -> None:
        """Background loop; cancel it to stop (then call ``flush`` once)."""
        delay = self.interval
        while True:
            await asyncio.sleep(delay)
            ok = await self.flush(session)
            delay = self.interval if ok else min(max(delay * 2, 0.5), 5.0)

    async def flush(self, session: aiohttp.ClientSession) -> bool:
        """POST everything pending now (a full sync first if one is due). True on success (or
        nothing to send)."""
        if self.url is None:
            return True
        if self._needs_full:
            return await self._full_sync(session)
        if not self._pending:
            if self.inventory is None or time.monotonic() - self._last_post < self.keepalive:
                return True
            return await self._post(session, BlockEvents(self.store_address))   # may ask to resync
        batch, self._pending = self._pending, OrderedDict()
        msg = BlockEvents(self.store_address,
                          stored=tuple(k.hex() for k, kind in batch.items() if kind is STORED),
                          evicted=tuple(k.hex() for k, kind in batch.items() if kind is EVICTED))
        if not await self._post(session, msg):
            self._requeue(batch)
            return False
        self.num_sent += len(batch)
        return True

    async def _full_sync(self, session: aiohttp.ClientSession) -> bool:
        """Send the whole inventory; the events pending until now are part of it (the inventory
        is read after them), so they are dropped. Any failed chunk restarts the sync later."""
        self._pending = OrderedDict()
        keys = list(self.inventory())   # the snapshot; hex-encoded chunk by chunk, between posts
        self._needs_full = False
        for start in range(0, max(len(keys), 1), SYNC_CHUNK_KEYS):
            msg = BlockEvents(self.store_address, stored=tuple(k.hex() for k in keys[start:start + SYNC_CHUNK_KEYS]),
                              full=start == 0)
            if not await self._post(session, msg):
                self._needs_full = True
                return False
        self.num_full_syncs += 1
        self.num_sent += len(keys)
        log.info("block events: full sync of %d key(s) sent to the conductor", len(keys))
        return True

    async def _post(self, session: aiohttp.ClientSession, msg: BlockEvents) -> bool:
        if self.usage is not None or self.capacity is not None:
            msg = dataclasses.replace(msg, usage=self.usage() if self.usage else msg.usage, capacity=self.capacity)
        try:
            async with session.post(self.url, data=dumps(msg), headers=self.headers,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                body = await resp.read()
                if resp.status >= 300:
                    raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=resp.status,
                                                      message=body[:200].decode(errors="replace"))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.num_failed_posts += 1
            if not self._is_down:
                log.warning("block events: conductor at %s unreachable (%s); keeping %d event(s) and retrying",
                            self.url, exc or type(exc).__name__, len(self._pending) + len(msg.stored))
                self._is_down = True
            return False
        self._last_post = time.monotonic()
        if self._is_down:
            log.info("block events: conductor reachable again")
            self._is_down = False
        answer = _answer(body)
        if self.inventory is not None and answer.get("resync") is True:
            self._needs_full = True
        self._follow_dead_after(answer.get("dead_after_s"))
        return True

    def _follow_dead_after(self, dead_after: object) -> None:
        """Keep alive three times per conductor's ``dead_after``: one lost or late post must not
        make a live idle store look silent."""
        if isinstance(dead_after, (int, float)) and not isinstance(dead_after, bool) and dead_after > 0:
            self.keepalive = min(self.max_keepalive, dead_after / 3)

    def _requeue(self, batch: OrderedDict[bytes, bool]) -> None:
        newer = self._pending
        self._pending = batch
        for key, kind in newer.items():  # events recorded during the failed POST are newer
            self._record(key, kind)


def _answer(body: bytes) -> dict:
    """The conductor's answer: ``resync`` (it does not know this store: sync in full) and
    ``dead_after_s`` (how long a silent store stays in its index); {} if unreadable."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return answer if isinstance(answer, dict) else {}
