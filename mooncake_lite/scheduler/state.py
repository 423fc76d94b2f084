"""What the scheduler is told: the request and a snapshot of every live instance.

All plain frozen dataclasses so the live conductor (from heartbeats and its own bookkeeping) and
the simulator (from its event queue) can build them cheaply. Times are seconds on the caller's
clock; the scheduler only ever compares them with the ``now`` it is given.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import MISSING, dataclass, field, fields
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


def _slot_init(cls: type) -> type:
    """Replace a frozen slotted dataclass's generated ``__init__`` with one of the same
    signature that writes each slot through its descriptor. The generated one calls
    ``object.__setattr__(self, name, value)`` per field (a name lookup each, ~0.2 µs); the
    conductor builds several states per decision and the simulator one per event, and this
    halves that cost. Fields without ``init`` get their default, as dataclasses does."""
    unsupported = [f.name for f in fields(cls) if f.default_factory is not MISSING or f.kw_only
                   or (not f.init and f.default is MISSING)]
    if hasattr(cls, "__post_init__") or unsupported:
        raise TypeError(f"{cls.__name__}: _slot_init builds plain positional fields with plain defaults "
                        f"and no __post_init__; not {unsupported or '__post_init__'}")
    params, body, env = [], [], {}
    for f in fields(cls):
        env[f"_set_{f.name}"] = getattr(cls, f.name).__set__
        if not f.init:
            env[f"_default_{f.name}"] = f.default
            body.append(f"_set_{f.name}(self, _default_{f.name})")
            continue
        if f.default is MISSING:
            params.append(f.name)
        else:
            env[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        body.append(f"_set_{f.name}(self, {f.name})")
    source = f"def __init__(self, {', '.join(params)}):\n    " + "\n    ".join(body)
    exec(source, env)   # noqa: S102 — built from the class's own field names, as dataclasses does
    env["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = env["__init__"]
    return cls


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


@_slot_init
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


@_slot_init
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


@_slot_init
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


@_slot_init
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


@_slot_init
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
