"""What the scheduler is told: the request and a snapshot of every live instance.

Plain values, read-only by contract: the estimate cache keys what it derives on a state's
identity (the same object means the same values), so nothing changes a record once built —
a change is a new record. They are not ``frozen`` dataclasses because a frozen one sets each
field through ``object.__setattr__`` (three times the cost of a plain slot write), and the
simulator builds ~10 of them per request; they stay hashable by their fields. The live
conductor and the simulator build the instance states with the same class
(:mod:`mooncake_lite.scheduler.view`); tests build them by hand. Times are seconds on
the caller's clock; the scheduler only ever compares them with the ``now`` it is given. What
the scheduler derives from a state (predicted queue times, leave times) is not kept on it: see
:mod:`mooncake_lite.scheduler.cache`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from mooncake_lite.scheduler.costs import DecodeCostModel, PrefillCostModel


@dataclass(slots=True, unsafe_hash=True)
class ScheduleRequest:
    """One request to place. ``block_keys`` are the chained keys of its *full* prompt blocks
    (16-byte ``bytes`` live, ints in the simulator); ``num_tokens`` is the whole prompt length.
    ``num_sequences``: the sequences it decodes (OpenAI's ``n``): one prefill, then n sequences
    in the decode batch, each attending to the whole prompt, whose KV they share."""

    request_id: str
    block_keys: tuple[Hashable, ...]
    num_tokens: int
    max_output_tokens: int
    num_sequences: int = 1

    def __post_init__(self) -> None:
        if self.num_sequences <= 0:
            raise ValueError(f"request {self.request_id}: num_sequences must be positive, got {self.num_sequences}")
        if self.num_tokens <= 0:
            raise ValueError(f"request {self.request_id}: num_tokens must be positive, got {self.num_tokens}")
        if self.max_output_tokens <= 0:
            raise ValueError(f"request {self.request_id}: max_output_tokens must be positive, "
                             f"got {self.max_output_tokens}")


@dataclass(slots=True, unsafe_hash=True)
class QueuedPrefill:
    """Prefill work already assigned to an instance, in execution order.

    ``started_at`` is set for the job(s) executing now (remaining time = predicted − elapsed).
    Where its KV goes afterwards is said once, on the decode side
    (:attr:`DecodeInstanceState.incoming`, same ``request_id``); the scheduler reads this queue
    for *when* that request's prefill ends. ``passed``: how many later arrivals were queued ahead
    of it (shortest-first order, :mod:`~mooncake_lite.scheduler.queue_order`). ``pack_cap``: the
    most uncached tokens a packed forward holding it may have (0: the instance's budget alone;
    ``costs.pack_sizes``, set by the decision: ``scheduler.packing.slo_pack_cap``). ``ends_at``: for
    the started head, when its instance, reading the chunks it has run, says its forward ends (its
    heartbeat, ``RunningPrefill``), or, started at once on an empty queue, its start plus its forward
    as its decision priced it; it is then priced to end there, not at its duration by the model as
    it stands (:meth:`reported_s`; None: nothing reported). A job started alone runs at the speed of
    the node's state then (idle: its neighbour's CPUs borrowed), while the queue behind it is priced
    in the busy state its own presence makes: repriced busy, one 136-token head priced 0.29 s took
    0.35 s and was held at 0.48 s for the jobs behind it (docs/results/2026-12-01-zen3-admission.md §20).
    """

    request_id: str
    num_tokens: int
    num_prefix_tokens: int = 0
    started_at: float | None = None
    passed: int = 0
    pack_cap: int = 0
    ends_at: float | None = None

    def reported_s(self) -> float | None:
        """The duration its instance's report gives this started job (None: none reported): a
        job that has run chunks is priced by them, not by the model that priced it before it ran."""
        if self.ends_at is None or self.started_at is None:
            return None
        return max(0.0, self.ends_at - self.started_at)


@dataclass(slots=True, unsafe_hash=True)
class PrefillInstanceState:
    """A prefill instance: its local store (where its prefix hits come from), queued work,
    measured inbound bandwidth for KV fetches, and its self-profiled cost model if reported.
    ``pack_tokens``: the uncached tokens one forward of it packs (prefill batching, priced by
    :mod:`mooncake_lite.scheduler.packing`; 0: one job a forward). ``overtakes``: the bound of its
    shortest-first queue order (:mod:`mooncake_lite.scheduler.queue_order`; 0: FIFO).
    ``overtake_share``: the share of that bound's worst case a new job is predicted to meet, in
    [0, 1] (:func:`~mooncake_lite.scheduler.queue_order.overtake_allowance`): 1, the worst case,
    unless the online correction learns what this instance's jobs really met (from 0:
    :mod:`mooncake_lite.scheduler.correction`); ``recent_uncached``: then, the uncached tokens of
    the last jobs queued on it, sorted (how many later arrivals are likely shorter than a job).
    ``queue_spread``: what admission multiplies its predicted queue by (``admission.bounds``;
    ``Corrections.queue_bound``: 1, the central prediction, unless a quantile of measured /
    predicted waits is asked for); the prediction itself stays central. ``join_share``: with
    packing, the share of :func:`~mooncake_lite.scheduler.queue_order.join_allowance`'s worst case
    (later arrivals joining a job's forward) a new job is predicted to meet; 0 until learned.
    ``queue_scale``: what the wait for the work queued ahead (before any overtake or join
    allowance) is multiplied by: the online correction's ``queue`` factor, the queue alone, so a
    queue that drains faster or slower than its forwards leaves each request's own forward priced
    as it runs (1: not learned)."""

    instance_id: str
    store_id: Hashable
    queue: tuple[QueuedPrefill, ...] = ()
    bandwidth_bytes_per_s: float | None = None
    cost: PrefillCostModel | None = None
    pack_tokens: int = 0
    overtakes: int = 0
    overtake_share: float = 1.0
    recent_uncached: tuple[int, ...] = ()
    queue_spread: float = 1.0
    join_share: float = 0.0
    queue_scale: float = 1.0


@dataclass(slots=True, unsafe_hash=True)
class DecodingRequest:
    """A request in a decode instance's continuous batch (its KV has arrived).

    ``context_tokens`` is prompt + tokens generated so far; ``joined_at`` is when it entered the
    batch (used with t_d by predictive admission); ``max_output_tokens`` (None = unknown) sizes
    its t_d when ``SchedulerConfig.uniform_decode_s`` is None — an unknown one is assumed to
    still be decoding at any future time (the conservative guess)."""

    request_id: str
    context_tokens: int
    joined_at: float
    max_output_tokens: int | None = None


@dataclass(slots=True, unsafe_hash=True)
class IncomingRequest:
    """A request the caller has committed to a decode instance whose KV has not arrived yet
    (its prefill is queued or running, or its KV is still in transit). It will be in that
    instance's batch, so decode selection and admission count it (docs/paper.md §3).

    When it joins is not stored here: the scheduler predicts its prefill end from the prefill
    queue holding the same ``request_id`` (one source of truth, nothing counted twice); one in
    no queue has finished prefill and joins as soon as its KV lands. ``context_tokens`` is the
    prompt length it brings; ``max_output_tokens`` (None = unknown) sizes its t_d like
    :class:`DecodingRequest`'s."""

    request_id: str
    context_tokens: int
    max_output_tokens: int | None = None


@dataclass(slots=True, unsafe_hash=True)
class DecodeInstanceState:
    """A decode instance: its running batch (KV arrived) and the requests committed to it whose
    KV is still to come (``incoming``, from the caller's record of what it dispatched).
    ``max_batch_size`` / ``max_context_tokens`` (None = unlimited) make a full instance
    ineligible; the capacity check counts incoming requests too.

    ``tbt_s`` is the time between tokens the running requests' remaining decode is sized with
    when t_d is per request (t_d = max_output_tokens × tbt_s); None: the TBT the instance's
    cost model predicts for its running batch. The instance view keeps it while the batch's
    predicted TBT stays within ``MAX_TBT_DRIFT`` of it (:mod:`mooncake_lite.scheduler.view`).
    ``tbt_spread``: the TBT's like :attr:`PrefillInstanceState.queue_spread` (measured TBT, the
    slowest 10% of gaps, over the TBT predicted). ``tbt_tail``: its measured TBT over its mean
    gap, learned (``Corrections.tail``); the TBT a decision predicts is the step × it."""

    instance_id: str
    running: tuple[DecodingRequest, ...] = ()
    max_batch_size: int | None = None
    max_context_tokens: int | None = None
    cost: DecodeCostModel | None = None
    incoming: tuple[IncomingRequest, ...] = ()
    tbt_s: float | None = None
    tbt_spread: float = 1.0
    tbt_tail: float = 1.0
    # at most the fewest output tokens an incoming request may decode (0, the default: not known):
    # the decode load at t looks up when they joined only where one may have left by t
    incoming_shortest: float = 0.0

    # Written out, not generated: mypyc compiles this one, where the dataclass's own is interpreted
    # Python setting each field through a descriptor (~1.3k instructions a build against ~0.1k; the
    # compiled simulator builds ~6 a request). tests/scheduler/test_state.py checks it takes the
    # fields, in order, with their defaults.
    def __init__(self, instance_id: str, running: tuple[DecodingRequest, ...] = (),
                 max_batch_size: int | None = None, max_context_tokens: int | None = None,
                 cost: DecodeCostModel | None = None, incoming: tuple[IncomingRequest, ...] = (),
                 tbt_s: float | None = None, tbt_spread: float = 1.0, tbt_tail: float = 1.0,
                 incoming_shortest: float = 0.0) -> None:
        self.instance_id, self.running, self.max_batch_size = instance_id, running, max_batch_size
        self.max_context_tokens, self.cost, self.incoming = max_context_tokens, cost, incoming
        self.tbt_s, self.tbt_spread, self.tbt_tail = tbt_s, tbt_spread, tbt_tail
        self.incoming_shortest = incoming_shortest


@dataclass(slots=True, unsafe_hash=True)
class ClusterState:
    """Snapshot of the live instances at decision time (dead ones already left out)."""

    prefills: tuple[PrefillInstanceState, ...] = ()
    decodes: tuple[DecodeInstanceState, ...] = ()
