"""What the scheduler is told: the request and a snapshot of every live instance.

All plain frozen dataclasses so the live conductor (from heartbeats and its own bookkeeping) and
the simulator (from its event queue) can build them cheaply. Times are seconds on the caller's
clock; the scheduler only ever compares them with the ``now`` it is given.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from mooncake_lite.scheduler.costs import DecodeCostModel, PrefillCostModel

# How many tokens a decode batch's running requests may have generated, in total, beyond the
# contexts its state shows: at least MAX_CONTEXT_LAG, and up to 1/64 of the batch's shown
# context. Rebuilding states on every token would throw away their derived data (estimate.py)
# before nearly every decision and cost a new record per running request. The cost model reads
# the batch's *total* context, so the bound is on the total: any predicted TBT (now or at a
# future time, for any subset of the batch) is off by at most 1/64 of the batch's context term
# — far inside the cost model's own error — and a batch refreshes once per ~mean context / 64
# steps instead of whenever its shortest request crosses its own bound. Both the live conductor
# and the simulator keep states within it.
MAX_CONTEXT_LAG = 32


def context_lag_bound(shown_context_tokens: int) -> int:
    """Tokens a decode batch whose state shows ``shown_context_tokens`` in total may have
    generated (summed over its running requests) beyond what the state shows."""
    return max(MAX_CONTEXT_LAG, shown_context_tokens >> 6)


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    """One request to place. ``block_keys`` are the chained keys of its *full* prompt blocks
    (16-byte ``bytes`` live, ints in the simulator); ``num_tokens`` is the whole prompt length."""

    request_id: str
    block_keys: tuple[Hashable, ...]
    num_tokens: int
    max_output_tokens: int

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"request {self.request_id}: num_tokens must be positive, got {self.num_tokens}")
        if self.max_output_tokens <= 0:
            raise ValueError(f"request {self.request_id}: max_output_tokens must be positive, "
                             f"got {self.max_output_tokens}")


@dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """Prefill work already assigned to an instance, in execution order.

    ``started_at`` is set for the job(s) executing now (remaining time = predicted − elapsed).
    Where its KV goes afterwards is said once, on the decode side
    (:attr:`DecodeInstanceState.incoming`, same ``request_id``); the scheduler reads this queue
    for *when* that request's prefill ends.
    """

    request_id: str
    num_tokens: int
    num_prefix_tokens: int = 0
    started_at: float | None = None


def _derived() -> Any:
    """A slot for data the estimators derive from a state and keep on it (estimate.py): not
    an argument, never compared or shown, set through ``object.__setattr__`` — the state's own
    fields never change, so neither does what is derived from them. Slots, not a ``__dict__``:
    a decision reads every instance's state, and each dict is more cold cache lines."""
    return field(default=None, init=False, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class PrefillInstanceState:
    """A prefill instance: its local store (where its prefix hits come from), queued work,
    measured inbound bandwidth for KV fetches, and its self-profiled cost model if reported."""

    instance_id: str
    store_id: Hashable
    queue: tuple[QueuedPrefill, ...] = ()
    bandwidth_bytes_per_s: float | None = None
    cost: PrefillCostModel | None = None
    _backlog: tuple | None = _derived()
    _previous: PrefillInstanceState | None = _derived()


@dataclass(frozen=True, slots=True)
class DecodingRequest:
    """A request in (or committed to) a decode instance's continuous batch.

    ``context_tokens`` is prompt + tokens generated so far; ``joined_at`` is when it entered the
    batch (used with t_d by predictive admission); ``max_output_tokens`` (None = unknown) sizes
    its t_d when ``SchedulerConfig.uniform_decode_s`` is None — an unknown one is assumed to
    still be decoding at any future time (the conservative guess)."""

    request_id: str
    context_tokens: int
    joined_at: float
    max_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class IncomingRequest:
    """A request the caller has committed to a decode instance whose KV has not arrived yet
    (its prefill is queued or running, or its KV is still in transit). It will be in that
    instance's batch, so decode selection and admission count it (REFERENCE.md §3).

    When it joins is not stored here: the scheduler predicts its prefill end from the prefill
    queue holding the same ``request_id`` (one source of truth, nothing counted twice); one in
    no queue has finished prefill and joins as soon as its KV lands. ``context_tokens`` is the
    prompt length it brings; ``max_output_tokens`` (None = unknown) sizes its t_d like
    :class:`DecodingRequest`'s."""

    request_id: str
    context_tokens: int
    max_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class DecodeInstanceState:
    """A decode instance: its running batch (KV arrived) and the requests committed to it whose
    KV is still to come (``incoming``, from the caller's record of what it dispatched).
    ``max_batch_size`` / ``max_context_tokens`` (None = unlimited) make a full instance
    ineligible; the capacity check counts incoming requests too."""

    instance_id: str
    running: tuple[DecodingRequest, ...] = ()
    max_batch_size: int | None = None
    max_context_tokens: int | None = None
    cost: DecodeCostModel | None = None
    incoming: tuple[IncomingRequest, ...] = ()
    _context_tokens: int | None = _derived()
    _committed_load: tuple[int, int] | None = _derived()
    _leave: Any = _derived()
    _previous: tuple | None = _derived()


@dataclass(frozen=True)
class ClusterState:
    """Snapshot of the live instances at decision time (dead ones already left out)."""

    prefills: tuple[PrefillInstanceState, ...] = field(default_factory=tuple)
    decodes: tuple[DecodeInstanceState, ...] = field(default_factory=tuple)
