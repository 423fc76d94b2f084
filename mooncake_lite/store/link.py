"""One role's connection to its store, kept: dialled on first use, dialled again after it broke,
and skipped while the store does not answer (issue #37).

A store that did not answer an op within its deadline (a SIGSTOPped process: the kernel still
accepts connections, nothing is answered; a cut-off node), or could not be dialled, is *down*:
the connection is dropped, one background probe dials every ``PROBE_EVERY_S`` until the store's
hello comes back, and until then every op fails at once with :class:`StoreDown`. So a stopped
store costs the ops in flight at that moment one deadline, not every later op one each for the
whole hang. The prefill's prefix store (``prefill/remote_store.py``: a down store means
recompute) and the decode's write-back (``decode/writeback.py``: blocks counted as failed) both
hold one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from mooncake_lite.store.client import DEFAULT_TIMEOUT_S, NoAnswer, StoreClient

log = logging.getLogger(__name__)
T = TypeVar("T")
PROBE_EVERY_S = 0.5     # while down: how often the probe dials again


class StoreDown(ConnectionError):
    """The store did not answer lately and no probe has reached it since: not asked."""


class StoreLink:
    """The kept connection to the store at ``address`` (``name``: what the store's log calls
    it); every request gets ``timeout`` s, or the deadline :meth:`call` is given. ``shm`` False:
    TCP even on the store's node (benchmarks and tests of that path)."""

    def __init__(self, address: str, token: str | None, name: str, timeout: float = DEFAULT_TIMEOUT_S,
                 shm: bool = True) -> None:
        self.address, self.token, self.name, self.timeout, self.shm = address, token, name, timeout, shm
        self._client: StoreClient | None = None
        self._lock = asyncio.Lock()
        self._probe: asyncio.Task | None = None     # running while the store is down

    @property
    def is_down(self) -> bool:
        return self._probe is not None

    async def client(self) -> StoreClient:
        """The open connection (dialled now if there is none); StoreDown while the store is down."""
        if self.is_down:
            raise StoreDown(f"store {self.address} is not answering (a probe is dialling it); not asked")
        async with self._lock:
            if self._client is None or self._client.is_closed:
                try:
                    self._client = await self._connect()
                except OSError:
                    self._set_down()
                    raise
            return self._client

    async def call(self, op: Callable[[StoreClient], Awaitable[T]], deadline: float | None = None,
                   what: str = "request") -> T:
        """``await op(client)`` within ``deadline`` (None: the connection's per-request ``timeout``);
        a store that did not answer loses its connection (a cut link leaves it open but dead) and
        is down until the probe reaches it. NoAnswer names the store and ``what``."""
        client = await self.client()
        try:
            return await (op(client) if deadline is None else asyncio.wait_for(op(client), deadline))
        except asyncio.TimeoutError as exc:   # (NoAnswer is one)
            client.frames.abort()
            await client.close()
            self._set_down()
            if isinstance(exc, NoAnswer):
                raise
            raise NoAnswer(f"store {self.address}", what, deadline or 0) from None

    async def _connect(self) -> StoreClient:
        return await StoreClient.connect(self.address, token=self.token, name=self.name, timeout=self.timeout,
                                         shm=self.shm)

    def _set_down(self) -> None:
        if self._probe is None:
            log.warning("store %s is not answering (%s): its ops fail at once until it does", self.address, self.name)
            self._probe = asyncio.ensure_future(self._dial_until_up())

    async def _dial_until_up(self) -> None:
        """The down store's probe: dial until its hello comes back; that connection is then the one
        ops use."""
        while True:
            try:
                client = await self._connect()
                break
            except OSError as exc:
                log.debug("store %s still down: %s", self.address, exc)
                await asyncio.sleep(PROBE_EVERY_S)
        old, self._client, self._probe = self._client, client, None
        if old is not None and not old.is_closed:
            await old.close()
        log.warning("store %s answers again (%s)", self.address, self.name)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._client is not None:
            await self._client.close()
