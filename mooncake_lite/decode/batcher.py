"""Continuous batching for one decode instance, as pure logic (no IO, no clock, no torch).

A request goes through three states:

    reserve()  -> waiting for KV  (blocks for prompt + max_tokens held, KV streaming in)
    join()     -> running         (the first token came with the KV; it decodes every step)
    finished / aborted            (blocks go back to the allocator)

Every step, :meth:`plan` takes all running sequences (they join and leave between steps) and
:meth:`commit` appends the sampled tokens. A sequence aborted while its step is in flight keeps its
blocks until that step is committed: the step still writes that sequence's KV slot, and the block
must not be handed to a new request before then.

Admission (:meth:`check_admit`) predicts the TBT the batch would have with the new request, from
the scheduler's fitted :class:`DecodeCostModel`, and refuses with a readable reason when it would
break the SLO or the KV memory cannot hold the request.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

from mooncake_lite.model.kv_cache import BlockAllocator, blocks_needed
from mooncake_lite.scheduler.admission import tbt_refusal
from mooncake_lite.scheduler.costs import DecodeCostModel


class AdmissionError(RuntimeError):
    """A request may not join this instance now (SLO, memory or batch limit); ``str`` is why."""


@dataclass
class DecodeSequence:
    request_id: str
    prompt_len: int
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    block_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    is_running: bool = False
    is_aborted: bool = False

    @property
    def context_len(self) -> int:
        """Tokens the sequence occupies (prompt + generated)."""
        return self.prompt_len + len(self.output_ids)


@dataclass(frozen=True)
class StepPlan:
    """One decode step: sequence i feeds ``token_ids[i]`` at ``positions[i]``."""
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class TokenOut:
    """A token produced for a request; ``finish_reason`` set on its last one."""
    request_id: str
    token: int
    finish_reason: str | None


@dataclass(eq=False)
class DecodeBatcher:
    allocator: BlockAllocator
    block_size: int
    _: KW_ONLY
    max_batch_size: int | None = None
    cost: DecodeCostModel | None = None   # replaced as the instance refines its model
    # The local TBT check: absolute (tbt_slo_s) if set, else relative (tbt_slo_factor × one
    # step of the request alone, by this instance's cost model), else off.
    tbt_slo_s: float | None = None
    tbt_slo_factor: float | None = None
    seqs: dict[str, DecodeSequence] = field(default_factory=dict, init=False, repr=False)
    _in_flight: set[str] = field(default_factory=set, init=False, repr=False)

    # --- admission -------------------------------------------------------------------------------
    def predicted_tbt(self, extra_seqs: int = 0, extra_context: int = 0) -> float | None:
        """Predicted step time for everything admitted (running or waiting for KV) plus extras."""
        if self.cost is None:
            return None
        batch = len(self.seqs) + extra_seqs
        context = sum(s.context_len for s in self.seqs.values()) + extra_context
        return self.cost.predict(batch, context)

    def check_admit(self, prompt_len: int, max_tokens: int) -> str | None:
        """None if a request of this size may join, else the reason it may not."""
        if prompt_len <= 0 or max_tokens <= 0:
            return f"prompt_len and max_tokens must be positive, got {prompt_len}, {max_tokens}"
        need = blocks_needed(prompt_len + max_tokens, self.block_size)
        if need > self.allocator.num_blocks:
            return (f"request needs {need} KV blocks ({prompt_len}+{max_tokens} tokens) but this decode "
                    f"instance has only {self.allocator.num_blocks}")
        if not self.allocator.can_allocate(need):
            return f"KV cache full: need {need} blocks, {self.allocator.num_free} free"
        if self.max_batch_size is not None and len(self.seqs) >= self.max_batch_size:
            return f"batch full: {len(self.seqs)} of max {self.max_batch_size} sequences"
        if self.cost is None:
            return None
        # The simulator runs this same check (scheduler/admission.tbt_refusal) on what a decode
        # holds: every reserved sequence, running or still waiting for its KV.
        context = sum(s.context_len for s in self.seqs.values())
        return tbt_refusal(self.cost, len(self.seqs), context, prompt_len, self.tbt_slo_s, self.tbt_slo_factor)

    def reserve(self, request_id: str, prompt_len: int, max_tokens: int,
                stop_token_ids: tuple[int, ...] = ()) -> DecodeSequence:
        """Hold blocks for the whole request (prompt + outputs: no preemption needed later)."""
        if request_id in self.seqs:
            raise ValueError(f"request {request_id!r} is already on this decode instance")
        reason = self.check_admit(prompt_len, max_tokens)
        if reason is not None:
            raise AdmissionError(reason)
        blocks = self.allocator.allocate(blocks_needed(prompt_len + max_tokens, self.block_size))
        seq = DecodeSequence(request_id, prompt_len, max_tokens, tuple(stop_token_ids), blocks)
        self.seqs[request_id] = seq
        return seq

    # --- lifecycle -----------------------------------------------------------------------------
    def join(self, request_id: str, first_token: int) -> str | None:
        """The KV is complete and prefill sampled ``first_token``: start decoding. Returns a
        finish reason if the request is already done (stop token or max_tokens == 1)."""
        seq = self.seqs[request_id]
        if seq.is_running:
            raise ValueError(f"request {request_id!r} already joined")
        seq.output_ids.append(first_token)
        reason = self._finish_reason(seq)
        if reason is not None:
            self._release(seq)
        else:
            seq.is_running = True
        return reason

    def abort(self, request_id: str) -> bool:
        """Drop a request in any state. False if unknown (already finished)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_aborted:
            return False
        seq.is_aborted = True
        seq.is_running = False
        if request_id not in self._in_flight:
            self._release(seq)
        return True

    def plan(self) -> StepPlan | None:
        """All running sequences, each feeding its last token. None when nothing runs."""
        running = [s for s in self.seqs.values() if s.is_running]
        if not running:
            return None
        if self._in_flight:
            raise RuntimeError("plan() while a step is in flight; commit() it first")
        self._in_flight = {s.request_id for s in running}
        return StepPlan(tuple(s.request_id for s in running), tuple(s.output_ids[-1] for s in running),
                        tuple(s.context_len - 1 for s in running), tuple(tuple(s.block_ids) for s in running))

    def commit(self, plan: StepPlan, tokens: list[int]) -> list[TokenOut]:
        """Append the sampled tokens; finished (and aborted-in-flight) sequences release blocks."""
        if len(tokens) != len(plan):
            raise ValueError(f"{len(tokens)} tokens for a step of {len(plan)} sequences")
        out: list[TokenOut] = []
        for request_id, token in zip(plan.request_ids, tokens):
            seq = self.seqs[request_id]
            if seq.is_aborted:
                self._release(seq)
                continue
            seq.output_ids.append(token)
            reason = self._finish_reason(seq)
            out.append(TokenOut(request_id, token, reason))
            if reason is not None:
                self._release(seq)
        self._in_flight = set()
        return out

    # --- load figures --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return sum(1 for s in self.seqs.values() if s.is_running)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.seqs.values() if not s.is_running and not s.is_aborted)

    @property
    def context_tokens(self) -> int:
        return sum(s.context_len for s in self.seqs.values() if not s.is_aborted)

    # --- internals -----------------------------------------------------------------------------
    def _finish_reason(self, seq: DecodeSequence) -> str | None:
        if seq.output_ids[-1] in seq.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= seq.max_tokens:
            return "length"
        return None

    def _release(self, seq: DecodeSequence) -> None:
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.is_running = False
        del self.seqs[seq.request_id]
