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
"""

from __future__ import annotations

from mooncake_lite.scheduler.costs import PrefillCostModel

# How far the chunks done may move the price of the chunks left, either way: a first chunk slowed
# by a burst of decode steps beside it says little of the next seven.
RATIO_BOUND = 4.0


def seconds_left(model: PrefillCostModel, num_tokens: int, prefix_tokens: int, done_tokens: int,
                 done_s: float, in_flight_s: float) -> float:
    """Seconds until a prompt of ``num_tokens`` (``prefix_tokens`` cached) has computed its last
    chunk, ``done_tokens`` of its uncached tokens having taken ``done_s`` and the next chunk
    having run ``in_flight_s``; ``model`` prices chunk by chunk as the instance runs them
    (``PrefillCostModel.with_chunk``). 0 once every token is computed."""
    start = prefix_tokens + done_tokens
    if start >= num_tokens:
        return 0.0
    priced_done = model.predict(start, prefix_tokens) if done_tokens > 0 else 0.0
    ratio = done_s / priced_done if priced_done > 0.0 else 1.0
    ratio = min(max(ratio, 1.0 / RATIO_BOUND), RATIO_BOUND)
    return max(model.predict(num_tokens, start) * ratio - in_flight_s, 0.0)
