"""What one request was predicted (:class:`Prediction`, at admission) and what was measured
(:class:`Check`, when it is settled): the values ``predictions.PredictionBook`` records, corrects
by and logs (issue #36)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Prediction:
    """What admission predicted for one placement (seconds), with the correction scales its
    prefill and decode models had (1: uncorrected)."""

    ttft_s: float
    tbt_s: float | None
    queue_s: float
    prefill_s: float
    transfer_s: float
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    # (prefill, decode): log of how far each instance's own model had moved by itself (refines)
    # since first seen; an observation is converted to the model current when it is settled
    bases: tuple[float, float] = (0.0, 0.0)
    # of ``queue_s``, the allowance for later arrivals passing it (shortest first), at the share
    # the instance was priced with; and that allowance's worst case (share 1; 0: none)
    overtake_s: float = 0.0
    overtake_full_s: float = 0.0
    # likewise for later arrivals joining its forward (queue_order.join_allowance; packing)
    join_s: float = 0.0
    join_full_s: float = 0.0
    decode_tail: float = 1.0   # ``tbt_s`` is the step × this (DecodeInstanceState.tbt_tail)
    busy: bool = False         # its prefill was priced beside a busy neighbour (show_node_states)
    prefill_offset: float = 0.0   # seconds its state's line added to each forward (correction.py)
    queue_scale: float = 1.0      # what its wait before any allowance was multiplied by (state.py)

    @property
    def step_s(self) -> float:
        """The decode step ``tbt_s`` was made of (0: no TBT predicted)."""
        return (self.tbt_s or 0.0) / self.decode_tail


@dataclass(frozen=True)
class Check:
    """One completed request: its prediction and what was measured (None: not measured)."""

    request_id: str
    prefill_id: str
    decode_id: str
    predicted: Prediction
    ttft_s: float
    tbt_s: float | None           # the paper's: the mean of its slowest 10% of token gaps
    mean_gap_s: float | None      # the mean token gap: what the decode model predicts (a step)
    queue_s: float | None         # the prefill's own report (PrefillResult.timings)
    compute_s: float | None
    transfer_s: float | None
    decode_busy: bool = False     # a prefill on the decode's node had work queued
    # (prompt tokens, prefix tokens, the forward's computed tokens and jobs: the prefill's report;
    # tokens 0: it ran alone, or did not say)
    forward: tuple[int, int, float, float] | None = None
    passed: float | None = None   # the later arrivals served before it (shortest first; None: not said)
    # CPU seconds the hypervisor took from the prefill's machine while its forwards ran (summed
    # over CPUs; None: not said): why a forward ran long on a shared VM (common/host.steal_seconds)
    steal_s: float | None = None
    # its process's threads' seconds on a CPU, and runnable waiting for one, while they ran
    # (common/host.thread_seconds; None: not said): with steal, where a slow forward's time went
    cpu_s: float | None = None
    runqueue_s: float | None = None

    def pairs(self) -> dict[str, tuple[float, float | None]]:
        """(predicted, measured) by metric."""
        p = self.predicted
        return {"ttft": (p.ttft_s, self.ttft_s), "tbt": (p.tbt_s or 0.0, self.tbt_s),
                "gap": (p.step_s, self.mean_gap_s),
                "queue": (p.queue_s, self.queue_s), "compute": (p.prefill_s, self.compute_s),
                "transfer": (p.transfer_s, self.transfer_s)}

    def ratios(self) -> dict[str, float]:
        """measured / predicted by metric, where both are positive finite numbers."""
        return {m: measured / predicted for m, (predicted, measured) in self.pairs().items()
                if positive(predicted) and positive(measured)}

    def attributes(self) -> dict[str, Any]:
        """The request span's attributes: each prediction, its measurement and their ratio."""
        out: dict[str, Any] = {}
        ratios = self.ratios()
        for metric, (predicted, measured) in self.pairs().items():
            out[f"predicted_{metric}_s"] = predicted
            out[f"measured_{metric}_s"] = measured
            out[f"{metric}_ratio"] = ratios.get(metric)
        out["prefill_node"] = _state(self.predicted.busy)
        out.update(measured_steal_s=self.steal_s, measured_cpu_s=self.cpu_s, measured_runqueue_s=self.runqueue_s)
        return out

    def describe(self) -> str:
        """The log line's text."""
        def one(name: str) -> str:
            predicted, measured = self.pairs()[name]
            ratio = self.ratios().get(name)
            return (f"{name} {predicted:.3g}s→{measured:.3g}s (x{ratio:.2f})" if ratio is not None
                    else f"{name} {predicted:.3g}s→{measured}")
        host = ", ".join(f"{name} {v:.3g}s" for name, v in (("host steal", self.steal_s), ("on CPU", self.cpu_s),
                                                             ("run queue", self.runqueue_s)) if v is not None)
        stolen = f" ({host})" if host else ""
        return ("predicted→measured: " + ", ".join(one(m) + (stolen if m == "compute" else "")
                                                   for m in ("ttft", "queue", "compute", "transfer", "tbt", "gap"))
                + f" on {self.prefill_id} ({_state(self.predicted.busy)})+{self.decode_id}")


def _state(busy: bool) -> str:
    return "busy" if busy else "idle"


def reported_seconds(x: object) -> float | None:
    """``x`` where it is a finite, non-negative number of seconds (a prefill's report), else None."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 else None


def positive(x: float | None) -> bool:
    """Whether ``x`` is a positive finite number (a ratio can be taken of it)."""
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0
