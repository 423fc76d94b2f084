"""Async client of a store's data port: batched, pipelined, receives into caller memory.

    client = await StoreClient.connect("127.0.0.1:8101", token=None)
    num_new = await client.put(keys, blocks, num_layers=L)          # blocks: bytes-like, one per key
    await client.put(keys, slices, num_layers=2, first_layer=4, block_layers=L)   # layers 4..5 only
    blocks = await client.get(keys)                                  # list[memoryview | None]
    await client.get(keys, out=[tensor_bytes_view, ...])             # lands in your buffers
    layer_slices = await client.get_layers(keys, first_layer=3, num_layers=1)
    n = await client.match(keys)     # longest cached prefix (any tier)
    await client.close()

On the same node as the store, block bytes move through shared memory (``store/shm_client.py``)
when the store offers it and this process can use it, else over the socket; ``transport`` says which.

Large requests are split into batches (``max_batch_bytes`` / ``max_batch_keys``) that are all in
flight at once on the one connection. Errors from the store raise ``RemoteError`` (``code`` is
``full``, ``bad_request``, ...); a lost connection raises ``ConnectionError``; a store that does
not answer within ``timeout`` (default 10 s; a cut-off node) raises ``NoAnswer``, a
``TimeoutError`` naming the store and the op ("store 10.0.0.3:7002 get_layers: no answer in 10 s").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mooncake_lite.common import tracing
from mooncake_lite.store.protocol import Op, keys_to_hex, parse_peer
from mooncake_lite.store.shm_client import ShmPath, attach
from mooncake_lite.transfer.client import FrameClient, NoAnswer, RemoteError
from mooncake_lite.transfer.framing import Buffer, Frame, Header, as_bytes_view
from mooncake_lite.transfer.kv_layout import META_KEY, BlockLayout, HeadRange

__all__ = ["StoreClient", "RemoteError", "NoAnswer", "DEFAULT_TIMEOUT_S"]
DEFAULT_TIMEOUT_S = 10.0   # far beyond any batch on a working link; a store silent this long is cut off
# A replicate is answered only once the store has pulled from its peer: the pull gets this share
# of the caller's deadline, so its own error (naming the peer) comes back before the caller gives up.
REPLICATE_PULL_SHARE = 0.8
T = TypeVar("T")
_TRACED_REPLY = ("num_new", "num_matched", "num_deleted")   # reply figures a store op's span shows


@dataclass(eq=False)
class StoreClient:
    """A connection to one store; ``connect`` makes one. Its request deadline is the
    connection's (``timeout``)."""
    frames: FrameClient
    address: str
    max_batch_bytes: int
    max_batch_keys: int
    shm: ShmPath | None = None   # the same-node fast path, when the store and we can use it

    @classmethod
    async def connect(cls, address: str, *, token: str | None = None, name: str = "store-client",
                      max_batch_bytes: int = 64 << 20, max_batch_keys: int = 1024,
                      timeout: float | None = DEFAULT_TIMEOUT_S, shm: bool = True) -> StoreClient:
        """Connect to a store's data address ``host:port`` and do the token handshake.
        ``timeout`` (seconds; None: no deadline) bounds the connect and every request: NoAnswer
        (a ``TimeoutError``) when exceeded, and the connection stays usable (a late reply is
        discarded). ``shm=False``: TCP even on the store's node."""
        host, port = parse_peer(address)
        label = f"store {address}"
        frames = await FrameClient.connect(host, port, token=token, name=name, timeout=timeout or DEFAULT_TIMEOUT_S,
                                           label=label)
        client = cls(frames, address, max_batch_bytes, max_batch_keys)
        client.timeout = timeout
        frames.op_name = _op_name
        if shm:
            try:
                client.shm = await asyncio.wait_for(attach(frames), timeout or DEFAULT_TIMEOUT_S)
            except TimeoutError:
                await client.close()
                raise NoAnswer(label, "shm attach", timeout or DEFAULT_TIMEOUT_S) from None
            except BaseException:
                await client.close()
                raise
        return client

    @property
    def timeout(self) -> float | None:
        """Every request's deadline (None: none), kept as the connection's request_timeout."""
        return self.frames.request_timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self.frames.request_timeout = seconds

    @property
    def transport(self) -> str:
        """How block bytes move: "shm" (the store's slab mapped here) or "tcp"."""
        return "tcp" if self.shm is None else "shm"

    async def _request(self, op: Op, meta: dict[str, Any], payload: Sequence[memoryview] = (),
                       sink=None) -> Frame:
        # The deadline is the connection's request_timeout (``timeout``): NoAnswer names the store
        # (the connection's label) and the op; the frame goes out before we yield.
        if tracing.is_enabled():
            return await self._traced(op, meta, payload, lambda: self.frames.request(op, meta, payload, sink=sink))
        return await self.frames.request(op, meta, payload, sink=sink)

    async def _traced(self, op: Op, meta: dict[str, Any], payload: Sequence[memoryview],
                      send: Callable[[], Awaitable[Frame]]) -> Frame:
        """``send()`` the op, in a span when a traced request caused it (one under a current
        span; not e.g. a stage's handshake); its traceparent rides in the frame meta (``"tp"``)."""
        span = tracing.child_span(f"store.{op.name.lower()}", kind="client", store=self.address,
                                  keys=len(meta.get("keys") or "") // 32 or None,   # 32 hex characters a key
                                  bytes=sum(v.nbytes for v in payload) or None)
        if span is None:
            return await send()
        tracing.add_to_meta(meta, tracing.traceparent(span))
        try:
            reply = await send()
        except BaseException as exc:
            tracing.end_span(span, f"{type(exc).__name__}: {exc}")
            raise
        tracing.end_span(span, **{k: v for k, v in reply.meta.items() if k in _TRACED_REPLY})
        return reply

    async def close(self) -> None:
        await self.frames.close()
        if self.shm is not None:
            self.shm.close()

    @property
    def is_closed(self) -> bool:
        return self.frames.is_closed

    @property
    def slot_bytes(self) -> int | None:
        """The largest block the store accepts (its ``--slot-bytes``, from its HELLO reply);
        None from a store too old to say."""
        value = self.frames.hello.get("slot_bytes")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    # ---- writes ------------------------------------------------------------------------------
    async def put(self, keys: Sequence[bytes], blocks: Sequence[Buffer], num_layers: int = 1,
                  first_pos: int = 0, *, first_layer: int | None = None, block_layers: int | None = None,
                  layout: BlockLayout | None = None, heads: HeadRange | None = None) -> int:
        """Store ``blocks[i]`` under ``keys[i]``; ``first_pos`` is keys[0]'s position in its chain.
        Returns how many blocks were new. Each batch is atomic; blocks must stay unchanged until
        this returns. With ``first_layer``, each of ``blocks`` is only layers ``[first_layer,
        first_layer + num_layers)`` of a block of ``block_layers`` layers (a CPP stage's slice):
        the store shows the block once all its layers are in, and the count is of those.
        ``layout`` names the blocks' layout (``transfer/kv_layout.py``); with ``heads`` too, each of
        ``blocks`` is only those KV heads of its layers (a tensor-parallel rank's slice, laid out
        as the block's heads are: per layer, the heads' records), assembled like layer slices."""
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        extra: dict[str, Any] = {} if layout is None else {META_KEY: layout.to_meta()}
        if heads is not None:
            if layout is None:
                raise ValueError("a head slice put (heads) needs the block's layout")
            extra["heads"] = heads.to_meta()
            if first_layer is None:
                first_layer, block_layers = 0, layout.num_layers
        if first_layer is not None:
            if block_layers is None:
                raise ValueError("a slice put (first_layer) needs block_layers, the whole block's layer count")
            extra.update(first_layer=first_layer, block_layers=block_layers)
        views = [as_bytes_view(b) for b in blocks]
        shm = self.shm
        # The single-block channel carries no meta: only whole blocks (the store's HELLO named its layout).
        if len(keys) == 1 and "first_layer" not in extra and shm is not None and shm.fast is not None \
                and not tracing.is_enabled():
            num_new = await shm.fast_put(keys[0], views[0], num_layers, first_pos, self.timeout)   # same node
            if num_new is not None:
                return num_new
        batches = self._split(len(keys), [v.nbytes for v in views], self._put_batch_bytes())
        replies = await _all(self._put_batch({"keys": keys_to_hex(keys[a:b]), "sizes": [v.nbytes for v in views[a:b]],
                                              "num_layers": num_layers, "first_pos": first_pos + a, **extra},
                                             views[a:b])
                             for a, b in batches)
        return sum(r.meta["num_new"] for r in replies)

    def _put_batch_bytes(self) -> int:
        # Through shared memory, batches of half the staging area: one is copied in while the
        # store copies the other out.
        if self.shm is None or self.shm.staging is None:
            return self.max_batch_bytes
        return max(1, min(self.max_batch_bytes, self.shm.staging.size // 2))

    async def _put_batch(self, meta: dict[str, Any], views: list[memoryview]) -> Frame:
        if self.shm is not None and self.shm.fits([v.nbytes for v in views]):
            if tracing.is_enabled():   # traced as a put over the socket is
                return await self._traced(Op.PUT, meta, views, lambda: self._shm_put(meta, views))
            return await self._shm_put(meta, views)
        return await self._request(Op.PUT, meta, views)

    async def _shm_put(self, meta: dict[str, Any], views: list[memoryview]) -> Frame:
        try:
            return await self.shm.put(meta, views, self.timeout)   # type: ignore[union-attr]
        except TimeoutError as exc:
            raise exc if isinstance(exc, NoAnswer) else NoAnswer(self.frames.label, "put", self.timeout or 0) from None

    async def delete(self, keys: Sequence[bytes]) -> int:
        replies = await self._each_batch(Op.DELETE, keys)
        return sum(r.meta["num_deleted"] for r in replies)

    async def replicate(self, keys: Sequence[bytes], peer: str, first_pos: int = 0) -> dict[str, int]:
        """Ask this store to pull ``keys`` from the store at ``peer`` ("host:port"). With a
        deadline, the store's pull gets most of it (``timeout_s``) and answers a peer that does
        not (a cut node) with a ``peer_error`` naming it."""
        meta: dict[str, Any] = {"keys": keys_to_hex(keys), "peer": peer, "first_pos": first_pos}
        if self.timeout:
            meta["timeout_s"] = self.timeout * REPLICATE_PULL_SHARE
        reply = await self._request(Op.REPLICATE, meta)
        return {k: int(v) for k, v in reply.meta.items()}

    # ---- reads -------------------------------------------------------------------------------
    async def get(self, keys: Sequence[bytes], out: Sequence[Buffer | None] | None = None) -> list[memoryview | None]:
        """Whole blocks; None for misses. With ``out``, block i is received into ``out[i]``
        (which must be big enough) and the result is a view of it."""
        shm = self.shm
        if len(keys) == 1 and shm is not None and shm.fast is not None and not tracing.is_enabled() \
                and not shm.covers(keys):   # one block on the same node: the single-get channel
            view = None if out is None or out[0] is None else as_bytes_view(out[0])
            if out is not None and len(out) != 1:
                raise ValueError(f"1 key but {len(out)} output buffers")
            got = await shm.fast_get(keys[0], view, self.timeout)
            if got is not None:
                return [got[0]]
        return [item[0] if item else None for item in await self._read(Op.GET, keys, out, {})]

    async def get_blocks(self, keys: Sequence[bytes]) -> list[tuple[memoryview, int] | None]:
        """Whole blocks with their layer counts: ``(bytes, num_layers)`` or None per key."""
        return await self._read(Op.GET, keys, None, {})

    async def get_layers(self, keys: Sequence[bytes], first_layer: int, num_layers: int,
                         out: Sequence[Buffer | None] | None = None, *, layout: BlockLayout | None = None,
                         heads: HeadRange | None = None) -> list[memoryview | None]:
        """Layers ``[first_layer, first_layer + num_layers)`` of each block (one contiguous slice);
        with ``heads`` (and the blocks' ``layout``), only those KV heads of them: what a reader at
        another TP degree than the writers' holds. Over TCP the store sends only those heads (one run
        per layer); through shared memory the heads are cut here from the layer range in the slab
        (into ``out[i]`` when given)."""
        extra: dict[str, Any] = {"first_layer": first_layer, "num_layers": num_layers}
        if heads is not None and layout is None:
            raise ValueError("a head range read (heads) needs the blocks' layout")
        if heads is not None and self.shm is None:
            extra |= {"heads": heads.to_meta(), META_KEY: layout.to_meta()}
        if heads is None or self.shm is None:
            items = await self._read(Op.GET_LAYERS, keys, out, extra)
            return [item[0] if item else None for item in items]
        whole = await self.get_layers(keys, first_layer, num_layers)
        outs = [None] * len(keys) if out is None else [as_bytes_view(o) for o in out]
        return [None if view is None else layout.cut(view, first_layer, num_layers, heads, target)
                for view, target in zip(whole, outs)]

    async def match(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` the store holds."""
        if not keys:
            return 0
        reply = await self._request(Op.MATCH, {"keys": keys_to_hex(keys)})
        return int(reply.meta["num_matched"])

    async def match_and_pin(self, keys: Sequence[bytes], lease_s: float) -> tuple[int, int]:
        """Like ``match``, and the matched prefix is brought into DRAM and pinned for up to
        ``lease_s`` seconds (capped by the store's --lease-ttl) so it cannot be evicted before you
        load it. Returns ``(num_matched, lease_id)``; call ``release(lease_id)`` when done (closing
        the connection releases it too). Through shared memory, gets of pinned blocks then read
        the slab directly, without asking the store."""
        meta: dict[str, Any] = {"keys": keys_to_hex(keys), "lease_s": lease_s}
        if self.shm is not None:
            meta["shm"] = True
        reply = await self._request(Op.MATCH, meta)
        num, lease_id = int(reply.meta["num_matched"]), int(reply.meta["lease_id"])
        if self.shm is not None:
            self.shm.remember(lease_id, keys[:num], reply.meta.get("spans"), lease_s)
        return num, lease_id

    async def release(self, lease_id: int) -> bool:
        """End a ``match_and_pin`` lease early. False if it had already expired."""
        if self.shm is not None:
            self.shm.forget(lease_id)
        reply = await self._request(Op.RELEASE, {"lease_id": lease_id})
        return bool(reply.meta["released"])

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        replies = await self._each_batch(Op.EXISTS, keys)
        return [bool(x) for r in replies for x in r.meta["exists"]]

    # ---- helpers -----------------------------------------------------------------------------
    def _split(self, num: int, sizes: Sequence[int] | None = None, max_bytes: int | None = None) -> list[tuple[int, int]]:
        batches, start, nbytes = [], 0, 0
        max_bytes = max_bytes or self.max_batch_bytes
        for i in range(num):
            size = sizes[i] if sizes else 0
            if i > start and (i - start >= self.max_batch_keys or nbytes + size > max_bytes):
                batches.append((start, i))
                start, nbytes = i, 0
            nbytes += size
        if num > start:
            batches.append((start, num))
        return batches

    async def _each_batch(self, op: Op, keys: Sequence[bytes]) -> list[Frame]:
        return await _all(self._request(op, {"keys": keys_to_hex(keys[a:b])})
                          for a, b in self._split(len(keys)))

    async def _read(self, op: Op, keys: Sequence[bytes], out: Sequence[Buffer | None] | None,
                    extra: dict[str, Any]) -> list[tuple[memoryview, int] | None]:
        if out is not None and len(out) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(out)} output buffers")
        outs = [None if o is None else as_bytes_view(o) for o in out] if out is not None else None
        if self.shm is not None and self.shm.covers(keys):   # blocks we hold a lease on: from the slab
            # Traced like a request (a prefill's layer loads show in its trace either way);
            # ``stale``: a slot changed under us, the store is asked after all (its own span).
            span = tracing.child_span(f"store.{op.name.lower()}", kind="client", store=self.address,
                                      keys=len(keys)) if tracing.is_enabled() else None
            local = self.shm.read_pinned(keys, outs, _layer_range(extra))
            tracing.end_span(span, transport="shm", stale=local is None)
            if local is not None:
                return local   # type: ignore[return-value]
        if len(keys) <= self.max_batch_keys:   # one batch (a single get: no splitting on its path)
            return await self._read_batch(op, keys, outs, extra)
        batches = self._split(len(keys))
        parts = await _all(self._read_batch(op, keys[a:b], outs[a:b] if outs else None, extra)
                           for a, b in batches)
        return [view for part in parts for view in part]

    async def _read_batch(self, op: Op, keys: Sequence[bytes], outs: list[memoryview | None] | None,
                          extra: dict[str, Any]) -> list[tuple[memoryview, int] | None]:
        if self.shm is None:
            return await self._read_batch_tcp(op, keys, outs, extra)
        result, stale = await self.shm.read(self._request, op, {"keys": keys_to_hex(keys), **extra}, outs)
        if stale:   # reused by the store while we copied (a lease ran out): ask again on the socket
            again = await self._read_batch_tcp(op, [keys[i] for i in stale],
                                               [result[i][0] for i in stale], extra)  # type: ignore[index]
            for i, item in zip(stale, again):
                result[i] = item
        return result

    async def _read_batch_tcp(self, op: Op, keys: Sequence[bytes], outs: list[memoryview | None] | None,
                              extra: dict[str, Any]) -> list[tuple[memoryview, int] | None]:
        used_out = False

        def sink(header: Header, meta: dict[str, Any]) -> list[memoryview] | None:
            nonlocal used_out
            sizes = meta.get("sizes")
            if outs is None or not isinstance(sizes, list) or len(sizes) != len(outs):
                return None
            views = []
            for size, target in zip(sizes, outs):
                if size:
                    if target is None or target.nbytes < size:
                        return None  # fall back to a fresh buffer, then copy
                    views.append(target[:size])
            used_out = True
            return views

        frame = await self._request(op, {"keys": keys_to_hex(keys), **extra}, sink=sink if outs else None)
        sizes, layer_counts = frame.meta["sizes"], frame.meta["num_layers"]
        whole = frame.payload[0] if (frame.payload and not used_out) else None
        result: list[tuple[memoryview, int] | None] = []
        offset = 0
        for i, size in enumerate(sizes):
            if not size:
                result.append(None)
            elif used_out:
                result.append((outs[i][:size], layer_counts[i]))  # type: ignore[index]
            else:
                view = whole[offset:offset + size]  # type: ignore[index]
                if outs is not None and outs[i] is not None and outs[i].nbytes >= size:
                    outs[i][:size] = view
                    view = outs[i][:size]
                result.append((view, layer_counts[i]))
                offset += size
        return result


def _op_name(op: int) -> str:
    """How a NoAnswer names a store op ("store 10.0.0.3:7002 get_layers: no answer in 10 s")."""
    try:
        return Op(op).name.lower()
    except ValueError:
        return f"op {op}"


def _layer_range(extra: dict[str, Any]) -> tuple[int, int] | None:
    return (extra["first_layer"], extra["num_layers"]) if "first_layer" in extra else None


async def _all(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Run batches concurrently; a single batch is awaited directly (no task to schedule)."""
    items = list(coros)
    if len(items) == 1:
        return [await items[0]]
    return list(await asyncio.gather(*items))
