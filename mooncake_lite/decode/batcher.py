"""Continuous batching for one decode instance, as pure logic (no IO, no clock, no torch).

A request goes through three states:

    reserve()  -> waiting for KV  (blocks for prompt + max_tokens held, KV streaming in)
    join()     -> running         (the first token came with the KV; it decodes every step)
    finished / aborted            (blocks go back to the allocator)

Every step, :meth:`plan` takes all running sequences (they join and leave between steps) and
:meth:`commit` appends the sampled tokens. A sequence aborted while its step is in flight keeps its
blocks until that step is committed: the step still writes that sequence's KV slot, and the block
must not be handed to a new request before then.

A request of ``n`` > 1 choices reserves ``n`` sequences from one prefill: the prompt's full
blocks once, shared by reference (freed with the last of them), and for each its own blocks from
the prompt's partial last block on; :meth:`join_all` says which blocks the engine must copy so
each choice starts from the prompt's tail (copy-on-write of that one block, at join).

Admission (:meth:`check_admit`) predicts the TBT the batch would have with the new request when its
KV is due, from the scheduler's fitted :class:`DecodeCostModel`, and refuses with a readable reason
when it would break the SLO or the KV memory cannot hold the request.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

from mooncake_lite.model.kv_cache import BlockAllocator, blocks_needed
from mooncake_lite.scheduler.admission import Held, held_load_at, tbt_refusal
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
    index: int = 0         # its choice (n > 1)
    num_shared: int = 0    # leading blocks shared with its siblings, freed by the last of them
    join_at: float = 0.0   # when its KV is due (the caller's clock: reserved at + kv_in_s), until it runs

    def held(self, now: float) -> Held:
        """What the TBT check reads of it (``scheduler/admission.Held``): running, it decodes from
        ``now`` for its tokens left (an aborted one leaves at its next step)."""
        left = 0 if self.is_aborted else self.max_tokens - len(self.output_ids)
        return now if self.is_running else self.join_at, left, self.context_len

    @property
    def key(self) -> str:
        """Its key in the batch: the request id for choice 0, ``id#i`` for choice i."""
        return self.request_id if self.index == 0 else f"{self.request_id}#{self.index}"

    @property
    def context_len(self) -> int:
        """Tokens the sequence occupies (prompt + generated)."""
        return self.prompt_len + len(self.output_ids)


