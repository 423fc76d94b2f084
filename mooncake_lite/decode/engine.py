"""The decode engine: the batcher's decisions executed on the model, KV intake, token streams.

All bookkeeping runs on the event loop; the model step (and its sampling) runs in a one-thread
executor, so HTTP and the KV data socket stay responsive while the model computes. Received KV is
written into the paged cache in that same executor, never on the loop: the one thread orders each
write between steps (no write races a step, and a write queued before an abort runs before
anything that could reuse the freed blocks), and on CUDA the write is a host-to-device copy on the
copier's stream (``kernels/copies.py``) with the scatter queued after it, no host wait. A
sequence joins the batch only once every one of its writes has completed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import torch

from mooncake_kernels.copies import Copier
from mooncake_kernels.quant_linear import float_activations
from mooncake_lite.common import tracing
from mooncake_lite.common.protocol import GenerateRequest, InstanceLoad, TokenEvent, TokenLogprob
from mooncake_lite.decode.batcher import DecodeBatcher, StepPlan
from mooncake_lite.decode.pending import KVError, PendingKV, ResumePoint
from mooncake_lite.decode.requests import MAX_CHOICES, RequestState
from mooncake_lite.decode.writeback import GeneratedBlocks
from mooncake_lite.instance.colocation import TIMELINE_LEN
from mooncake_lite.instance.refine import STEP_RATIO_KEYS, DecodeRefiner
from mooncake_lite.model.grammar import choice_masks
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.sampling import SequenceSampler, params_from_wire, sample_rows

log = logging.getLogger(__name__)


class DecodeEngine:
    def __init__(self, runner: ModelRunner, batcher: DecodeBatcher, executor: Executor,
                 on_step: Callable[[int, int, float], None] | None = None,
                 refiner: DecodeRefiner | None = None, copier: Copier | None = None,
                 decode_step: Callable[..., torch.Tensor] | None = None,
                 writeback: GeneratedBlocks | None = None):
        self.runner = runner
        # runner.decode's contract; on CUDA the CUDA graphs' replay (model/cuda_graphs.py)
        self.decode_step = decode_step or runner.decode
        self.batcher = batcher
        self.executor = executor   # one thread: steps and KV writes, in order
        self.copier = copier or Copier(runner.device)
        self.on_step = on_step  # (batch, context_tokens, seconds) for metrics/profiling
        self.refiner = refiner  # told every step's timing: the cost model is refined from them
        self.writeback = writeback   # generated tokens' full blocks to the store (--store), or None
        self.pending: dict[str, PendingKV] = {}            # transfer_id -> pending
        self.requests: dict[str, RequestState] = {}        # request_id -> live request
        self._transfer_of: dict[str, str] = {}             # request_id -> transfer_id while pending
        self._wake = asyncio.Event()
        self.num_steps = 0
        self.step_seconds = 0.0   # their time, from submitting to the model thread to the tokens
        # The newest steps as (start on the host's monotonic clock, seconds, batch, context,
        # 1 if the loop waited for work before it, the longest sequence's context):
        # GET /v1/timeline, for the cost export's split of steps beside a prefill on this host
        # from those without (instance/refine.py).
        self.timeline: deque[tuple[float, float, int, int, int, int]] = deque(maxlen=TIMELINE_LEN)
        # Each joined request's (join time, prompt tokens, seconds its KV writes took in the
        # model thread): what receiving a prompt costs the steps around it (GET /v1/timeline).
        self.intake: deque[tuple[float, int, float]] = deque(maxlen=TIMELINE_LEN)

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, req: GenerateRequest, span: Any = None) -> asyncio.Queue:
        """Reserve room; raises AdmissionError with the reason if this instance refuses.
        ``span``: the request's span when traced; its admission and steps spans go under it."""
        if req.prompt_len <= 0:
            raise ValueError(f"prompt_len must be positive, got {req.prompt_len}")
        if req.transfer_id in self.pending:
            raise ValueError(f"transfer id {req.transfer_id!r} is already in use")
        s = req.sampling
        params = params_from_wire(s)
        if s.num_generated >= req.prompt_len:
            raise ValueError(f"num_generated ({s.num_generated}) must be less than prompt_len ({req.prompt_len})")
        if not 1 <= s.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {s.n}")
        # Before reserving: a grammar that fails (GrammarError, a ValueError: 400) costs nothing.
        masks = choice_masks(self.runner.grammars, s.grammar, s.n)
        admission = None if span is None else tracing.start_span(
            "decode.admission", span, prompt_tokens=req.prompt_len, max_tokens=s.max_tokens,
            num_running=self.batcher.num_running, kv_in_s=req.kv_in_s)
        try:
            # max_tokens counts a continued request's output so far: room for the rest only
            seq = self.batcher.reserve(req.request_id, req.prompt_len, params.max_tokens - s.num_generated,
                                       params.stop_token_ids, s.n, now=time.monotonic(), kv_in_s=req.kv_in_s)
        except Exception as exc:
            tracing.end_span(admission, f"refused: {exc}")
            raise
        loop = asyncio.get_running_loop()
        args = self.runner.args
        cells = [[0] * args.num_kv_heads for _ in range(args.num_layers)]
        pending = PendingKV(req.request_id, req.transfer_id, seq, cells,
                            timeout_s=req.kv_timeout_s, last_progress=loop.time(), admission_span=admission,
                            num_output=s.num_generated)
        pending.timer = loop.call_later(req.kv_timeout_s, self._kv_timeout, req.transfer_id)
        self.pending[req.transfer_id] = pending
        self._transfer_of[req.request_id] = req.transfer_id
        samplers = [SequenceSampler(params, i, self.runner.device, mask=mask) for i, mask in enumerate(masks)]
        state = RequestState(samplers, asyncio.Queue(), num_open=s.n, span=span)
        self.requests[req.request_id] = state
        return state.events

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        """Stop a request in any state and free its KV. False if it is not here (any more)."""
        state = self.requests.pop(request_id, None)
        tid = self._transfer_of.pop(request_id, None)
        if tid is not None:
            pending = self.pending.pop(tid, None)
            if pending is not None and pending.timer is not None:
                pending.timer.cancel()
            if pending is not None and pending.admission_span is not None:
                tracing.end_span(pending.receive_span, error or reason, layers=pending.progress())
                tracing.end_span(pending.admission_span, error or reason)
        self.batcher.abort(request_id)
        if state is None:
            return False
        state.end_steps(reason, error)
        state.events.put_nowait(TokenEvent(finish_reason=reason, error=error))
        return True

    # --- KV intake (called by the receiver on the loop) ----------------------------------------
    def check_layer(self, tid: str, layer: int, start: int, n: int, heads: range | None = None) -> PendingKV:
        """What a layer frame may carry: tokens ``start..start+n`` of KV heads ``heads`` (default:
        all) of a layer of a request this instance reserved and still waits for. Raises KVError
        otherwise. The receiver calls it when a frame's meta arrives, before any memory is
        allocated for its payload."""
        pending = self._pending(tid)
        num_layers = len(pending.layer_tokens)
        if not 0 <= layer < num_layers:
            raise KVError("bad_layer", f"layer {layer} out of range for a {num_layers}-layer model")
        prompt_len = pending.seq.prompt_len
        if start < 0 or n <= 0 or start + n > prompt_len:
            raise KVError("bad_range", f"tokens {start}..{start + n} outside the prompt of {prompt_len}")
        counts = pending.layer_tokens[layer]
        for head in range(len(counts)) if heads is None else heads:
            if counts[head] + n > prompt_len:
                raise KVError("duplicate", f"KV head {head} of layer {layer} of transfer {tid} got more than "
                                           f"{prompt_len} tokens")
        return pending

    def kv_layer(self, conn_id: int, tid: str, layer: int, start: int, n: int, kv: torch.Tensor,
                 traceparent: str | None = None, heads: range | None = None) -> asyncio.Future:
        """Queue one layer frame's KV for writing into the request's blocks (in the executor);
        the future is done once it is written (the receiver answers the frame then). ``heads``:
        the KV heads ``kv`` holds when not all (one TP prefill rank's slice), written at their
        place. ``traceparent`` (the frame meta's, when the prefill traces): the sender's span,
        parent of this end's receive span."""
        pending = self.check_layer(tid, layer, start, n, heads)
        pending.senders.add(conn_id)
        if traceparent is not None and pending.receive_span is None:
            pending.receive_span = tracing.start_span("decode.kv_receive", traceparent, kind="server",
                                                      request_id=pending.request_id, transfer_id=tid)
        table = torch.as_tensor(pending.seq.block_ids, dtype=torch.long)
        pos = torch.arange(start, start + n)
        slots = table[pos // self.runner.block_size] * self.runner.block_size + pos % self.runner.block_size
        counts = pending.layer_tokens[layer]
        for head in range(len(counts)) if heads is None else heads:
            counts[head] += n   # counted now: check_layer refuses a duplicate at once
        pending.num_writes += 1
        loop = asyncio.get_running_loop()
        pending.last_progress = loop.time()
        write = loop.run_in_executor(self.executor, self._write_kv, layer, slots, kv, heads)
        write.add_done_callback(lambda f, p=pending: self._written(p, f))
        return write

    def _write_kv(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, heads: range | None = None) -> float:
        """In the executor, between steps: scatter a frame's K/V into the paged cache; the
        seconds it took (the model thread's, which the steps wait for). On CUDA the slot indices
        travel like the K/V: through a pinned staging buffer, copied without a host wait (a
        pageable ``.to()`` would stall this thread); on the CPU both pass through."""
        t0 = time.perf_counter()
        on_device = self.copier.use(self.copier.to_device(kv))
        slots_on_device = self.copier.use(self.copier.to_device(slots))
        self.runner.scatter_kv(layer, slots_on_device, on_device, heads)
        return time.perf_counter() - t0

    def _written(self, pending: PendingKV, write: asyncio.Future) -> None:
        """A frame's write finished: the sequence joins once it was the last one outstanding."""
        pending.num_writes -= 1
        failed = write.cancelled() or write.exception() is not None
        if not failed:
            pending.write_s += write.result() or 0.0
        current = self.pending.get(pending.transfer_id) is pending   # else aborted or timed out meanwhile
        if current and failed:
            error = "cancelled" if write.cancelled() else repr(write.exception())
            log.error("transfer %s: writing KV into the cache failed: %s", pending.transfer_id, error)
            self.abort(pending.request_id, "error", f"writing received KV into the cache failed: {error}")
        elif current and pending.is_complete():
            self._join(pending)
        if pending.num_writes == 0 and pending.drained is not None and not pending.drained.done():
            if current and not failed:
                pending.drained.set_result(None)
            else:
                pending.drained.set_exception(KVError("aborted", f"transfer {pending.transfer_id} ended "
                                                                 "before its KV was written"))

    def kv_end(self, conn_id: int, tid: str, first_token: int | list[int] | None,
               resume: ResumePoint | None = None) -> asyncio.Future | None:
        """The sender is done (the last stage's END carries token 1, a list of one per choice
        for n > 1, and ``resume``, what the request continues from). Returns None when that is all, or a future done once the frames
        it sent are written (the receiver answers END then, so an answered END means the KV is
        in the cache and, if complete, the sequence has joined the batch)."""
        pending = self._pending(tid)
        pending.senders.discard(conn_id)
        if first_token is not None:
            tokens = first_token if isinstance(first_token, list) else [first_token]
            resume = resume or ResumePoint()
            state = self.requests.get(pending.request_id)
            if state is not None and len(tokens) != len(state.samplers):
                raise KVError("bad_token", f"{len(tokens)} first tokens for {len(state.samplers)} choices")
            if not all(0 <= t < self.runner.args.vocab_size for t in (*tokens, *resume.output, *(resume.tail or ()))):
                raise KVError("bad_token", f"first token(s) {tokens} or the resumed ids outside the vocabulary")
            if len(resume.output) != pending.num_output:
                raise KVError("bad_token", f"{len(resume.output)} output ids resumed; the request continues "
                                           f"after {pending.num_output} (num_generated)")
            pending.first_tokens, pending.resume = tokens, resume
        if pending.num_writes:
            if pending.drained is None or pending.drained.done():
                pending.drained = asyncio.get_running_loop().create_future()
            return pending.drained
        if pending.is_complete():
            self._join(pending)
        return None

    def kv_alive(self, tid: str) -> None:
        """The prefill holds this request in its queue: it is alive, the KV will come."""
        self._pending(tid).last_progress = asyncio.get_running_loop().time()

    def kv_abort(self, tid: str, reason: str) -> None:
        pending = self.pending.get(tid)
        if pending is not None:
            self.abort(pending.request_id, "error", f"prefill aborted the KV stream: {reason}")

    def sender_lost(self, conn_id: int, tids: set[str]) -> None:
        """A KV connection closed: every transfer it had not finished fails (its memory is freed)."""
        for tid in tids:
            pending = self.pending.get(tid)
            if pending is not None and conn_id in pending.senders:
                log.warning("KV stream for transfer %s broke midway (%s); failing request %s",
                            tid, pending.progress(), pending.request_id)
                self.abort(pending.request_id, "error",
                           f"KV stream from prefill broke midway ({pending.progress()})")

    def _pending(self, tid: str) -> PendingKV:
        pending = self.pending.get(tid)
        if pending is None:
            raise KVError("unknown_transfer", f"no request waits for transfer {tid!r} (finished, "
                          "aborted, timed out, or never announced with /v1/generate)")
        return pending

    def _kv_timeout(self, tid: str) -> None:
        """The KV must start within ``kv_timeout_s`` and never stall longer than that: a long
        prefill that keeps streaming is not cut off, a dead one is."""
        pending = self.pending.get(tid)
        if pending is None:
            return
        loop = asyncio.get_running_loop()
        idle = loop.time() - pending.last_progress
        if idle < pending.timeout_s:
            pending.timer = loop.call_later(pending.timeout_s - idle, self._kv_timeout, tid)
            return
        t = pending.timeout_s
        log.warning("transfer %s: no KV for %.3gs (%s)", tid, t, pending.progress())
        self.abort(pending.request_id, "error",
                   f"KV did not arrive within {t:g}s ({pending.progress()}); prefill dead or slow")

    def _join(self, pending: PendingKV) -> None:
        self.intake.append((time.monotonic(), pending.seq.prompt_len, pending.write_s))
        del self.pending[pending.transfer_id]
        self._transfer_of.pop(pending.request_id, None)
        if pending.timer is not None:
            pending.timer.cancel()
        reasons, copies = self.batcher.join_all(pending.request_id, pending.first_tokens)
        if copies:   # in the model thread, before any step of these choices
            asyncio.get_running_loop().run_in_executor(self.executor, self._copy_blocks, copies)
        state = self.requests.get(pending.request_id)
        for sampler, token in zip(state.samplers if state else (), pending.first_tokens):
            sampler.resume((*pending.resume.output, token))   # a continuation's output, then token 1
        joined = any(r is None for r in reasons)
        if self.writeback is not None:
            self.writeback.start([f"{pending.request_id}#{i}" if i else pending.request_id
                                  for i, r in enumerate(reasons) if r is None], pending.resume)
        if pending.admission_span is not None:
            self._trace_join(pending, None if joined else reasons[0])
        for index, reason in enumerate(reasons):
            if reason is not None:
                self._finish(pending.request_id, reason, index)
        if joined:
            self._wake.set()

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of the prompt's partial last block, one per further choice (n > 1)."""
        src, dst = (torch.as_tensor(ids, device=self.runner.device) for ids in zip(*copies))
        kv = self.runner.cache.kv
        kv[:, :, dst] = kv[:, :, src]

    def _trace_join(self, pending: PendingKV, reason: str | None) -> None:
        """The KV is in and the sequence joined the batch (or ended at once, ``reason``)."""
        tracing.end_span(pending.receive_span, layers=len(pending.layer_tokens), tokens=pending.seq.prompt_len)
        tracing.end_span(pending.admission_span, joined=reason is None, num_running=self.batcher.num_running,
                         num_waiting=self.batcher.num_waiting)
        state = self.requests.get(pending.request_id)
        if state is not None and reason is None:
            state.steps_span = tracing.start_span("decode.steps", state.span)

    def _finish(self, request_id: str, reason: str, index: int = 0) -> None:
        """Choice ``index`` ended; the request ends with the last of its choices."""
        state = self.requests.get(request_id)
        if state is not None:
            state.num_open -= 1
            if state.num_open == 0:
                del self.requests[request_id]
                state.end_steps(reason, None)
            state.events.put_nowait(TokenEvent(finish_reason=reason, index=index))

    # --- the step loop -------------------------------------------------------------------------
    async def run(self) -> None:
        """Forever: plan a step over the running sequences, compute it off-loop, deliver tokens."""
        loop = asyncio.get_running_loop()
        waited = 1
        while True:
            plan = self.batcher.plan()
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                waited = 1
                continue
            samplers = [RequestState.sampler_of(self.requests.get(rid), i)
                        for rid, i in zip(plan.request_ids, plan.indices)]
            t0, m0 = loop.time(), time.monotonic()
            try:
                tokens = await loop.run_in_executor(self.executor, self._compute, plan, samplers)
            except Exception as exc:  # a model failure fails this batch, never the server
                log.exception("decode step failed")
                self.batcher.commit(plan, [0] * len(plan))
                for rid in set(plan.request_ids):
                    self.abort(rid, "error", f"decode step failed: {exc}")
                continue
            if self.on_step is not None or self.refiner is not None:
                step = (len(plan), sum(p + 1 for p in plan.positions), loop.time() - t0)
                if self.on_step is not None:
                    self.on_step(*step)
                if self.refiner is not None:
                    self.refiner.observe(*step)
            self.num_steps += 1
            self.step_seconds += loop.time() - t0
            # time.monotonic, not loop.time: uvloop's is in whole ms and not the other roles' clock
            self.timeline.append((m0, time.monotonic() - m0, len(plan), sum(p + 1 for p in plan.positions), waited,
                                  max(plan.positions) + 1))
            waited = 0
            if self.writeback is not None:   # before the commit, which frees finished sequences' blocks
                self.writeback.stepped(plan, self.batcher.seqs)
            self._deliver(plan, tokens)
            await asyncio.sleep(0)  # let KV frames and HTTP writes in between steps

    def _deliver(self, plan: StepPlan, sampled: list[tuple[int, TokenLogprob | None]]) -> None:
        """Commit a step's tokens to the batch and hand each to its request's stream."""
        logprobs = {key: lp for key, (_, lp) in zip(plan.keys, sampled)}
        for out in self.batcher.commit(plan, [t for t, _ in sampled]):
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            error = state.grammar_error(out.index)
            if error is not None:   # its grammar failed: the token is not one it allows
                self.abort(out.request_id, "error", error)
                continue
            key = out.request_id if out.index == 0 else f"{out.request_id}#{out.index}"
            state.events.put_nowait(TokenEvent(token=out.token, index=out.index, logprob=logprobs[key]))
            if state.steps_span is not None:
                state.num_steps += 1
                state.batch_total += len(plan)
            if out.finish_reason is not None:
                self._finish(out.request_id, out.finish_reason, out.index)

    def _compute(self, plan: StepPlan, samplers: list[SequenceSampler | None]) -> list[tuple[int, TokenLogprob | None]]:
        # A step with a row reporting logprobs keeps float activations (kernels/quant_linear.py).
        with float_activations(any(s is not None and s.params.logprobs is not None for s in samplers)):
            logits = self.decode_step(plan.token_ids, plan.block_tables, plan.positions)
        return sample_rows(logits, samplers)

    def load(self) -> InstanceLoad:
        b = self.batcher
        ratios = self.refiner.ratio_quantiles() if self.refiner is not None else None
        # how steps spread around the model (instance/refine.py), once there are enough of them
        spread = dict(zip(STEP_RATIO_KEYS, ratios)) if ratios is not None else {}
        return InstanceLoad(num_running=b.num_running, num_waiting=b.num_waiting, context_tokens=b.context_tokens,
                            free_blocks=b.allocator.num_free, max_context_tokens=b.allocator.num_blocks * b.block_size,
                            predicted_tbt_s=b.predicted_tbt() or 0.0, max_batch_size=b.max_batch_size, **spread)
