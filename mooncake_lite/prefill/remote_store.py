"""The store role as a prefill stage's :class:`~mooncake_lite.prefill.store_io.PrefixStore`.

A thin adapter over :class:`mooncake_lite.store.client.StoreClient` (one connection, reopened
when lost). A store that is down never fails a request by itself: ``match`` then answers 0 (the
prefill recomputes), a load that fails midway (the store died, a block vanished between ``match``
and its load) makes the stage recompute the prefix (``prefill/engine.py``), and write-back
failures are counted and logged by the stage (``prefill/writeback.py``). A block larger than
the store's slots (``--slot-bytes``, from its handshake) is refused here, before its bytes are
sent. Every op ends within ``timeout`` s (a store on a cut-off node answers nothing): NoAnswer,
an OSError naming the store and the op, which the stage treats as a failed load (recompute);
``match``, tiny and on every request's way to its first token, within ``quick_timeout`` s. A
store that did not answer is then *down* (``store/link.py``): until a probe reaches it again
every op fails at once (``match`` answers 0), so a stopped store costs the requests in flight
at that moment one deadline, not every request the whole hang.

A stage that owns only some layers (a CPP stage) writes its layer slice of each new block; the
store assembles the group's slices and shows a block only once all its layers are in
(``store/assembly.py``). Each stage loads its own layer range of cached blocks. Given the
blocks' ``layout`` (``transfer/kv_layout.py``), puts name it; given ``heads`` too (a tensor-parallel
rank's, ``transfer/tp_heads.py``), values are those heads of their layers, put as head slices and
loaded as head ranges, whatever the TP degree the blocks were written at.

On the store's node (the client's transport is "shm") ``match`` pins the matched prefix under a
lease (``match_and_pin``), which also tells the client where the pinned blocks are in the mapped
slab: the layer-by-layer ``get_layers`` that follow copy them straight out of it, no request
per layer (``store/shm_client.py``; a block whose slot changed generation, a lease that ran out
or was released go back to asking the store). The stage calls ``prefix_loaded`` once its loads
are over, which hands one lease covering that prefix back. Leases are pooled by their prefix's
first key, not tied to a request (``match`` is asked before the request exists): releasing the
shortest lease that covers the prefix keeps every other loading request covered by one.
A lease nobody hands back (its request never began, or began with a shorter prefix than
matched because a later CPP stage had less) ends at ``lease_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake_lite.prefill.writeback import BlockTooLarge
from mooncake_lite.store.client import DEFAULT_TIMEOUT_S, RemoteError, StoreClient
from mooncake_lite.store.link import StoreLink
from mooncake_lite.transfer.kv_layout import BlockLayout, HeadRange

log = logging.getLogger(__name__)
QUICK_TIMEOUT_S = 2.0   # MATCH: a few hundred bytes each way; a store this slow is taken for down
# How long a matched prefix stays pinned at most: from the MATCH (the request may still queue)
# to the end of its layer loads. The store caps it by its --lease-ttl.
PREFIX_LEASE_S = 10.0


@dataclass(frozen=True)
class _Lease:
    num_keys: int            # it pins keys[:num_keys] of the chain that starts with its pool's key
    lease_id: int
    client: StoreClient      # the connection that owns it (a lease ends with its connection)
    ends_at: float           # loop time


@dataclass(eq=False)
class RemoteStore:
    address: str
    token: str | None
    num_layers: int
    layer_bytes: int
    timeout: float = DEFAULT_TIMEOUT_S
    lease_s: float = PREFIX_LEASE_S
    layout: BlockLayout | None = None   # the whole blocks' (layer_bytes is of this rank's heads)
    heads: HeadRange | None = None      # this rank's KV heads (None: all)
    # A tensor-parallel instance's writing ranks' heads: whole blocks go as one head-slice put per
    # rank, the puts those ranks would make themselves (rank 0 cuts them until they do; the store
    # assembles them, docs/store.md §2e-§2f). None: one put of all heads.
    writers: tuple[HeadRange, ...] | None = None
    quick_timeout: float = QUICK_TIMEOUT_S
    shm: bool = True                    # False: TCP even on the store's node (benchmarks, tests)
    # first key of a pinned prefix -> its leases
    _leases: dict[bytes, list[_Lease]] = field(default_factory=dict, init=False, repr=False)
    _releases: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)
    link: StoreLink = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.link = StoreLink(self.address, self.token, "prefill", self.timeout, self.shm)

    @property
    def is_down(self) -> bool:
        return self.link.is_down

    async def client(self) -> StoreClient:
        return await self.link.client()

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

    async def kv_layout(self) -> object:
        """The block layout version the store keeps (``transfer/kv_layout.py``); None from an older store."""
        return (await self.client()).frames.hello.get("kvl")

    async def match(self, keys: Sequence[bytes]) -> int:
        try:
            return await self.link.call(lambda c: self._match(c, keys), self.quick_timeout, "match")
        except (ConnectionError, OSError, asyncio.TimeoutError) as exc:
            log.warning("store %s unreachable (%s); computing without prefix reuse", self.address, exc)
            return 0

    async def _match(self, client: StoreClient, keys: Sequence[bytes]) -> int:
        if client.transport != "shm" or not keys:
            return await client.match(keys)
        num, lease_id = await client.match_and_pin(keys, self.lease_s)
        if not num:
            self._release(_Lease(0, lease_id, client, 0.0))
            return 0
        now = asyncio.get_running_loop().time()
        self._prune(now)
        self._leases.setdefault(keys[0], []).append(_Lease(num, lease_id, client, now + self.lease_s))
        return num

    def prefix_loaded(self, keys: Sequence[bytes]) -> None:
        """The layer loads of a request whose prefix is ``keys`` are over (done, failed or given
        up): hand back the shortest live lease covering them (see the module doc). Never waits."""
        pool = self._leases.get(keys[0]) if keys else None
        if not pool:
            return
        now = asyncio.get_running_loop().time()
        fits = [lease for lease in pool if lease.num_keys >= len(keys) and lease.ends_at > now]
        if fits:
            lease = min(fits, key=lambda lease: lease.num_keys)
            pool.remove(lease)
            self._release(lease)
        if not pool:
            del self._leases[keys[0]]

    @property
    def num_leases(self) -> int:
        """Match leases held for loads not over yet (they may have run out at the store)."""
        return sum(len(pool) for pool in self._leases.values())

    def _prune(self, now: float) -> None:
        """Forget leases past their end (the store has ended them; nothing to send)."""
        for first in [k for k, pool in self._leases.items() if any(lease.ends_at <= now for lease in pool)]:
            live = [lease for lease in self._leases[first] if lease.ends_at > now]
            if live:
                self._leases[first] = live
            else:
                del self._leases[first]

    def _release(self, lease: _Lease) -> None:
        """RELEASE in the background: nothing reads through the lease from now on (forgotten at
        once), and a store that does not answer ends it at its expiry anyway."""
        client = lease.client
        if client.is_closed:
            return   # the lease ended with its connection
        if client.shm is not None:
            client.shm.forget(lease.lease_id)
        task = asyncio.ensure_future(self._send_release(client, lease.lease_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _send_release(self, client: StoreClient, lease_id: int) -> None:
        try:
            await client.release(lease_id)
        except (ConnectionError, OSError, asyncio.TimeoutError, RemoteError) as exc:
            log.debug("store %s: releasing lease %d failed (%s); it ends at its expiry", self.address,
                      lease_id, exc)

    async def get_layers(self, keys: Sequence[bytes], first_layer: int, num_layers: int,
                         out: Sequence[memoryview] | None = None) -> list[memoryview]:
        """With ``out``, each block's slice is copied from the slab (same node) or received
        from the socket (TCP) straight into its buffer: no fresh memory, no second copy."""
        views = await self.link.call(lambda c: c.get_layers(keys, first_layer, num_layers, out=out,
                                                        layout=self.layout, heads=self.heads))
        missing = [k.hex() for k, v in zip(keys, views) if v is None]
        if missing:
            raise KeyError(f"{len(missing)} block(s) missing from store {self.address}, first {missing[0]}")
        return views

    async def put_layers(self, keys: Sequence[bytes], values: Sequence[memoryview], first_layer: int,
                         num_layers: int, first_pos: int = 0) -> None:
        """Whole blocks, or a CPP stage's slice of them (any layer range of the model)."""
        if not (0 <= first_layer and num_layers >= 1 and first_layer + num_layers <= self.num_layers):
            raise ValueError(f"layers [{first_layer}, {first_layer + num_layers}) are not of this "
                             f"{self.num_layers}-layer model")
        client = await self.client()
        slot = client.slot_bytes
        whole = max((v.nbytes for v in values), default=0) // num_layers * self.num_layers
        if self.heads is not None and self.layout is not None:
            whole = whole // self.heads.num_heads * self.layout.num_heads
        if slot is not None and whole > slot:
            # Refused before sending: the store would read and drop every byte of it.
            raise BlockTooLarge(f"block of {whole} bytes does not fit store {self.address}'s "
                                f"{slot}-byte slots (--slot-bytes)")
        # A slice (first_layer given): the store holds it apart until the other stages' slices are in.
        sliced = first_layer if num_layers < self.num_layers else None
        if self.writers is None or self.heads is not None or self.layout is None:
            puts = [(self.heads, values)]
        else:
            puts = [(h, [self.layout.cut(memoryview(v).cast("B"), first_layer, num_layers, h) for v in values])
                    for h in self.writers]
        for heads, part in puts:
            await self.link.call(lambda c, h=heads, p=part: c.put(
                keys, p, num_layers=num_layers, first_pos=first_pos, first_layer=sliced,
                block_layers=self.num_layers, layout=self.layout, heads=h))

    async def replicate(self, keys: Sequence[bytes], peer: str) -> dict[str, int]:
        """Hot-spot migration: have our store pull ``keys`` from the store at ``peer``."""
        return await self.link.call(lambda c: c.replicate(keys, peer))

    async def close(self) -> None:
        for task in list(self._releases):   # its leases end with the connection anyway
            task.cancel()
        self._leases.clear()
        await self.link.close()
