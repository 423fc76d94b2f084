"""The store role as a prefill stage's :class:`~mooncake_lite.prefill.store_io.PrefixStore`.

A thin adapter over :class:`mooncake_lite.store.client.StoreClient` (one connection, reopened
when lost). A store that is down never fails a request by itself: ``match`` then answers 0 (the
prefill recomputes), a load that fails midway (the store died, a block vanished between ``match``
and its load) makes the stage recompute the prefix (``prefill/engine.py``), and write-back
failures are counted and logged by the stage (``prefill/writeback.py``). A block larger than
the store's slots (``--slot-bytes``, from its handshake) is refused here, before its bytes are
sent. Every op ends within ``timeout`` s (a store on a cut-off node answers nothing): NoAnswer,
an OSError naming the store and the op, which the stage treats as a failed load (recompute);
the connection is then dropped, so the next op dials afresh.

A stage that owns only some layers (a CPP stage) writes its layer slice of each new block; the
store assembles the group's slices and shows a block only once all its layers are in
(``store/assembly.py``). Each stage loads its own layer range of cached blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from mooncake_lite.prefill.writeback import BlockTooLarge
from mooncake_lite.store.client import DEFAULT_TIMEOUT_S, NoAnswer, StoreClient

log = logging.getLogger(__name__)


class RemoteStore:
    def __init__(self, address: str, token: str | None, num_layers: int, layer_bytes: int,
                 timeout: float = DEFAULT_TIMEOUT_S):
        self.address = address
        self.timeout = timeout
        self.token = token
        self.num_layers = num_layers
        self.layer_bytes = layer_bytes
        self._client: StoreClient | None = None
        self._lock = asyncio.Lock()

    async def client(self) -> StoreClient:
        async with self._lock:
            if self._client is None or self._client.is_closed:
                self._client = await StoreClient.connect(self.address, token=self.token, name="prefill",
                                                         timeout=self.timeout)
            return self._client

    async def _call(self, op):
        """``await op(client)``; a store that did not answer loses its connection: a cut link
        leaves it open but dead, and every later op would wait out its deadline on it again."""
        client = await self.client()
        try:
            return await op(client)
        except NoAnswer:
            client.frames.abort()
            await client.close()
            raise

    async def store_id(self) -> str | None:
        """The id the store's block events carry (its advertised data address), which may be
        spelled differently from the address this instance dials; None from an older store."""
        store_id = (await self.client()).frames.hello.get("store_id")
        return store_id if isinstance(store_id, str) and store_id else None

    async def slot_bytes(self) -> int | None:
        """The largest block the store accepts (its --slot-bytes); None from an older store."""
        return (await self.client()).slot_bytes

    async def kv_compression(self) -> str | None:
        """How the store's blocks are encoded (its --kv-compression); None from an older store."""
        value = (await self.client()).frames.hello.get("kv_compression")
        return value if isinstance(value, str) else None

    async def match(self, keys: Sequence[bytes]) -> int:
        try:
            return await self._call(lambda c: c.match(keys))
        except (ConnectionError, OSError, asyncio.TimeoutError) as exc:
            log.warning("store %s unreachable (%s); computing without prefix reuse", self.address, exc)
            return 0

    async def get_layers(self, keys: Sequence[bytes], first_layer: int, num_layers: int) -> list[memoryview]:
        views = await self._call(lambda c: c.get_layers(keys, first_layer, num_layers))
        missing = [k.hex() for k, v in zip(keys, views) if v is None]
        if missing:
            raise KeyError(f"{len(missing)} block(s) missing from store {self.address}, first {missing[0]}")
        return views

    def can_put(self, first_layer: int, num_layers: int) -> bool:
        """Any layer range of the model: whole blocks, or a CPP stage's slice of them."""
        return 0 <= first_layer and num_layers >= 1 and first_layer + num_layers <= self.num_layers

    async def put_layers(self, keys: Sequence[bytes], values: Sequence[memoryview], first_layer: int,
                         num_layers: int, first_pos: int = 0) -> None:
        if not self.can_put(first_layer, num_layers):
            raise ValueError(f"layers [{first_layer}, {first_layer + num_layers}) are not of this "
                             f"{self.num_layers}-layer model")
        client = await self.client()
        slot = client.slot_bytes
        whole = max((v.nbytes for v in values), default=0) // num_layers * self.num_layers
        if slot is not None and whole > slot:
            # Refused before sending: the store would read and drop every byte of it.
            raise BlockTooLarge(f"block of {whole} bytes does not fit store {self.address}'s "
                                f"{slot}-byte slots (--slot-bytes)")
        if num_layers == self.num_layers:
            await self._call(lambda c: c.put(keys, values, num_layers=num_layers, first_pos=first_pos))
        else:   # a slice: the store holds it apart until the other stages' slices are in
            await self._call(lambda c: c.put(keys, values, num_layers=num_layers, first_pos=first_pos,
                                             first_layer=first_layer, block_layers=self.num_layers))

    async def replicate(self, keys: Sequence[bytes], peer: str) -> dict[str, int]:
        """Hot-spot migration: have our store pull ``keys`` from the store at ``peer``."""
        return await self._call(lambda c: c.replicate(keys, peer))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
