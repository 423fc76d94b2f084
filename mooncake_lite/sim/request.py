"""A simulated request's life and the per-request figures that come out of it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mooncake_lite.trace.format import TraceRequest

Segment = tuple[float, int]   # (gap seconds, number of gaps); count 0 marks a stall (see fold_gaps)


class SimRequest:
    """Mutable state of one request while it moves through the simulated cluster."""

    __slots__ = ("trace", "rid", "arrival", "keys", "prefill_id", "decode_id", "reused_tokens",
                 "predicted_ttft", "prefill_start", "first_token", "finish", "status",
                 "reject_stage", "reject_cause", "join_step", "join_log", "wait_extra", "tbt",
                 "mean_gap", "ready_at", "planned_prefix_tokens", "num_gaps", "join_time", "prefilled", "fetched_blocks")

    def __init__(self, trace: TraceRequest, block_size: int) -> None:
        self.trace = trace
        self.rid = str(trace.request_id)
        self.arrival = trace.arrival_s
        # Only full blocks have keys (a partial tail block can still grow), as in the live system.
        self.keys = trace.hash_ids[: trace.input_length // block_size]
        self.prefill_id: str | None = None
        self.decode_id: str | None = None
        self.reused_tokens = 0
        self.planned_prefix_tokens = 0
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

    @property
    def input_length(self) -> int:
        return self.trace.input_length

    @property
    def output_length(self) -> int:
        return self.trace.output_length


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


def slowest_share_mean(segments: list[Segment], share: float = 0.1) -> float | None:
    """FAST'25 TBT: the mean of the slowest ``share`` of a request's token gaps (at least one)."""
    total = sum(c for _, c in segments)
    if total == 0:
        return None
    want = max(1, math.ceil(share * total))
    acc = 0.0
    left = want
    for gap, count in sorted(segments, reverse=True):
        take = min(count, left)
        acc += gap * take
        left -= take
        if left == 0:
            break
    return acc / want


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request ended as. Times in seconds from the trace start."""

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
        return cls(r.trace.request_id, r.arrival, r.input_length, r.output_length, r.status or "lost",
                   r.reject_stage, r.reject_cause, r.prefill_id, r.decode_id, r.reused_tokens,
                   None if r.first_token is None or r.status != "completed" else r.first_token - r.arrival,
                   r.tbt, r.mean_gap, r.finish)