@dataclass(frozen=True)
class StepPlan:
    """One decode step: sequence i (``keys[i]``: choice ``indices[i]`` of ``request_ids[i]``)
    feeds ``token_ids[i]`` at ``positions[i]``."""
    keys: tuple[str, ...]
    request_ids: tuple[str, ...]
    indices: tuple[int, ...]
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class TokenOut:
    """A token produced for choice ``index`` of a request; ``finish_reason`` set on its last one."""
    request_id: str
    index: int
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
    seqs: dict[str, DecodeSequence] = field(default_factory=dict, init=False, repr=False)   # by key
    _in_flight: set[str] = field(default_factory=set, init=False, repr=False)
    # n > 1: a request's live sequences (keys), which share its prompt's full blocks
    _groups: dict[str, list[str]] = field(default_factory=dict, init=False, repr=False)

    # --- admission -------------------------------------------------------------------------------
    def predicted_tbt(self, extra_seqs: int = 0, extra_context: int = 0) -> float | None:
        """Predicted step time for everything admitted (running or waiting for KV) plus extras."""
        if self.cost is None:
            return None
        batch = len(self.seqs) + extra_seqs
        context = sum(s.context_len for s in self.seqs.values()) + extra_context
        return self.cost.predict(batch, context)

    def check_admit(self, prompt_len: int, max_tokens: int, n: int = 1, *, now: float = 0.0,
                    kv_in_s: float | None = None) -> str | None:
        """None if a request of this size (``n`` choices) may join, else the reason it may not.
        ``kv_in_s``: seconds from ``now`` until its KV is due (None: unknown, as if now)."""
        if prompt_len <= 0 or max_tokens <= 0 or n <= 0:
            return f"prompt_len, max_tokens and n must be positive, got {prompt_len}, {max_tokens}, {n}"
        need = self.blocks_for(prompt_len, max_tokens, n)
        if need > self.allocator.num_blocks:
            return (f"request needs {need} KV blocks ({prompt_len}+{max_tokens} tokens) but this decode "
                    f"instance has only {self.allocator.num_blocks}")
        if not self.allocator.can_allocate(need):
            return f"KV cache full: need {need} blocks, {self.allocator.num_free} free"
        if self.max_batch_size is not None and len(self.seqs) + n > self.max_batch_size:
            return f"batch full: {len(self.seqs)} + {n} of max {self.max_batch_size} sequences"
        if self.cost is None:
            return None
        # Memory and the batch bound are for everything held; the step, for what still decodes
        # when this request joins (the simulator's check too: scheduler/admission.held_load_at).
        t = None if kv_in_s is None else now + kv_in_s
        batch, context = held_load_at([s.held(now) for s in self.seqs.values()], self.cost, now, t)
        reason = tbt_refusal(self.cost, batch, context, prompt_len, self.tbt_slo_s, self.tbt_slo_factor, n)
        if reason is None or t is None:
            return reason
        return f"{reason} when its KV is due in {kv_in_s:.2f} s ({len(self.seqs)} sequences held)"

    def blocks_for(self, prompt_len: int, max_tokens: int, n: int = 1) -> int:
        """Blocks ``n`` choices take: the prompt's full blocks once, the rest each."""
        shared = prompt_len // self.block_size if n > 1 else 0
        return shared + n * (blocks_needed(prompt_len + max_tokens, self.block_size) - shared)

    def reserve(self, request_id: str, prompt_len: int, max_tokens: int,
                stop_token_ids: tuple[int, ...] = (), n: int = 1, *, now: float = 0.0,
                kv_in_s: float | None = None) -> DecodeSequence:
        """Hold blocks for the whole request (prompt + outputs: no preemption needed later), for
        each of its ``n`` choices; returns choice 0's sequence, whose blocks the KV arrives in.
        ``now``, ``kv_in_s``: as :meth:`check_admit` takes them; its KV is due at their sum."""
        keys = [request_id, *(f"{request_id}#{i}" for i in range(1, n))]
        if any(k in self.seqs for k in keys):
            raise ValueError(f"request {request_id!r} is already on this decode instance")
        reason = self.check_admit(prompt_len, max_tokens, n, now=now, kv_in_s=kv_in_s)
        if reason is not None:
            raise AdmissionError(reason)
        shared = prompt_len // self.block_size if n > 1 else 0
        own = blocks_needed(prompt_len + max_tokens, self.block_size) - shared
        first = self.allocator.allocate(shared + own)
        for i, key in enumerate(keys):
            table = first if i == 0 else first[:shared] + self.allocator.allocate(own)
            self.seqs[key] = DecodeSequence(request_id, prompt_len, max_tokens, tuple(stop_token_ids), table,
                                            index=i, num_shared=shared, join_at=now + (kv_in_s or 0.0))
        if n > 1:
            self._groups[request_id] = keys
        return self.seqs[request_id]

    # --- lifecycle -----------------------------------------------------------------------------
    def join(self, request_id: str, first_token: int) -> str | None:
        """The KV is complete and prefill sampled ``first_token``: start decoding. Returns a
        finish reason if the request is already done (stop token or max_tokens == 1)."""
        return self.join_all(request_id, [first_token])[0][0]

    def join_all(self, request_id: str, first_tokens: list[int]) -> tuple[list[str | None], list[tuple[int, int]]]:
        """:meth:`join` for every choice (``first_tokens[i]``: choice i's token 1): each one's
        finish reason, and the (source, destination) blocks to copy before the next step, so
        that each running choice's own first block holds the prompt's tail (n > 1)."""
        seqs = [self.seqs[k] for k in self._keys(request_id)]
        if len(first_tokens) != len(seqs):
            raise ValueError(f"{len(first_tokens)} first tokens for a request of {len(seqs)} choices")
        if any(s.is_running for s in seqs):
            raise ValueError(f"request {request_id!r} already joined")
        tail = seqs[0].prompt_len % self.block_size and len(seqs) > 1
        copies = [(seqs[0].block_ids[s.num_shared], s.block_ids[s.num_shared]) for s in seqs[1:]] if tail else []
        reasons = []
        for seq, token in zip(seqs, first_tokens):
            seq.output_ids.append(token)
            reasons.append(self._finish_reason(seq))
            seq.is_running = reasons[-1] is None
        for seq, reason in zip(seqs, reasons):   # the source block is freed last, if at all
            if reason is not None:
                self._release(seq)
        return reasons, [c for c, r in zip(copies, reasons[1:]) if r is None]

    def abort(self, request_id: str) -> bool:
        """Drop a request (every choice) in any state. False if unknown (already finished)."""
        seqs = [self.seqs[k] for k in self._keys(request_id) if k in self.seqs]
        if not seqs or all(s.is_aborted for s in seqs):
            return False
        for seq in seqs:
            seq.is_aborted = True
            seq.is_running = False
            if seq.key not in self._in_flight:
                self._release(seq)
        return True

    def plan(self) -> StepPlan | None:
        """All running sequences, each feeding its last token. None when nothing runs."""
        running = [s for s in self.seqs.values() if s.is_running]
        if not running:
            return None
        if self._in_flight:
            raise RuntimeError("plan() while a step is in flight; commit() it first")
        self._in_flight = {s.key for s in running}
        return StepPlan(tuple(s.key for s in running), tuple(s.request_id for s in running),
                        tuple(s.index for s in running), tuple(s.output_ids[-1] for s in running),
                        tuple(s.context_len - 1 for s in running), tuple(tuple(s.block_ids) for s in running))

    def commit(self, plan: StepPlan, tokens: list[int]) -> list[TokenOut]:
        """Append the sampled tokens; finished (and aborted-in-flight) sequences release blocks."""
        if len(tokens) != len(plan):
            raise ValueError(f"{len(tokens)} tokens for a step of {len(plan)} sequences")
        out: list[TokenOut] = []
        for key, token in zip(plan.keys, tokens):
            seq = self.seqs[key]
            if seq.is_aborted:
                self._release(seq)
                continue
            seq.output_ids.append(token)
            reason = self._finish_reason(seq)
            out.append(TokenOut(seq.request_id, seq.index, token, reason))
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

    def _keys(self, request_id: str) -> list[str]:
        return self._groups.get(request_id, [request_id])

    def _release(self, seq: DecodeSequence) -> None:
        """Free the sequence's own blocks; the shared ones go with the last of its siblings."""
        keys = self._groups.get(seq.request_id)
        if keys is not None:
            keys.remove(seq.key)
            if not keys:
                del self._groups[seq.request_id]
        self.allocator.free(seq.block_ids[seq.num_shared if keys else 0:])
        seq.block_ids = []
        seq.is_running = False
        del self.seqs[seq.key]
