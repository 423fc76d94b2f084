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
    constants); None until one was observed. A broken timing is refused and moves nothing.

    The price is the instance's model as it stands, and the instance refines it from its forwards
    (``instance/refine.py``): :meth:`rebase` moves the factor the other way as the model moves, so
    a level both saw is counted once. Without it, a refinement that doubled the model (its first
    counting buckets short prompts beside a busy decode: c0, c1 and c2 all 2.1-2.2x in the first
    minute on Zen 3) left the factor at the old model's level, worn off only by bounded steps (at
    most 16% a later chunk), and the rest of a long job one chunk in was priced long: live, the
    2,724-token prompt running when the slice's fourth burst came was reported 9.2 and 11.6 s from
    its end, 6.4 and ~7 s before it ended, and the burst's four short prompts refused in each run
    would have met their SLOs (docs/results/2026-12-01-zen3-admission.md §17)."""

    __slots__ = ("_factor", "_cfg", "_shape")

    def __init__(self, cfg: CorrectionConfig | None = None) -> None:
        self._cfg = cfg or CorrectionConfig()
        self._factor: Factor | None = None
        self._shape: tuple[int, int] | None = None   # (tokens, prefix) of the chunk last learned from

    @property
    def ratio(self) -> float | None:
        return None if self._factor is None else self._factor.value

    def observe(self, priced_s: float, measured_s: float, shape: tuple[int, int] | None = None) -> str | None:
        """One later chunk, ``shape`` its (tokens, prefix) as ``chunk_after`` takes them (what
        :meth:`rebase` prices); returns why it was refused (None: applied)."""
        why = ratio_refusal(priced_s, measured_s, self._cfg)
        if why is not None:
            return why
        self._shape = shape or self._shape
        ratio, bound = measured_s / priced_s, math.log(self._cfg.max_factor)
        self._factor = Factor(min(bound, max(-bound, math.log(ratio))), 1) if self._factor is None \
            else step(self._factor, ratio, self._cfg)
        return None

    def rebase(self, old: PrefillCostModel, new: PrefillCostModel) -> None:
        """The instance now prices with ``new`` where it priced with ``old``: the factor moved by
        their ratio at the chunk it last learned from, so that chunk's price times the factor
        stays what it was (``Corrections.rebase``'s rule, on the instance's side)."""
        if self._factor is None or self._shape is None:
            return
        was, now = old.chunk_after(*self._shape), new.chunk_after(*self._shape)
        if not (0.0 < was < math.inf and 0.0 < now < math.inf):
            return
        bound = math.log(self._cfg.max_factor)
        moved = self._factor.log - math.log(now / was)
        self._factor = Factor(min(bound, max(-bound, moved)), self._factor.num_observed)
