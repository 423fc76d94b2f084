"""A simulated request's life and the per-request figures that come out of it.

No oracle: a request's true output length (the trace's ``output_length``) is what the simulated
*model* will generate, and only the model reads it (:meth:`SimRequest.tokens_to_generate`, to
plan the step of the last token). The conductor and the decode instances see what their live
counterparts see: ``max_tokens``, which the client sends by a :class:`MaxTokensPolicy`, and a
prediction (``expected_output``). ``output_length`` itself raises until the request has ended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from mooncake_lite.common.tbt import paper_tbt_of_runs, slowest_count
from mooncake_lite.sim.oracle import OracleError   # re-exported: raised here, caught by tests
from mooncake_lite.trace.format import TraceRequest

Segment = tuple[float, int]   # (gap seconds, number of gaps); count 0 marks a stall (see fold_gaps)
_COUNT = itemgetter(1)
_GAP = itemgetter(0)


@dataclass(frozen=True)
class MaxTokensPolicy:
    """What a client sends as ``max_tokens`` for a trace request (a Mooncake trace has none):
    ``output`` — the true output length (what replay clients send by default; it hides the
    problem: the scheduler then knows every output length), or ``cap:N`` — the fixed cap N, as
    chat clients often send (outputs longer than N stop at N, as a live decode stops them)."""

    cap: int | None = None    # None: the output length itself

    @classmethod
    def parse(cls, text: str) -> MaxTokensPolicy:
        if text == "output":
            return cls()
        name, _, value = text.partition(":")
        if name == "cap" and value.isdigit() and int(value) >= 1:
            return cls(int(value))
        raise ValueError(f"max-tokens policy must be 'output' or 'cap:N' (N >= 1), got {text!r}")

    def max_tokens(self, output_length: int) -> int:
        return output_length if self.cap is None else self.cap

    def __str__(self) -> str:
        return "output" if self.cap is None else f"cap:{self.cap}"


class SimRequest:
    """Mutable state of one request while it moves through the simulated cluster."""

    __slots__ = ("request_id", "input_length", "_output", "max_tokens", "expected_output", "rid", "arrival", "keys",
                 "prefill_id", "decode_id", "reused_tokens", "predicted_ttft", "prefill_start", "first_token",
                 "finish", "status", "reject_stage", "reject_cause", "join_step", "join_log", "wait_extra", "tbt",
                 "mean_gap", "ready_at", "planned_prefix_tokens", "num_gaps", "join_time", "prefilled", "fetched_blocks",
                 "pack_cap", "placed_busy")

    def __init__(self, trace: TraceRequest, block_size: int) -> None:
        self.request_id = trace.request_id
        self.rid = str(trace.request_id)
        self.input_length = trace.input_length   # read ~17 times per request: a plain attribute
        self._output = trace.output_length
        self.max_tokens = trace.output_length    # the ``output`` policy until send_with says otherwise
        self.expected_output = self.max_tokens   # what the conductor sizes t_d with (a predictor may lower it)
        self.arrival = trace.arrival_s
        # Only full blocks have keys (a partial tail block can still grow), as in the live system.
        self.keys = trace.hash_ids[: trace.input_length // block_size]
        self.prefill_id: str | None = None
        self.decode_id: str | None = None
        self.reused_tokens = 0
        self.planned_prefix_tokens = 0
        self.pack_cap = 0                        # the decision's cap on its packed forward (QueuedPrefill)
        self.placed_busy = False                 # its node's state when placed (MooncakeSim._placed_busy)
        self.predicted_ttft: float | None = None
        self.prefill_start: float | None = None
        self.ready_at = 0.0
        self.first_token: float | None = None
        self.finish: float | None = None
        self.status: str | None = None           # "completed" | "rejected" once ended
        self.reject_stage: str | None = None     # "conductor" | "prefill" | "decode"
        self.reject_cause: str | None = None
        self.join_step = 0
        self.join_log = 0
        self.wait_extra = 0.0
        self.tbt: float | None = None
        self.mean_gap: float | None = None
        self.num_gaps = 0
        self.join_time = 0.0
        self.prefilled = 0        # prompt tokens already computed (colocated chunked prefill)
        self.fetched_blocks = 0   # leading blocks a migration brings into the prefill's store

    def send_with(self, policy: MaxTokensPolicy) -> None:
        """The client sends the request with ``policy``'s max_tokens (once, at arrival, on a
        request built with the default ``output`` policy)."""
        self.max_tokens = self.expected_output = policy.max_tokens(self._output)
        self._output = min(self._output, self.max_tokens)

    def tokens_to_generate(self) -> int:
        """The true output length: what the simulated model will generate before it stops. Only
        the model reads it, to plan the step that ends the request (tests/sim audit that)."""
        return self._output

    @property
    def output_length(self) -> int:
        """The true output length, known to everyone once the request has ended."""
        if self.status is None:
            raise OracleError(f"request {self.rid}: its true output length was read before it ended")
        return self._output


def fold_gaps(log: list[Segment], start: int, end: int, wait_extra: float) -> list[Segment]:
    """The gaps one request saw, from a batch's segment log entries ``[start, end)``.

    A count-0 entry is a stall (a colocated prefill) that lengthens the *next* gap; the
    request's first decode gap also includes ``wait_extra`` (KV arrival and waiting for the
    step boundary after its first token)."""
    out: list[Segment] = []
    pending = wait_extra
    for gap, count in log[start:end]:
        if count == 0:
            pending += gap
            continue
        if pending:
            out.append((gap + pending, 1))
            if count > 1:
                out.append((gap, count - 1))
            pending = 0.0
        else:
            out.append((gap, count))
    return out


def fold_steady_gaps(log: list[Segment], start: int, end: int, wait_extra: float) -> list[Segment]:
    """:func:`fold_gaps` of a log with no stall in it (a disaggregated decode's: its engine does
    nothing else): the entries as they are, the first gap lengthened by ``wait_extra`` — list
    slices instead of a Python step per entry, the same list."""
    if not wait_extra or start >= end:
        return log[start:end]
    gap, count = log[start]
    head = [(gap + wait_extra, 1), (gap, count - 1)] if count > 1 else [(gap + wait_extra, 1)]
    return head + log[start + 1:end]


def slowest_share_mean(segments: list[Segment], total: int | None = None) -> float | None:
    """FAST'25 TBT of a request's folded gaps (``common/tbt.py``, the live definition).
    ``total``: their number, if the caller has it.

    The same float as :func:`paper_tbt_of_runs`, faster (it runs once per finished request, on
    ~30 segments): the segments are sorted by gap alone (float keys compare faster than tuples).
    That order differs from the definition's (gap, then count, descending) only between equal
    gaps, so where a gap it reads equals the one before or the next one, the definition decides."""
    num_gaps = sum(map(_COUNT, segments)) if total is None else total
    if num_gaps == 0:
        return None
    want = left = slowest_count(num_gaps)
    acc = 0.0
    ordered = sorted(segments, key=_GAP, reverse=True)
    last = math.nan   # equal to no gap, as None was: a float, so compiled code compares natively
    for i, (gap, count) in enumerate(ordered):
        if gap == last:
            return paper_tbt_of_runs(segments, num_gaps)
        last = gap
        take = count if count < left else left
        acc += gap * take
        left -= take
        if left == 0:
            if i + 1 < len(ordered) and ordered[i + 1][0] == gap:
                return paper_tbt_of_runs(segments, num_gaps)
            break
    return acc / want


class RequestResult(NamedTuple):
    """What one request ended as. Times in seconds from the trace start. (Immutable; a
    NamedTuple rather than a frozen dataclass, as ``scheduler.Decision``: one is built per
    request, and a frozen dataclass sets its 14 fields one ``object.__setattr__`` at a time.)"""

    request_id: int
    arrival: float
    input_length: int
    output_length: int
    status: str
    reject_stage: str | None
    reject_cause: str | None
    prefill_id: str | None
    decode_id: str | None
    reused_tokens: int
    ttft: float | None
    tbt: float | None
    mean_gap: float | None
    finish: float | None

    @classmethod
    def of(cls, r: SimRequest) -> RequestResult:
        return tuple.__new__(cls, (r.request_id, r.arrival, r.input_length, r.output_length, r.status or "lost",
                                 r.reject_stage, r.reject_cause, r.prefill_id, r.decode_id, r.reused_tokens,
                                 None if r.first_token is None or r.status != "completed" else r.first_token - r.arrival,
                                 r.tbt, r.mean_gap, r.finish))   # all 14 fields: without the NamedTuple's Python frame
