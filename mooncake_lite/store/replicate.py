"""Store-to-store replication: pull blocks from a peer store (the conductor's hot-spot migration).

The pulling store keeps one client connection per peer, asks only for blocks it lacks, and puts
each received block through the normal reserve/commit path (atomic, evicting as needed).
"""

from __future__ import annotations

import logging

from mooncake_lite.store.blocks import BlockStore
from mooncake_lite.store.client import StoreClient
from mooncake_lite.transfer.peers import PeerClients

log = logging.getLogger(__name__)


class Replicator:
    def __init__(self, store: BlockStore, *, token: str | None, self_address: str = "") -> None:
        self.store = store
        self.token = token
        self.self_address = self_address
        self._peers: PeerClients[tuple[str, int], StoreClient] = PeerClients(self._connect)

    async def __call__(self, keys: list[bytes], peer: tuple[str, int], first_pos: int = 0) -> dict[str, int]:
        if f"{peer[0]}:{peer[1]}" == self.self_address:
            raise RuntimeError("a store cannot replicate from itself")
        wanted = [(i, k) for i, k in enumerate(keys) if k not in self.store]
        num_copied = num_missing = num_bytes = 0
        if wanted:
            client = await self._peers.get(peer)
            blocks = await client.get_blocks([k for _, k in wanted])
            for (i, key), item in zip(wanted, blocks):
                if item is None:
                    num_missing += 1
                    continue
                num_copied += self._put_local(key, item[0], item[1] or 1, first_pos + i)
                num_bytes += item[0].nbytes
        log.info("replicated %d block(s) from %s:%d (%d present, %d missing at the peer)",
                 num_copied, peer[0], peer[1], len(keys) - len(wanted), num_missing)
        # num_bytes: what crossed the link, so a caller timing the pull can tell the link's speed
        return {"num_copied": num_copied, "num_present": len(keys) - len(wanted), "num_missing": num_missing,
                "num_bytes": num_bytes}

    def _put_local(self, key: bytes, data: memoryview, num_layers: int, chain_pos: int) -> int:
        ticket = self.store.reserve([key], [data.nbytes], num_layers, chain_pos)
        try:
            for view in self.store.ticket_views(ticket, memoryview(bytearray(0))):
                view[:] = data
        except BaseException:
            self.store.cancel(ticket)
            raise
        return self.store.commit(ticket)

    async def _connect(self, peer: tuple[str, int]) -> StoreClient:
        return await StoreClient.connect(f"{peer[0]}:{peer[1]}", token=self.token, name="store-replicator")

    async def close(self) -> None:
        await self._peers.close()
