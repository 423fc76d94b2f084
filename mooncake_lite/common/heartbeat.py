"""What an instance's heartbeat tells the conductor: its load now, the cost models it refined, a
prefill's job in progress. Messages like ``protocol.py``'s, decoded there (``loads``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake_lite.common.cost_report import CostReport, FlatCost

MAX_LEFT_S = 86400.0       # the longest RunningPrefill.left_s: a day of one prompt's chunks
MAX_ID_CHARS = 256         # the longest RunningPrefill.request_id (the conductor's ids are far shorter)

Figure = float | None   # a figure of a load: None when the instance does not report it


@dataclass(frozen=True)
class InstanceLoad:
    """What a heartbeat says of an instance's load now. Each role fills its own fields; one it
    does not report is None, and left out on the wire."""
    # prefill: seconds of queued work by its cost model, queued requests and their tokens
    queued_s: Figure = None
    num_queued: Figure = None
    queued_tokens: Figure = None
    free_blocks: Figure = None      # both roles: free blocks of the paged KV cache
    # decode: its batch, the requests waiting for KV, their context, and what it can hold
    num_running: Figure = None
    num_waiting: Figure = None
    context_tokens: Figure = None
    max_context_tokens: Figure = None
    max_batch_size: Figure = None
    predicted_tbt_s: Figure = None
    bandwidth_bytes_per_s: Figure = None   # measured inbound KV rate, where measured
    # decode: the spread of its step times around its cost model, as deciles (instance/refine.py)
    step_ratio_q05: Figure = None
    step_ratio_q15: Figure = None
    step_ratio_q25: Figure = None
    step_ratio_q35: Figure = None
    step_ratio_q45: Figure = None
    step_ratio_q55: Figure = None
    step_ratio_q65: Figure = None
    step_ratio_q75: Figure = None
    step_ratio_q85: Figure = None
    step_ratio_q95: Figure = None

    def reported(self) -> dict[str, float]:
        """The fields the instance reported, by name (its wire form)."""
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @property
    def step_ratios(self) -> tuple[float, ...]:
        """The reported step-time deciles, in quantile order (empty: none reported)."""
        return tuple(v for k, v in self.__dict__.items() if k.startswith("step_ratio_q") and v is not None)


@dataclass(frozen=True)
class RunningPrefill:
    """A prefill's report of the job it runs alone, chunk by chunk: seconds left by the chunks
    done so far (``prefill/progress.py``). The conductor prices that job to end then
    (``PrefillView.report_end``), not at its predicted duration less the time it has run."""
    request_id: str
    left_s: float

    def __post_init__(self) -> None:
        if not 0 < len(self.request_id) <= MAX_ID_CHARS:
            raise ValueError(f"request_id must have 1 to {MAX_ID_CHARS} characters")
        if not 0.0 <= self.left_s <= MAX_LEFT_S:     # (NaN fails both)
            raise ValueError(f"left_s must be within [0, {MAX_LEFT_S:g}] seconds, got {self.left_s}")


@dataclass(frozen=True)
class Heartbeat:
    instance_id: str
    load: InstanceLoad = field(default_factory=InstanceLoad)
    # The instance's current cost models, refined from the work it ran (FlatCost: an older
    # instance's, read with its registered role); None or absent: unchanged since the last report.
    cost: CostReport | FlatCost | None = None
    # A prefill's chunked job in progress (None, left off the wire: none, or not a prefill).
    running: RunningPrefill | None = None
