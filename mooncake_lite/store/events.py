"""Block events for the conductor's index: batched, coalesced, never on the data path.

``stored(key)`` / ``evicted(key)`` only record the latest event per key (O(1), no IO). A
background task POSTs the batch every ``interval`` seconds to
``{conductor}/internal/v1/block_events`` as ``BlockEvents{store, stored: [hex], evicted: [hex]}``.
If the conductor is down, the batch is kept (newer events win) and retried with backoff;
one log line per outage, not one per attempt.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import aiohttp

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.common.protocol import BlockEvents, dumps

log = logging.getLogger(__name__)

STORED, EVICTED = True, False


class BlockEventPublisher:
    def __init__(self, conductor_url: str | None, store_address: str, *, token: str | None = None,
                 interval: float = 0.2, max_pending: int = 1_000_000, timeout: float = 5.0) -> None:
        self.url = conductor_url.rstrip("/") + "/internal/v1/block_events" if conductor_url else None
        self.store_address = store_address
        self.headers = {"Content-Type": "application/json", **cluster_headers(token)}
        self.interval = interval
        self.max_pending = max_pending
        self.timeout = timeout
        self._pending: OrderedDict[bytes, bool] = OrderedDict()
        self.num_sent = self.num_failed_posts = self.num_dropped = 0
        self._is_down = False

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
            self._pending.popitem(last=False)  # the conductor can resync from GET /blocks
            self.num_dropped += 1

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
        """POST everything pending now. True on success (or nothing to send)."""
        if self.url is None or not self._pending:
            return True
        batch, self._pending = self._pending, OrderedDict()
        msg = BlockEvents(self.store_address,
                          stored=tuple(k.hex() for k, kind in batch.items() if kind is STORED),
                          evicted=tuple(k.hex() for k, kind in batch.items() if kind is EVICTED))
        try:
            async with session.post(self.url, data=dumps(msg), headers=self.headers,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status >= 300:
                    raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=resp.status,
                                                      message=(await resp.text())[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._requeue(batch)
            self.num_failed_posts += 1
            if not self._is_down:
                log.warning("block events: conductor at %s unreachable (%s); keeping %d event(s) and retrying",
                            self.url, exc or type(exc).__name__, len(self._pending))
                self._is_down = True
            return False
        if self._is_down:
            log.info("block events: conductor reachable again")
            self._is_down = False
        self.num_sent += len(batch)
        return True

    def _requeue(self, batch: OrderedDict[bytes, bool]) -> None:
        newer = self._pending
        self._pending = batch
        for key, kind in newer.items():  # events recorded during the failed POST are newer
            self._record(key, kind)
