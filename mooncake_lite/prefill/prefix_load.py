"""Loading a request's cached prefix on one stage, layer by layer (mixed into
:class:`~mooncake_lite.prefill.engine.StageEngine`).

Layer i+1's load is launched before layer i waits for its own and computes, so loading hides
behind compute; each layer's blocks are read by the store into a reused buffer
(``load_buffers.py``), written into the paged cache and streamed to decode. A load that fails
(the store died, a block vanished) falls back to recomputing the prefix, as vLLM's
``kv_load_failure_policy=recompute`` does, instead of failing the request.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from mooncake_kernels.copies import Staged
from mooncake_lite.common import tracing
from mooncake_lite.model.runner import LayerwisePass
from mooncake_lite.prefill.job import PrefillAborted, StageJob, send_frame
from mooncake_lite.prefill.kv_sender import layer_kv, route_of
from mooncake_lite.prefill.load_buffers import LoadBuffer, fill
from mooncake_lite.transfer.client import RemoteError

log = logging.getLogger(__name__)
# What a failed prefix load raises: a block gone (KeyError), the store gone or refusing.
PREFIX_LOAD_ERRORS = (KeyError, ConnectionError, OSError, asyncio.TimeoutError, RemoteError)
RECOMPUTE_CHUNK_TOKENS = 512    # a recomputed prefix runs in passes of at most this many tokens


def _prefix_frame(packed: torch.Tensor) -> torch.Tensor:
    """The KV frame of a loaded prefix, ``[2][tokens][kv_heads][head_dim]``, from its blocks
    ``[blocks][1][kv_heads][2][block_size][head_dim]`` (head-major): the prefix is whole blocks in
    order, so this is one strided copy (4x faster here than gathering every token back out of the
    cache, and the same bytes). Always a copy: the load buffer is reused while the frame may still
    wait to be sent."""
    blocks, _, kv_heads, _, block_size, head_dim = packed.shape
    frame = torch.empty((2, blocks * block_size, kv_heads, head_dim), dtype=packed.dtype, device=packed.device)
    frame.view(2, blocks, block_size, kv_heads, head_dim).copy_(packed[:, 0].permute(2, 0, 3, 1, 4))
    return frame


class PrefixLoading:
    """The prefix loads of a StageEngine (mixed in): it sets ``runner``, ``store``, ``executor``,
    ``copier``, ``load_buffers``, ``first_layer``, ``end_layer``, ``num_prefix_fallbacks`` and
    ``num_prefix_tokens_recomputed``."""

    def _prefix_in(self, job: StageJob) -> None:
        job.prefix_done = True
        self._loads_over(job)
        if job.load_span is not None:
            tracing.end_span(job.load_span, load_wait_s=job.timings.get("load_wait_s", 0.0),
                             recomputed=job.is_prefix_recomputed)

    def _loads_over(self, job: StageJob) -> None:
        """Tell the store once that this job reads its prefix no more: a store on this node
        pinned it at match time (``RemoteStore.prefix_loaded``) and can let it go now."""
        if job.prefix_handed_back:
            return
        job.prefix_handed_back = True
        loaded = getattr(self.store, "prefix_loaded", None)
        if loaded is not None and job.num_prefix_blocks:
            loaded(job.keys[:job.num_prefix_blocks])
    def _launch_load(self, job: StageJob, layer: int) -> None:
        if layer < self.end_layer and layer not in job.loads:
            keys = job.keys[:job.num_prefix_blocks]
            with tracing.activate(job.load_span):   # the store op's span goes under the prefix load
                job.loads[layer] = asyncio.ensure_future(self._load(keys, layer))

    async def _load(self, keys: list[bytes], layer: int) -> tuple[LoadBuffer, list[memoryview]]:
        """One layer of the prefix blocks, read by the store straight into a reused buffer
        (``load_buffers.py``) where it can; ``_unpack_layer`` copies in any view it could not.
        Never give ``buf`` back unless the load completed: a failed or cancelled load (``_fall_back``)
        must drop it, because a cancelled TCP read may still be filling it (the connection keeps
        copying a payload whose header arrived into the sink's views), and a reused buffer would
        take those stale bytes into another request's prefix KV. Dropping it is not a leak."""
        buf = self.load_buffers.take(len(keys))
        return buf, await self.store.get_layers(keys, layer, 1, out=buf.block_views)

    async def _load_prefix_layer(self, job: StageJob, layer: int) -> None:
        """Wait for this layer's prefix bytes (launching the next layer's load first), write them
        into the paged cache and stream them to decode; once a load has failed, recompute them."""
        loop = asyncio.get_running_loop()
        if job.recompute is None:
            self._launch_load(job, layer + 1)
            t0 = time.perf_counter()
            try:
                buf, views = await job.loads.pop(layer)
                job.timings["load_wait_s"] = job.timings.get("load_wait_s", 0.0) + time.perf_counter() - t0
                # (at TP with stores per rank, a follower's failed read raises here: KeyError)
                kv = await loop.run_in_executor(self.executor, self._unpack_layer, job, layer, buf, views)
            except PREFIX_LOAD_ERRORS as exc:
                await self._fall_back(job, layer, exc)
            else:
                send_frame(job.sender, layer, 0, kv)
                return
        kv = await loop.run_in_executor(self.executor, self._recompute_layer, job, layer)
        send_frame(job.sender, layer, 0, kv)

    async def _fall_back(self, job: StageJob, layer: int, exc: BaseException) -> None:
        """Loading the prefix failed at ``layer``: recompute it instead of failing the request.
        The layers before went to decode as loaded (decode takes each layer's tokens once, so
        they are not sent again); recompute passes over the prefix tokens catch up to ``layer``
        and from there run along with the chunk, one layer at a time. Only a stage that starts
        at the embeddings can (a later CPP stage has no activations for the prefix)."""
        for task in job.loads.values():
            task.cancel()
        job.loads.clear()
        if self.first_layer != 0:
            raise PrefillAborted(f"the prefix KV could not be loaded from the store ({exc!r}), and this "
                                 f"pipeline stage (layers {self.first_layer}..) cannot recompute it") from None
        self.num_prefix_fallbacks += 1
        self.num_prefix_tokens_recomputed += job.num_prefix_tokens
        tracing.add_event(job.load_span, "recompute", layer=layer, error=repr(exc))
        log.warning("request %s: loading its %d-token prefix failed at layer %d (%r); recomputing it",
                    job.request_id, job.num_prefix_tokens, layer, exc)
        job.num_stored_blocks = 0     # its blocks may be gone from the store: write them back
        job.recompute = await asyncio.get_running_loop().run_in_executor(
            self.executor, self._catch_up, job, layer)

    def _catch_up(self, job: StageJob, layer: int) -> list[LayerwisePass]:
        n, step = job.num_prefix_tokens, RECOMPUTE_CHUNK_TOKENS
        passes = [LayerwisePass(self.runner, job.block_ids, s, token_ids=job.token_ids[s:min(n, s + step)],
                                exact=job.exact) for s in range(0, n, step)]
        for done in range(self.first_layer, layer):
            for piece in passes:      # in order: each attends to the KV the ones before wrote
                piece.run_layer(done)
        return passes

    def _recompute_layer(self, job: StageJob, layer: int) -> Staged:
        for piece in job.recompute:
            piece.run_layer(layer)
        slots = torch.cat([piece.slots for piece in job.recompute])
        # as computed layers go: a TP instance's ranks send their own heads, rank 0 gathers none
        return self.copier.to_host(layer_kv(self.runner, layer, slots, [(0, len(slots), route_of(job.sender, 0))]))

    def fallback_figures(self) -> dict[str, float]:
        """For /metrics: prefix loads that failed and were recomputed, and the tokens recomputed."""
        return {"prefix_load_fallbacks_total": self.num_prefix_fallbacks,
                "prefix_tokens_recomputed_total": self.num_prefix_tokens_recomputed}

    def _load_ranks(self, job: StageJob, layer: int, ids: torch.Tensor, packed: Staged) -> Staged:
        """A TP instance whose followers have stores of their own: ``packed`` holds rank 0's heads,
        which it writes; each follower reads and writes its own, and sends them along the
        request's route (``TPLeaderRunner.load_kv``); what rank 0 sends is its heads' frame."""
        frame = _prefix_frame(self.copier.use(packed))
        route = route_of(job.sender, 0)
        self.runner.load_kv(layer, ids, frame, job.keys[:job.num_prefix_blocks], job.request_id,
                            layer + 1 < self.end_layer, [] if route is None else [(0, job.num_prefix_tokens, route)])
        return self.copier.to_host(frame)

    def _unpack_layer(self, job: StageJob, layer: int, buf: LoadBuffer, views: list[memoryview]) -> Staged:
        cache = self.runner.cache
        fill(buf, views)
        ids = torch.as_tensor(job.block_ids[:job.num_prefix_blocks], dtype=torch.long)
        if self.runner.ranks_store:   # TP: each rank loads its own heads
            kv = self._load_ranks(job, layer, ids.to(cache.kv.device), self.copier.to_device(buf.packed))
        elif cache.kv.device.type == "cpu":
            # The frame is these blocks in the cache's own axis order: made from the head-major
            # buffer first, it is then the cache's contiguous source (one strided copy in all,
            # as fast as the token-major blocks were; a strided unpack took up to 1.6x longer).
            # Written through the runner, which hands a tensor-parallel rank its heads.
            frame = _prefix_frame(buf.packed)
            size = self.runner.block_size
            self.runner.scatter_kv(layer, (ids[:, None] * size + torch.arange(size)).reshape(-1), frame)
            kv = Staged(frame)
        else:   # on the device: unpacked and gathered there, copied out on the copy stream
            # Host to device on the copy stream; the unpack kernel is queued after it, no host wait.
            on_device = self.copier.use(self.copier.to_device(buf.packed))
            self.runner.unpack_kv(layer, ids.to(cache.kv.device), on_device)
            slots = torch.arange(job.num_prefix_tokens)
            slots = ids[slots // self.runner.block_size] * self.runner.block_size + slots % self.runner.block_size
            kv = self.copier.to_host(self.runner.gather_kv(layer, slots.to(cache.kv.device)))
        # The cache and the frame (on CUDA, the pinned copy to_device took) have the bytes now.
        self.load_buffers.give(buf)
        return kv
