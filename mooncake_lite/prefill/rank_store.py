"""A tensor-parallel prefill's store, per rank (docs/store.md §2f): each rank reads its own KV
heads of a cached prefix and writes its own heads of new full blocks, on a store connection of
its own, so rank 0 neither reads the other ranks' heads nor hands them out, and gathers none of
theirs to write (the store assembles the head slices: ``store/assembly.py``).

:func:`remote_prefix_store` is the one way a prefill builds its store client, whole or of one
rank's heads (rank 0's engine store and every follower's alike). :class:`RankStore` is a
follower's: its step loop is synchronous (``model/tp_step.Follower``), so the client lives on an
event loop in a thread of its own; a layer's load is started one step ahead (the step that
writes layer i starts layer i+1's read), as rank 0's own loads are. :func:`follower_stores` is
what the prefill hands its TP group (``instance/tp_ranks.RankPlan.rank_store``), and
:func:`blocks_to_store` the blocks rank 0 packs for its write-back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.kv_codec import model_codec, stored_layer_bytes
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.tensor_parallel import TPLayout
from mooncake_lite.prefill.load_buffers import LoadBuffers, fill
from mooncake_lite.prefill.remote_store import RemoteStore
from mooncake_lite.prefill.store_io import CompressedStore, PrefixStore
from mooncake_lite.transfer.kv_layout import BlockLayout, HeadRange
from mooncake_lite.transfer.rank_streams import tensor_bytes

log = logging.getLogger(__name__)
MAX_FETCHES = 64   # reads started ahead and never taken (their request failed): the oldest dropped


def remote_prefix_store(address: str, token: str | None, compression: str | None, args: ModelArgs,
                        block_size: int, dtype: torch.dtype, heads: range | None = None,
                        writers: tuple[range, ...] | None = None) -> PrefixStore:
    """The store at ``address`` as a prefill's PrefixStore: blocks of ``args``'s layout (the whole
    model's heads, whatever the TP degree), values of ``heads`` (None: all of them), put as one
    head slice per range of ``writers`` where given; encoded under ``compression``."""
    codec = model_codec(compression, args)
    layer_bytes = stored_layer_bytes(codec, args, block_size, dtype)
    layout = BlockLayout(args.num_layers, args.num_kv_heads, layer_bytes // args.num_kv_heads, args.kv_replicated)
    mine = None if heads is None else HeadRange(heads.start, heads.stop)
    store = RemoteStore(address, token, args.num_layers, layout.slice_bytes(1, mine), layout=layout, heads=mine,
                        writers=None if writers is None else tuple(HeadRange(r.start, r.stop) for r in writers))
    num_heads = args.num_kv_heads if heads is None else len(heads)
    return store if codec is None else CompressedStore(store, codec, (block_size, num_heads, args.head_dim), dtype)


def follower_stores(address: str | None, token: str | None, compression: str | None,
                    tensor_parallel: int) -> Callable[[ModelRunner, TPLayout], RankStore] | None:
    """What a TP prefill hands its followers to open their own stores (picklable: it crosses
    to their processes); None where there is no store to share (a private one lives in rank 0)."""
    if address is None or tensor_parallel == 1:
        return None
    return functools.partial(RankStore.open, address, token, compression)


def blocks_to_store(runner: ModelRunner, block_ids: torch.Tensor, keys: Sequence[bytes],
                    first_pos: int) -> torch.Tensor:
    """The blocks ``block_ids`` (of ``keys``) this process writes back: all heads, or a TP rank 0's
    own where its followers write theirs themselves (``TPLeaderRunner.store_kv``)."""
    if runner.ranks_store:
        return runner.store_kv(block_ids, keys, first_pos)
    return runner.pack_kv(block_ids)


class RankStore:
    """A follower rank's store: its heads of prefix layers read, its heads of new blocks written."""

    def __init__(self, store: PrefixStore, buffers: LoadBuffers, layer_range: tuple[int, int]):
        self.store, self.buffers = store, buffers
        self.first_layer, self.num_layers = layer_range[0], layer_range[1] - layer_range[0]
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rank-store", daemon=True).start()
        # (load, layer) -> (its keys, the read): a load's name may come again (a request id), its keys must match
        self._fetches: OrderedDict[tuple[str, int], tuple[list[bytes], concurrent.futures.Future]] = OrderedDict()
        self.num_put_failures = 0

    @classmethod
    def open(cls, address: str, token: str | None, compression: str | None, runner: ModelRunner,
             layout: TPLayout) -> RankStore:
        args, heads = layout.args, layout.kv_heads
        store = remote_prefix_store(address, token, compression, args, runner.block_size, runner.dtype, heads)
        buffers = LoadBuffers((1, len(heads), 2, runner.block_size, args.head_dim), runner.dtype)
        return cls(store, buffers, (runner.model.first_layer, runner.model.end_layer))

    def fetch(self, fid: str, keys: Sequence[bytes], layer: int) -> None:
        """Start reading this rank's heads of ``layer`` of the blocks ``keys`` (load ``fid``'s)."""
        started = self._fetches.get((fid, layer))
        if started is not None and started[0] == list(keys):
            return
        if started is not None:
            started[1].cancel()
        buf = self.buffers.take(len(keys))
        read = asyncio.run_coroutine_threadsafe(self._read(keys, layer, buf), self.loop)
        self._fetches[(fid, layer)] = (list(keys), read)
        while len(self._fetches) > MAX_FETCHES:
            self._fetches.popitem(last=False)[1][1].cancel()

    async def _read(self, keys: Sequence[bytes], layer: int, buf):
        return buf, await self.store.get_layers(keys, layer, 1, out=buf.block_views)

    @contextlib.contextmanager
    def loaded(self, fid: str, keys: Sequence[bytes], layer: int, within_s: float) -> Iterator[torch.Tensor]:
        """This rank's heads of ``layer`` of ``keys``, ``[blocks, 1, heads, 2, block_size, head_dim]``
        (read now unless :meth:`fetch` started it), valid inside the block; raises what the read
        raised, or TimeoutError past ``within_s``."""
        self.fetch(fid, keys, layer)
        buf, views = self._fetches.pop((fid, layer))[1].result(timeout=within_s)
        fill(buf, views)
        yield buf.packed
        self.buffers.give(buf)   # only a completed read's buffer (see LoadBuffers.give)

    def put(self, keys: Sequence[bytes], packed: torch.Tensor, first_pos: int) -> None:
        """Write this rank's heads of whole blocks ``packed`` (host memory, this call's to keep), in
        the background; a failure is logged and counted (the block stays partial at the store,
        which drops it after its assembly timeout, docs/store.md §2e)."""
        values = [tensor_bytes(p) for p in packed]
        future = asyncio.run_coroutine_threadsafe(self.store.put_layers(
            keys, values, self.first_layer, self.num_layers, first_pos=first_pos), self.loop)
        future.add_done_callback(self._put_done)

    def _put_done(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.num_put_failures += 1
            log.warning("this rank's write-back of its KV heads failed (%d so far): %r", self.num_put_failures,
                        future.exception())
