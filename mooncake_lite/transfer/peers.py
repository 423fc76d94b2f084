"""One open client per peer: connected on first use, connected again once it has closed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, Protocol, TypeVar


class PeerClient(Protocol):
    @property
    def is_closed(self) -> bool: ...

    async def close(self) -> None: ...


P = TypeVar("P", bound=Hashable)
C = TypeVar("C", bound=PeerClient)


class PeerClients(Generic[P, C]):
    """The clients of one process to its peers (decode instances, other stores), keyed by the
    peer's address; callers asking for one peer at once share a single connect."""

    def __init__(self, connect: Callable[[P], Awaitable[C]]) -> None:
        self._connect = connect
        self._clients: dict[P, C] = {}
        self._locks: dict[P, asyncio.Lock] = {}

    async def get(self, peer: P) -> C:
        client = self._clients.get(peer)
        if client is not None and not client.is_closed:   # the common case: no lock to take
            return client
        lock = self._locks.get(peer)
        if lock is None:
            lock = self._locks[peer] = asyncio.Lock()
        async with lock:
            client = self._clients.get(peer)
            if client is None or client.is_closed:
                client = self._clients[peer] = await self._connect(peer)
            return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        self._locks.clear()
