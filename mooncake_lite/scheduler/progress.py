"""A started prefill job priced from its progress, not from the prediction made before it ran.

The conductor prices a started job as its predicted duration less the time it has run
(``estimate.queues_at``). Where the prediction was long, a job nearly done still shows seconds of
work: live on Zen 3, a 3,770-token prompt predicted at 5 s was 1.4 s from its end when the
conductor priced what was left at 6.4 s, and refused a burst of short prompts that would have met
their SLOs (docs/results/2026-12-01-zen3.md §7). An instance running a prompt chunk by chunk
knows better after its first chunk: :func:`seconds_left` is the model's price of the chunks left,
scaled by how the chunks done ran against the model's price of them (the speed of this prompt on
this machine now, colocated work included), within :data:`RATIO_BOUND` either way, less the time
the chunk in flight has run. The prefill reports it in its heartbeat (``RunningPrefill``), the
conductor's view prices the job to end then (``PrefillView.report_end``). Pure, no IO.

Except after the first chunk alone: that one runs beside the decode of the jobs just before it
(their first tokens, their KV taken in) and says little of the rest. Over the saved Zen 3 runs a
job's first chunk ran at its price (median ×1.02) and its second at ×0.75 of it; priced by the
first, the rest of 1,005 jobs was over by a median ×1.39 (0.42 s), and by ×1.0 (0.15 s) priced at
how the later chunks of the instance's earlier jobs ran (:class:`LaterChunks`: a bounded moving
average, ``correction.step``'s rule; docs/results/2026-12-01-zen3-admission.md §3). From two
chunks on, the job's own ratio holds (×1.04).
"""

from __future__ import annotations

import math

from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.scheduler.update_rule import CorrectionConfig, Factor, ratio_refusal, step

# How far the chunks done may move the price of the chunks left, either way: a first chunk slowed
# by a burst of decode steps beside it says little of the next seven.
RATIO_BOUND = 4.0


def seconds_left(model: PrefillCostModel, num_tokens: int, prefix_tokens: int, done_tokens: int,
                 done_s: float, in_flight_s: float, later: float | None = None) -> float:
    """Seconds until a prompt of ``num_tokens`` (``prefix_tokens`` cached) has computed its last
    chunk, ``done_tokens`` of its uncached tokens having taken ``done_s`` and the next chunk
    having run ``in_flight_s``; ``model`` prices chunk by chunk as the instance runs them
    (``PrefillCostModel.with_chunk``). ``later``: the ratio the chunks left are priced at instead
    of the done ones' (the caller's, after a first chunk alone: module doc). 0 once every token
    is computed."""
    start = prefix_tokens + done_tokens
    if start >= num_tokens:
        return 0.0
    priced_done = model.predict(start, prefix_tokens) if done_tokens > 0 else 0.0
    ratio = later if later is not None else done_s / priced_done if priced_done > 0.0 else 1.0
    ratio = min(max(ratio, 1.0 / RATIO_BOUND), RATIO_BOUND)
    # the chunks left are later ones (no request to take in, no prefix to load): the whole
    # prompt's price less the done chunks'
    return max((model.predict(num_tokens, prefix_tokens) - priced_done) * ratio - in_flight_s, 0.0)


class LaterChunks:
    """How the chunks after a job's first ran against their price on one instance lately: a
    moving average of log(measured / priced), its step bounded (``correction.step``, its default
    constants); None until one was observed. A broken timing is refused and moves nothing."""

    __slots__ = ("_factor", "_cfg")

    def __init__(self, cfg: CorrectionConfig | None = None) -> None:
        self._cfg = cfg or CorrectionConfig()
        self._factor: Factor | None = None

    @property
    def ratio(self) -> float | None:
        return None if self._factor is None else self._factor.value

    def observe(self, priced_s: float, measured_s: float) -> str | None:
        """One later chunk; returns why it was refused (None: applied)."""
        why = ratio_refusal(priced_s, measured_s, self._cfg)
        if why is not None:
            return why
        ratio, bound = measured_s / priced_s, math.log(self._cfg.max_factor)
        self._factor = Factor(min(bound, max(-bound, math.log(ratio))), 1) if self._factor is None \
            else step(self._factor, ratio, self._cfg)
        return None
