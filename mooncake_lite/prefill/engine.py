"""Layer-wise prefill of one stage (the whole model, or a CPP stage's layer slice).

For each request (a :class:`StageJob`) the stage:

* loads the cached prefix KV from its store **layer by layer**, hidden behind compute, and
  recomputes it if a load fails (``prefix_load.py``, mixed in);
* computes only the uncached tokens, one chunk at a time (:meth:`StageEngine.run_chunk`);
* after each layer, queues that layer's KV (prefix tokens with the first chunk, then each
  chunk's new tokens) on the stream to decode, so sending overlaps the next layer's compute;
* once a block is full in every layer of the stage, packs it and writes it to the store in the
  background.

Model compute runs in a one-thread executor; the loop only moves bytes and tracks state. KV
leaves the device through a :class:`~mooncake_kernels.copies.Copier`: on CUDA each layer's copy runs on
its own stream into a pooled pinned buffer and is awaited off the loop, so layer i's copy
overlaps layer i+1's compute instead of a blocking ``.cpu()`` per layer (on the CPU it passes
the tensors through).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import torch

from mooncake_kernels.copies import Copier, Staged
from mooncake_kernels.device import sync
from mooncake_lite.common import tracing
from mooncake_lite.common.host import steal_seconds, thread_seconds
from mooncake_lite.instance.colocation import TIMELINE_LEN
from mooncake_lite.instance.refine import LATER, PrefillRefiner
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.runner import LayerwisePass, ModelRunner, PackedPass
from mooncake_lite.prefill.job import PrefillAborted, StageJob, send_frame
from mooncake_lite.prefill.kv_sender import KVSender, layer_kv, route_of, routed, tensor_bytes
from mooncake_lite.prefill.load_buffers import LoadBuffers
from mooncake_lite.prefill.prefix_load import PrefixLoading
from mooncake_lite.prefill.rank_store import blocks_to_store
from mooncake_lite.prefill.store_io import PrefixStore
from mooncake_lite.prefill.writeback import WritebackStats

if TYPE_CHECKING:
    from mooncake_lite.prefill.results import Firsts

__all__ = ["PrefillAborted", "StageEngine", "StageJob"]   # the first and last from prefill/job.py


class StageEngine(PrefixLoading):
    def __init__(self, runner: ModelRunner, store: PrefixStore | None, executor: Executor,
                 write_back: bool = True, copier: Copier | None = None):
        self.runner = runner
        self.store = store
        self.executor = executor
        self.copier = copier or Copier(runner.device)
        model = runner.model
        self.first_layer, self.end_layer = model.first_layer, model.end_layer
        self.write_back = write_back and store is not None   # a CPP stage writes its slice
        self.is_last = model.is_last
        self.jobs: dict[str, StageJob] = {}
        self._puts: set[asyncio.Task] = set()
        self.num_blocks_stored = 0
        self.writebacks = WritebackStats()
        self.num_prefix_fallbacks = 0          # prefix loads that failed and were recomputed
        self.num_prefix_tokens_recomputed = 0
        # Told each chunk's (num_tokens, num_prefix_tokens, seconds): the instance's cost model
        # is refined from them (instance/refine.py); None on a CPP stage, which has no model.
        self.refiner: PrefillRefiner | None = None
        # The newest forwards (a chunk, or a packed forward) as (start, end) on the host's
        # monotonic clock: GET /v1/timeline, for the cost export to tell a decode's steps on this
        # host run beside a forward from those run alone (instance/colocation.colocation_split).
        self.timeline: deque[tuple[float, float]] = deque(maxlen=TIMELINE_LEN)
        # The machine's stolen CPU seconds and this process's threads' seconds on a CPU and
        # waiting for one (common/host.py; None: not told): each job's forwards report what the
        # hypervisor took while they ran (``steal_s``), and what its threads ran and waited
        # (``cpu_s``, ``runqueue_s``): where a slow forward's time went.
        self.steal: Callable[[], float | None] = steal_seconds
        self.threads: Callable[[], tuple[float, float] | None] = thread_seconds
        self.forward_seconds = 0.0         # every forward's, and the host's figures while they ran (/metrics)
        self.forward_host = {"steal_s": 0.0, "cpu_s": 0.0, "runqueue_s": 0.0}
        args = runner.args   # a TP rank 0 whose ranks load their own heads loads its own (prefill/rank_store.py)
        heads = runner.model.args.num_kv_heads if runner.ranks_store else args.num_kv_heads
        self.load_buffers = LoadBuffers((1, heads, 2, runner.block_size, args.head_dim), runner.dtype)

    @property
    def layer_ids(self) -> range:
        return range(self.first_layer, self.end_layer)

    # --- lifecycle -----------------------------------------------------------------------------
    async def match(self, keys: Sequence[bytes]) -> int:
        if self.store is None or not keys:
            return 0
        return await self.store.match(keys)

    def begin(self, request_id: str, token_ids: Sequence[int], keys: list[bytes], num_prefix_blocks: int,
              sender: KVSender, exact: bool = False) -> StageJob:
        """Allocate the request's blocks and start loading the first layer of its prefix (``exact``:
        its passes keep float activations, ``LayerwisePass``). Raises MemoryError when the cache
        cannot hold the prompt now."""
        if request_id in self.jobs:
            raise ValueError(f"request {request_id!r} is already being prefilled here")
        bs = self.runner.block_size
        if num_prefix_blocks * bs >= len(token_ids):
            raise ValueError("the prefix must leave at least one token to compute")
        block_ids = self.runner.allocator.allocate(blocks_needed(len(token_ids), bs))
        job = StageJob(request_id, tuple(token_ids), keys, num_prefix_blocks, block_ids, sender,
                       num_stored_blocks=num_prefix_blocks, num_prefix_tokens=num_prefix_blocks * bs, exact=exact)
        self.jobs[request_id] = job
        if num_prefix_blocks:
            job.load_span = tracing.start_span("prefill.prefix_load", blocks=num_prefix_blocks,
                                               tokens=job.num_prefix_tokens)
            self._launch_load(job, self.first_layer)
        else:
            job.prefix_done = True
        return job

    def abort(self, request_id: str, reason: str) -> bool:
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.abort_reason = job.abort_reason or reason
        return True

    async def finish(self, job: StageJob, firsts: Firsts | None) -> None:
        """Send END to decode once every frame is answered (the last stage's carries ``firsts``
        and what the decode resumes from, :meth:`resume_point`); raises PrefillAborted on failure."""
        try:
            if firsts is None:
                await job.sender.end(self.first_layer, self.end_layer, None)
            else:
                await job.sender.end(self.first_layer, self.end_layer, firsts.wire, self.resume_point(job, firsts.output))
        except ConnectionError as exc:
            raise PrefillAborted(str(exc)) from None

    def resume_point(self, job: StageJob, output: Sequence[int]) -> dict:
        """What the decode continues the request from, beside token 1: ``output``, a continued
        request's output so far (its samplers resume over it), and the prompt's chain, ``key`` (its
        last full block's, hex; None for none) and ``tail`` (the ids after that block), from which
        the decode keys the blocks its generated tokens fill as a prefill of prompt + output would."""
        full = len(job.keys) * self.runner.block_size
        return {"output": list(output), "key": job.keys[-1].hex() if job.keys else None,
                "tail": list(job.token_ids[full:])}

    async def release(self, job: StageJob, error: str | None = None) -> None:
        """Free the job (always call, success or not); on error tell decode to drop the transfer."""
        self.jobs.pop(job.request_id, None)
        for task in job.loads.values():
            task.cancel()
        self._loads_over(job)
        tracing.end_span(job.load_span, error)   # no-op once the prefix was in
        if error is not None:
            await job.sender.abort(error)
        self.runner.allocator.free(job.block_ids)
        job.block_ids = []

    # --- compute -------------------------------------------------------------------------------
    async def run_chunk(self, job: StageJob, start: int, *, token_ids: Sequence[int] | None = None,
                        hidden: torch.Tensor | None = None, all_positions: bool = False) -> torch.Tensor:
        """Run this stage's layers over tokens ``start..start+n-1``; stream each layer's KV as soon
        as it is computed. Returns the last position's logits (last stage; every position's with
        ``all_positions``) or the hidden states."""
        loop = asyncio.get_running_loop()
        t0, host0 = time.perf_counter(), self._host()
        piece = await loop.run_in_executor(self.executor, self._new_pass, job, start, token_ids, hidden)
        for layer in self.layer_ids:
            self._check(job)
            if not job.prefix_done:
                await self._load_prefix_layer(job, layer)
            routes = routed([(0, piece.num_tokens, route_of(job.sender, start))])
            kv = await loop.run_in_executor(self.executor, self._layer, piece, layer, *routes)
            send_frame(job.sender, layer, start, kv)
        self._prefix_in(job)   # the prefix is in (loaded, or recomputed): no-op after the first chunk
        out = await loop.run_in_executor(self.executor, self._output, piece, all_positions)
        seconds = time.perf_counter() - t0
        host = self._busy(seconds, host0)
        self._ran(job, seconds, host)
        if self.refiner is not None:
            self.refiner.observe(start + piece.num_tokens, start, seconds, chunk_kind(job, start))
        self._store_full_blocks(job, start + piece.num_tokens)
        return out

    async def run_packed(self, parts: Sequence[tuple[StageJob, int, Sequence[int]]]) -> tuple[torch.Tensor, list[str | None]]:
        """Prefill batching: the (job, start, token ids) chunks of several requests in one forward
        (a whole-model or first stage). Each job's prefix loads, KV frames and write-backs are its
        own, as in :meth:`run_chunk`; a job aborted or whose stream broke midway only stops being
        served (its frames and loads; its rows are computed and dropped), the others go on.
        Returns each job's last-position logits and its error (None when it went through)."""
        loop = asyncio.get_running_loop()
        t0, host0 = time.perf_counter(), self._host()
        seqs = [(job.block_ids, start, toks) for job, start, toks in parts]
        piece = await loop.run_in_executor(self.executor, PackedPass, self.runner, seqs,
                                           any(job.exact for job, _, _ in parts))
        errors: list[str | None] = [None] * len(parts)
        for layer in self.layer_ids:
            for i, (job, _, _) in enumerate(parts):
                errors[i] = errors[i] or self._error_of(job)
                if errors[i] is None and not job.prefix_done:
                    try:
                        await self._load_prefix_layer(job, layer)
                    except PrefillAborted as exc:
                        errors[i] = str(exc)
            routes = routed([(off, n, route_of(job.sender, start) if errors[i] is None else None)
                             for i, ((off, n, _), (job, start, _)) in enumerate(zip(piece.segments, parts))])
            kvs = await loop.run_in_executor(self.executor, self._packed_layer, piece, layer, *routes)
            for i, ((job, start, _), kv) in enumerate(zip(parts, kvs)):
                if errors[i] is None:
                    send_frame(job.sender, layer, start, kv)
        out = await loop.run_in_executor(self.executor, self._output, piece)
        seconds = time.perf_counter() - t0
        host = self._busy(seconds, host0)
        forward = {"forward_tokens": float(sum(len(toks) for *_, toks in parts)), "forward_jobs": float(len(parts))}
        for i, (job, start, toks) in enumerate(parts):
            self._prefix_in(job)
            self._ran(job, seconds, host)
            job.timings.update(forward)   # the forward that ran: the conductor's speed is of it, not of its forecast
            if errors[i] is None:
                self._store_full_blocks(job, start + len(toks))
        if self.refiner is not None and len(parts) == 1:   # the refined model is of one prompt's pass
            job, start, toks = parts[0]
            self.refiner.observe(start + len(toks), start, seconds, chunk_kind(job, start))
        return out, errors

    @staticmethod
    def _ran(job: StageJob, seconds: float, host: dict[str, float]) -> None:
        """``job`` computed for ``seconds`` of a forward beside ``host`` (:meth:`_busy`)."""
        for key, value in (("compute_s", seconds), *host.items()):
            job.timings[key] = job.timings.get(key, 0.0) + value

    def _host(self) -> tuple[float | None, tuple[float, float] | None]:
        return self.steal(), self.threads()

    def _busy(self, seconds: float, before: tuple[float | None, tuple[float, float] | None]) -> dict[str, float]:
        """A forward of ``seconds`` just ended: its interval on the monotonic clock, the one the
        other roles on this host read too; the CPU seconds stolen, and this process's threads'
        seconds on a CPU and on the run queue, since ``before`` (:meth:`_host` as it began) are
        returned, those that were read."""
        end = time.monotonic()
        self.timeline.append((end - seconds, end))
        (stolen0, threads0), (stolen1, threads1) = before, self._host()
        host = {} if stolen0 is None or stolen1 is None else {"steal_s": max(0.0, stolen1 - stolen0)}
        if threads0 is not None and threads1 is not None:
            host.update(cpu_s=max(0.0, threads1[0] - threads0[0]), runqueue_s=max(0.0, threads1[1] - threads0[1]))
        self.forward_seconds += seconds
        for key, value in host.items():
            self.forward_host[key] += value
        return host

    @property
    def forward_steal_seconds(self) -> float:
        return self.forward_host["steal_s"]

    def steal_figures(self) -> dict[str, float]:
        """/metrics: seconds of forwards; CPU seconds the hypervisor took while they ran, and this
        process's threads' seconds on a CPU and waiting for one."""
        return {"forward_seconds_total": self.forward_seconds,
                **{f"forward_{k.removesuffix('_s')}_seconds_total": v for k, v in self.forward_host.items()}}

    def _packed_layer(self, piece: PackedPass, layer: int, routes: list = ()) -> list[Staged]:
        piece.run_layer(layer)
        kv = layer_kv(self.runner, layer, piece.slots, routes)
        return [self.copier.to_host(kv[:, off:off + n]) for off, n, _ in piece.segments]

    def _output(self, piece: LayerwisePass, all_positions: bool = False) -> torch.Tensor:
        out = piece.output(all_positions) if all_positions else piece.output()
        sync(self.runner.device)   # the chunk's time (refiner, timings) is its compute, not its launch
        return out

    def _error_of(self, job: StageJob) -> str | None:
        return job.abort_reason or job.sender.error

    def _new_pass(self, job: StageJob, start: int, token_ids, hidden) -> LayerwisePass:
        return LayerwisePass(self.runner, job.block_ids, start, token_ids=token_ids, hidden=hidden, exact=job.exact)

    def _layer(self, piece: LayerwisePass, layer: int, routes: list = ()) -> Staged:
        piece.run_layer(layer)
        return self.copier.to_host(layer_kv(self.runner, layer, piece.slots, routes))

    def _check(self, job: StageJob) -> None:
        if job.abort_reason is not None:
            raise PrefillAborted(job.abort_reason)
        if job.sender.error is not None:
            raise PrefillAborted(job.sender.error)

    # --- write-back ----------------------------------------------------------------------------
    def _store_full_blocks(self, job: StageJob, num_done_tokens: int) -> None:
        """Blocks that became full (in all of this stage's layers) go to the store, in the background."""
        full = min(num_done_tokens // self.runner.block_size, len(job.keys))
        if not self.write_back or full <= job.num_stored_blocks:
            return
        first, job.num_stored_blocks = job.num_stored_blocks, full
        cache = self.runner.cache
        ids = torch.as_tensor(job.block_ids[first:full], dtype=torch.long, device=cache.kv.device)
        # A copy (the blocks may be freed right after); on CUDA packed on the compute stream, so
        # after the kernels that wrote the blocks, and copied out on the copy stream.
        packed = self.copier.to_host(blocks_to_store(self.runner, ids, job.keys[first:full], first))
        task = asyncio.ensure_future(self._put(job.keys[first:full], packed, first))
        self._puts.add(task)
        task.add_done_callback(lambda t, n=full - first: self._put_done(t, n))

    async def _put(self, keys: list[bytes], packed: Staged, first: int) -> None:
        """Write packed blocks once their copy is in host memory; the staging buffer goes back
        to the pool only after the store took the bytes (a failed put may still hold them)."""
        await packed.ready()
        await self.store.put_layers(keys, [tensor_bytes(p) for p in packed.tensor], self.first_layer,
                                    self.end_layer - self.first_layer, first_pos=first)
        packed.release()

    def _put_done(self, task: asyncio.Task, num_blocks: int) -> None:
        self._puts.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            self.writebacks.failed(task.exception(), num_blocks)
        else:
            self.num_blocks_stored += num_blocks
            self.writebacks.succeeded()

    async def drain_puts(self) -> None:
        while self._puts:
            await asyncio.wait(set(self._puts))
        self.writebacks.flush()


def chunk_kind(job: StageJob, start: int) -> int:
    """The refiner's kind of the chunk of ``job`` from ``start``: its first (0), or a later one."""
    return LATER if start > job.num_prefix_tokens else 0
