"""Prefill batching: the request at the head of the queue takes the ones queued behind it along,
in the queue's order, while their uncached tokens together fit in ``batch_tokens`` (each within
one chunk) and under each one's ``PrefillRequest.pack_cap`` (its TTFT SLO's): one packed forward (``StageEngine.run_packed``) serves them all, each with its own KV
stream, store write-back and result. The cut is ``scheduler.costs.pack_sizes``; the instance
registers its budget (``pack_limit`` as ``Register.pack_tokens``) and the conductor prices its
queue by the same rule (``scheduler/packing.py``). Kept apart from ``service.py``, which serves
one request, so a pack's forming and its members' outcomes read as one piece.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mooncake_lite.common.protocol import PrefillResult
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.prefill.engine import PrefillAborted
from mooncake_lite.prefill.results import Firsts, sample_firsts, tell_first
from mooncake_lite.prefill.turns import QueuedJob
from mooncake_lite.scheduler.costs import pack_sizes
from mooncake_lite.scheduler.waiting import START, UNSTART

log = logging.getLogger(__name__)


class Packing:
    """The packs of a PrefillService (mixed in): it sets ``batch_tokens`` (0: no packing),
    ``chunk_size``, ``block_size``, ``stage``, ``queue``, ``_waiting``, ``_aborted`` and ``totals``,
    and serves one request with ``_run``, ``_match``, ``_begin``, ``_end`` and ``_result``."""

    batch_tokens: int
    chunk_size: int
    block_size: int

    async def _serve(self, lead: QueuedJob) -> PrefillResult:
        """Serve the head of the queue, packed with the requests queued behind it that fit."""
        # A prompt's log-probabilities need every position's logits: a pass of its own.
        packs = self.batch_tokens > 0 and lead.req.sampling.prompt_logprobs is None
        pack = await self._pack(lead) if packs else [lead]
        if len(pack) == 1:
            return await self._run(lead)
        now = time.perf_counter()
        for member in pack[1:]:
            member.started_at = now
        self.totals["packed_forwards_total"] += 1
        self.totals["packed_requests_total"] += len(pack)
        # Shielded: the leader's client leaving must not cancel the others' prefill midway.
        task = asyncio.ensure_future(self._run_pack(pack))
        try:
            outcomes = await asyncio.shield(task)
        except asyncio.CancelledError:
            self.stage.abort(lead.request_id, "the request was cancelled")
            outcomes = await task
            outcomes[0] = asyncio.CancelledError()
        for member, outcome in zip(pack[1:], outcomes[1:]):
            if isinstance(outcome, BaseException):
                member.result.set_exception(outcome)
            else:
                member.result.set_result(outcome)
        if isinstance(outcomes[0], BaseException):
            raise outcomes[0]
        return outcomes[0]

    async def _pack(self, lead: QueuedJob) -> list[QueuedJob]:
        """The lead and, in queue order (the serving order), the requests after it while their
        uncached tokens fit in ``batch_tokens`` together and each in one chunk (the first that does
        not ends the pack)."""
        limit = self.pack_limit
        uncached = [await self._uncached(lead)]
        caps = [lead.req.pack_cap]      # each member's cap lowers the pack's bound (its TTFT SLO)
        pack = [lead]
        # Every member's blocks are held at once: a pack never takes more than the cache has free.
        free = self.stage.runner.allocator.num_free - blocks_needed(lead.num_tokens, self.block_size)
        if uncached[0] > limit:
            return pack
        try:
            for job in list(self._waiting):
                if (job is lead or job.req is None or job.started_at is not None or job.result.done()
                        or job.turn.done() or job.request_id in self._aborted
                        or job.req.sampling.prompt_logprobs is not None):
                    continue      # req None: a hold() placeholder; turn done: it left the list
                uncached.append(await self._uncached(job))
                caps.append(job.req.pack_cap)
                free -= blocks_needed(job.num_tokens, self.block_size)
                if pack_sizes(uncached, limit, caps)[0] < len(uncached) or free < 0 or job.request_id not in self.queue:
                    break     # scheduler.costs.packed_durations prices a queue by the same cut
                # Started as soon as chosen: arrivals during the next await (a store match) land
                # behind it, as they will be served (and as the conductor's view has it).
                job.started_at = time.perf_counter()
                self.turns.note(START, job.request_id)
                pack.append(job)
        except BaseException:
            for job in pack[1:]:
                job.started_at = None          # the leader never served them: they wait on
                self.turns.note(UNSTART, job.request_id)
            raise
        return pack

    @property
    def pack_limit(self) -> int:
        """Uncached tokens one packed forward may hold (0: no packing)."""
        return min(self.batch_tokens, self.chunk_size)

    async def _uncached(self, job: QueuedJob) -> int:
        return job.num_tokens - await self._match(job) * self.block_size

    async def _run_pack(self, pack: list[QueuedJob]) -> list[PrefillResult | BaseException]:
        """One packed forward for every request of ``pack``; each one's outcome, in order."""
        t0 = time.perf_counter()
        outcomes: list[PrefillResult | BaseException | None] = [None] * len(pack)
        live = await self._begin_pack(pack, outcomes)
        errors: dict[int, str | None] = {i: "the packed prefill failed" for i, *_ in live}
        try:
            if live:
                parts = [(job, pack[i].num_prefix_tokens, pack[i].req.token_ids[pack[i].num_prefix_tokens:])
                         for i, job, _, _ in live]
                out, failed = await self.stage.run_packed(parts)
                firsts = {}
                for row, ((i, job, sender, _), error) in enumerate(zip(live, failed)):
                    if error is None:   # every member's token 1 out before any END is answered
                        req = pack[i].req
                        firsts[i] = sample_firsts(out[row], req.sampling, req.token_ids, self.stage.runner.grammars)
                        tell_first(pack[i], self._result(req, job, sender, pack[i].num_prefix_tokens,
                                                         firsts[i], t0, count=False))
                for row, ((i, job, _, _), error) in enumerate(zip(live, failed)):
                    outcomes[i], errors[i] = await self._end_stream(job, firsts.get(i), error)
        except Exception as exc:           # the forward itself failed: every request of the pack did
            log.exception("packed prefill of %d requests failed", len(live))
            for i, *_ in live:
                outcomes[i], errors[i] = exc, str(exc) or type(exc).__name__
        finally:
            for i, job, sender, stream in live:
                await self._end(job, sender, stream, errors[i])
        for i, job, sender, _ in live:
            if errors[i] is None:
                outcomes[i] = self._result(pack[i].req, job, sender, pack[i].num_prefix_tokens, outcomes[i], t0)
        return outcomes

    async def _begin_pack(self, pack: list[QueuedJob], outcomes: list) -> list[tuple]:
        """Begin each member's job and KV stream: (index, job, sender, stream) of those that
        began; one that cannot (a full cache, decode unreachable) fails alone, in ``outcomes``."""
        live = []
        for i, queued in enumerate(pack):
            try:
                job, sender, stream = await self._begin(queued.req, queued.keys, queued.hit)
            except Exception as exc:
                outcomes[i] = exc
                continue
            queued.stop_keepalive()
            if queued.request_id in self._aborted:
                self.stage.abort(queued.request_id, "aborted before its first KV frame")
            live.append((i, job, sender, stream))
        return live

    async def _end_stream(self, job, first: Firsts | None, error: str | None):
        """(first token, None) once its KV stream ended well, else (PrefillAborted, reason)."""
        if error is None:
            try:
                await self.stage.finish(job, first)
                return first, None
            except PrefillAborted as exc:
                error = str(exc)
        return PrefillAborted(error), error
