"""One PrefillRequest end to end, on a single instance or as the head of a CPP group.

    keys = PrefixHash(prompt)          verify the conductor's prefix_keys against them
    hit  = min over stages of the store's leading match (each stage loads its own layers)
    for each chunk of --prefill-chunk uncached tokens:
        stage 0 runs its layers (streaming their KV to decode) and hands the activations on
    the last stage samples the first token from the last position and ends the KV stream

Requests run one at a time per group, in the queue order the instance registers
(``--queue-order``: FIFO, or shortest uncached prompt first with at most ``--queue-overtakes``
later arrivals passing any one request: ``scheduler/queue_order.py``, the rule the conductor's
queue-time estimate follows); within a request, chunks overlap across the stages of a CPP group. With prefill batching
(``batch_tokens`` > 0, a single instance), the request at the head of the queue takes the ones
queued behind it along into one packed forward (``packs.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from mooncake_lite.common import tracing
from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.common.membership import Nudge
from mooncake_lite.common.protocol import InstanceLoad, PrefillRequest, PrefillResult, RunningPrefill, TokenLogprob
from mooncake_lite.model.sampling import chunk_logprobs, reports_logprobs
from mooncake_lite.prefill.engine import PrefillAborted, StageEngine
from mooncake_lite.prefill.kv_sender import DecodeLinks, KVSender
from mooncake_lite.prefill.packs import Packing
from mooncake_lite.prefill.progress import ChunkProgress
from mooncake_lite.prefill.results import Firsts, annotate, request_params, sample_firsts, tell_first
from mooncake_lite.prefill.turns import QueuedJob, TurnTaking
from mooncake_lite.scheduler.costs import packed_durations, uncached_tokens
from mooncake_lite.scheduler.progress import LaterChunks
from mooncake_lite.scheduler.waiting import TurnRecord
from mooncake_lite.transfer.client import RemoteError, split_address
from mooncake_lite.transfer.kv_stream import OP_KV_ALIVE

log = logging.getLogger(__name__)


class PrefillRejected(ValueError):
    """The request is malformed or cannot fit; answered 400 (never retried as is)."""


class PrefillService(TurnTaking, Packing):
    """Serves each request in its turn (``turns.py``: whose turn it is), packed when it can
    (``packs.py``)."""

    def __init__(self, stage: StageEngine, links: DecodeLinks, *, block_size: int, hash_seed: int,
                 chunk_size: int, downstream=None, cost=None, keepalive_s: float = 1.0,
                 batch_tokens: int = 0, block_bytes: int = 0, overtakes: int = 0, busy_scale: float = 1.0):
        self.stage = stage
        self.busy_scale = busy_scale   # its chunks on its own threads over with borrowed ones (Register's)
        self.block_bytes = block_bytes # one whole block as the store keeps it: prices a migration
        self.links = links
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.chunk_size = chunk_size
        self.downstream = downstream   # pipeline.NextStage of a CPP group, or None
        self.cost = cost               # PrefillCostModel, for the load figure
        self.keepalive_s = keepalive_s # while queued, tell decode the request is alive this often
        # Prefill batching: pack queued prompts up to this many uncached tokens per forward (0: off;
        # a CPP group runs one request at a time).
        self.batch_tokens = batch_tokens if downstream is None else 0
        self.queue: dict[str, QueuedJob] = {}
        # The queue order's bound (0: FIFO); the jobs waiting for their turn, in serving order,
        # and whether one holds the instance now.
        self.overtakes = overtakes
        self._waiting: list[QueuedJob] = []
        self._busy = False
        self.turns = TurnRecord()
        self._aborted: set[str] = set()
        self.num_done = 0
        self.num_failed = 0
        self._progress: ChunkProgress | None = None   # the job running alone, chunk by chunk (running())
        self.progressed = Nudge()   # fired as a chunk of it ends, with chunks left: its heartbeat goes then
        self.later_chunks = LaterChunks()   # how the chunks after a job's first ran against their price
        # Cumulative, for /metrics: how much prompt KV was reused vs computed, and bytes streamed.
        # packed_*: forwards that served several requests at once, and the requests they served.
        self.totals = {"prefix_tokens_total": 0, "computed_tokens_total": 0, "kv_bytes_sent_total": 0,
                       "packed_forwards_total": 0, "packed_requests_total": 0}

    def check(self, req: PrefillRequest) -> list[bytes]:
        """Validate; returns the prompt's block keys."""
        n = len(req.token_ids)
        vocab = self.stage.runner.args.vocab_size
        if n == 0:
            raise PrefillRejected("token_ids must not be empty")
        if any(not 0 <= t < vocab for t in req.token_ids):
            raise PrefillRejected(f"token ids must be in [0, {vocab})")
        if n > self.stage.runner.args.max_seq_len:
            raise PrefillRejected(f"prompt of {n} tokens exceeds the model's {self.stage.runner.args.max_seq_len}")
        blocks = -(-n // self.block_size)
        if blocks > self.stage.runner.allocator.num_blocks:
            raise PrefillRejected(f"prompt needs {blocks} KV blocks; this instance has "
                                  f"{self.stage.runner.allocator.num_blocks}")
        try:
            request_params(req)
        except ValueError as exc:
            raise PrefillRejected(f"sampling: {exc}") from None
        try:
            split_address(req.decode_data)
        except ValueError as exc:
            raise PrefillRejected(f"decode_data {exc}") from None
        if any(len(k) != 32 or not _is_hex(k) for k in req.migrate_keys):
            raise PrefillRejected("migrate_keys must be 32-character hex block keys")
        keys = prefix_hash(req.token_ids, self.block_size, self.hash_seed)
        given = list(req.prefix_keys)
        if given != [k.hex() for k in keys[:len(given)]]:
            raise PrefillRejected("prefix_keys do not match the prompt's block hashes "
                                  "(different block size or hash seed?)")
        return keys

    def abort(self, request_id: str) -> bool:
        known = request_id in self.queue
        if known:
            self._aborted.add(request_id)
            self.stage.abort(request_id, "aborted by the conductor")
            self._drop_waiting(self.queue[request_id])
        return known

    async def prefill(self, req: PrefillRequest,
                      on_first: Callable[[PrefillResult], object] | None = None) -> PrefillResult:
        """The result once the KV stream has ended; ``on_first`` is given it as soon as the first
        token is known (a single instance; a CPP group's comes with the end), which can be a
        decode step earlier. A stream that fails after that still raises here."""
        # A child of the conductor's span when its traceparent header came along (tracing on).
        with tracing.span("prefill.request", kind="server", request_id=req.request_id,
                          transfer_id=req.transfer_id, prompt_tokens=len(req.token_ids)) as span:
            result = await self._prefill(req, on_first)
            if span is not None:
                tracing.set_attributes(span, prefix_tokens=result.num_prefix_tokens,
                                       computed_tokens=result.num_computed_tokens, first_token=result.first_token)
            return result

    async def _prefill(self, req: PrefillRequest, on_first=None) -> PrefillResult:
        keys = self.check(req)
        if req.request_id in self.queue:
            raise PrefillRejected(f"request {req.request_id!r} is already queued here")
        expected = uncached_tokens(len(req.token_ids), len(req.prefix_keys) * self.block_size)
        job = QueuedJob(req.request_id, len(req.token_ids), 0, req=req, keys=keys,
                        result=asyncio.get_running_loop().create_future(), on_first=on_first,
                        arrived_at=time.perf_counter(), expected_uncached=expected,
                        placed=(req.placer, req.placed) if req.placed else None)
        job.result.add_done_callback(_retrieved)
        self.queue[req.request_id] = job
        # Decode hears nothing of this request until its first KV frame: keep it from timing the
        # request out through the queue wait, a hot-spot migration and the prefix match.
        keepalive = asyncio.ensure_future(self._keepalive(req))
        job.stop_keepalive = keepalive.cancel
        queued = tracing.start_span("prefill.queue", num_queued=len(self.queue) - 1)
        try:
            async with self._turn(job):
                tracing.end_span(queued)
                if job.result.done():    # served in the pack of a request queued before it
                    result = job.result.result()
                else:
                    if req.request_id in self._aborted:
                        raise PrefillAborted("aborted while queued (by the conductor, or decode dropped it)")
                    job.started_at = time.perf_counter()
                    result = await self._serve(job)
                annotate(result, job)
                self.num_done += 1
                return result
        except BaseException:
            self.num_failed += 1
            raise
        finally:
            tracing.end_span(queued, "left the queue unserved")   # no-op once it was served
            keepalive.cancel()
            self.queue.pop(req.request_id, None)
            self._aborted.discard(req.request_id)

    # --- one request -----------------------------------------------------------------------------
    async def _match(self, queued: QueuedJob) -> int:
        """Leading blocks of the prompt this instance (every stage) can load: asked once, kept."""
        if queued.hit is None and reports_logprobs(queued.req.sampling):
            # every position's logits, or values computed from float activations only: nothing loaded
            queued.hit, queued.num_prefix_tokens = 0, 0
        if queued.hit is None:
            req, keys = queued.req, queued.keys
            cap = (len(req.token_ids) - 1) // self.block_size   # the last token is always computed
            if req.migrate_from and req.migrate_keys:
                with tracing.span("prefill.migrate", source=req.migrate_from, blocks=len(req.migrate_keys)):
                    queued.migrated = await self._migrate(req)
            hit = await self.stage.match(keys[:cap])
            if self.downstream is not None and hit:
                hit = min(hit, await self.downstream.match(req.request_id, keys[:cap]))
            queued.hit, queued.num_prefix_tokens = hit, hit * self.block_size
        return queued.hit

    async def _begin(self, req: PrefillRequest, keys: list[bytes], hit: int):
        client = await self.links.get(req.decode_data)
        # Its traceparent rides in the KV frames' meta: decode's receive span is its child.
        stream = tracing.start_span("prefill.kv_stream", kind="client", decode=req.decode_data,
                                    transfer_id=req.transfer_id)
        sender = KVSender.for_runner(client, req.transfer_id, self.stage.runner, req.decode_data,
                                     traceparent=tracing.traceparent(stream))
        try:
            job = self.stage.begin(req.request_id, req.token_ids, keys, hit, sender, reports_logprobs(req.sampling))
        except MemoryError as exc:
            tracing.end_span(stream, str(exc))
            raise PrefillRejected(str(exc)) from None
        return job, sender, stream

    async def _end(self, job, sender: KVSender, stream, error: str | None) -> None:
        await self.stage.release(job, error)
        tracing.end_span(stream, error, frames=sender.num_frames, bytes=sender.num_bytes)

    def _result(self, req: PrefillRequest, job, sender: KVSender, prefix: int, firsts: Firsts, t0: float,
                count: bool = True, prompt_lps: tuple[TokenLogprob, ...] = ()) -> PrefillResult:
        """``count``: add it to the totals (once, when the stream has ended well)."""
        if job.is_prefix_recomputed:    # its load failed: computed after all, nothing reused
            prefix = 0
        if count:
            self.totals["prefix_tokens_total"] += prefix
            self.totals["computed_tokens_total"] += len(req.token_ids) - prefix
            self.totals["kv_bytes_sent_total"] += sender.num_bytes
        timings = {"total_s": time.perf_counter() - t0, **job.timings,
                   "kv_frames": float(sender.num_frames), "kv_bytes": float(sender.num_bytes)}
        return PrefillResult(req.request_id, firsts.tokens[0], prefix, len(req.token_ids) - prefix, timings,
                             prompt_logprobs=prompt_lps, **firsts.result_fields())

    async def _run(self, queued: QueuedJob) -> PrefillResult:
        t0 = time.perf_counter()
        req, keys, stop_keepalive = queued.req, queued.keys, queued.stop_keepalive
        hit = await self._match(queued)
        prefix = hit * self.block_size
        job, sender, stream = await self._begin(req, keys, hit)
        error: str | None = None
        try:
            if self.downstream is not None:
                await self.downstream.begin(req.request_id, req.transfer_id, req.token_ids, req.decode_data,
                                            dataclasses.asdict(req.sampling), keys, hit)
            stop_keepalive()           # KV frames from here on tell decode the request is alive
            if req.request_id in self._aborted:
                raise PrefillAborted("aborted before its first KV frame (by the conductor, or decode dropped it)")
            out, prompt_lps = await self._chunks(req, job, prefix)
            if self.downstream is None:
                firsts = sample_firsts(out, req.sampling, req.token_ids, self.stage.runner.grammars)
                tell_first(queued, self._result(req, job, sender, prefix, firsts, t0, False, prompt_lps))
                await self.stage.finish(job, firsts)
            else:
                await self.stage.finish(job, None)
                firsts, prompt_lps = await self.downstream.end(req.request_id)
        except BaseException as exc:
            error = str(exc) or type(exc).__name__
            if self.downstream is not None:
                await self.downstream.abort(req.request_id, error)
            raise
        finally:
            await self._end(job, sender, stream, error)
        return self._result(req, job, sender, prefix, firsts, t0, prompt_lps=prompt_lps)

    async def _chunks(self, req: PrefillRequest, job, prefix: int) -> tuple[torch.Tensor, tuple[TokenLogprob, ...]]:
        """Compute the prompt past ``prefix`` chunk by chunk: the last position's logits (a CPP
        head: the last chunk's activations), and the prompt's log-probabilities when asked for
        (every position computed, none loaded: ``_match``; a CPP group's last stage computes them)."""
        n = len(req.token_ids)
        k = req.sampling.prompt_logprobs if self.downstream is None else None
        out, lps = None, []
        progress = self._progress = ChunkProgress(req.request_id, n, prefix, since=time.perf_counter())
        try:
            for start in range(prefix, n, self.chunk_size):
                chunk = req.token_ids[start:start + self.chunk_size]
                with tracing.span("prefill.chunk", start=start, tokens=len(chunk)):
                    out = await self.stage.run_chunk(job, start, token_ids=chunk, all_positions=k is not None)
                    if self.downstream is not None:
                        await self.downstream.send_chunk(req.request_id, start, out)
                if k is not None:
                    out, more = await asyncio.get_running_loop().run_in_executor(
                        self.stage.executor, chunk_logprobs, out, req.token_ids, start, k)
                    lps += more
                took = progress.chunk_done(len(chunk), time.perf_counter())
                if start > prefix and self.cost is not None:
                    self.later_chunks.observe(self.cost.chunk_after(start + len(chunk), start), took)
                if start + self.chunk_size < n:
                    self.progressed.fire()
        finally:
            self._progress = None
        return out, tuple(lps)

    def running(self) -> RunningPrefill | None:
        """The job this instance runs alone now, priced from its chunks done (for its heartbeat;
        None before its first chunk is done, or without a cost model)."""
        progress, cost = self._progress, self.cost
        if progress is None or cost is None or not progress.done_tokens:
            return None
        return progress.report(cost.with_chunk(self.chunk_size), time.perf_counter(), self.later_chunks.ratio)

    async def _keepalive(self, req: PrefillRequest) -> None:
        """Until the request's first KV frame, keep decode from timing it out; if decode no
        longer waits for it, drop it instead of computing it for nothing. The first keepalive
        goes one period in, so a request that starts at once sends none (nor opens the link to
        decode before the prefill itself does: against an unreachable decode it would make the
        prefill wait out a second connect timeout)."""
        try:
            while True:
                await asyncio.sleep(self.keepalive_s)
                client = await self.links.get(req.decode_data)
                await client.request(OP_KV_ALIVE, {"tid": req.transfer_id})
        except RemoteError as exc:
            if exc.code == "unknown_transfer":
                log.info("decode dropped queued request %s (%s); skipping it", req.request_id, exc)
                self.abort(req.request_id)
            else:   # e.g. a decode from before KV_ALIVE answers bad_op: keep the request, stop asking
                log.warning("keepalive for %s refused by decode (%s); not sending more", req.request_id, exc)
        except (ConnectionError, OSError, asyncio.TimeoutError) as exc:
            log.debug("keepalive for %s stopped: %s", req.request_id, exc)

    async def _migrate(self, req: PrefillRequest) -> tuple[float, float] | None:
        """Hot-spot migration (Algorithm 1 step 5): pull the named blocks into our store first.
        A failure only costs prefix reuse, never the request. Returns (bytes copied, seconds)
        when blocks moved, for the conductor's link speed (PrefillResult.timings)."""
        replicate = getattr(self.stage.store, "replicate", None)
        if replicate is None:
            log.warning("request %s asks to migrate blocks, but this instance has no shared store", req.request_id)
            return None
        t0 = time.perf_counter()
        try:
            result = await replicate([bytes.fromhex(k) for k in req.migrate_keys], req.migrate_from)
        except Exception as exc:
            log.warning("migration from %s failed (%s); prefilling without those blocks", req.migrate_from, exc)
            return None
        seconds = time.perf_counter() - t0
        log.info("migrated %d blocks from %s in %.3fs: %s", len(req.migrate_keys), req.migrate_from,
                 seconds, result)
        copied = int(result.get("num_copied", 0)) * self.block_bytes
        return (float(copied), seconds) if copied else None

    def load(self) -> InstanceLoad:
        queued_s = 0.0
        if self.cost is not None:
            now = time.perf_counter()
            # served ones are only leaving; the running ones first, then the waiting in their order
            jobs = [j for j in self.queue.values() if j.started_at is not None and not j.result.done()]
            jobs += [j for j in self._waiting if j.started_at is None and not j.result.done() and j.req is not None]
            durations = packed_durations(self.cost, [(j.num_tokens, j.num_prefix_tokens) for j in jobs],
                                         self.pack_limit, [j.req.pack_cap if j.req else 0 for j in jobs])
            for job, t in zip(jobs, durations):
                if job.started_at is not None:
                    t = max(0.0, t - (now - job.started_at))
                queued_s += t
        return InstanceLoad(queued_s=queued_s, num_queued=float(len(self.queue)),
                            queued_tokens=float(sum(j.num_tokens for j in self.queue.values())),
                            free_blocks=float(self.stage.runner.allocator.num_free))


def _retrieved(future: asyncio.Future) -> None:
    """A pack member's outcome may land after its request left (cancelled): no 'never retrieved'."""
    if not future.cancelled():
        future.exception()


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
