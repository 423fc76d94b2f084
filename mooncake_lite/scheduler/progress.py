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
how the later chunks of the instance's earlier jobs ran (:class:`LaterChunks`; docs/results/
2026-12-01-zen3-admission.md §3, §17). From two chunks on, the job's own ratio holds (×1.04).
"""

from __future__ import annotations

from collections import deque
from statistics import median

from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.scheduler.update_rule import CorrectionConfig, ratio_refusal

# How far the chunks done may move the price of the chunks left, either way: a first chunk slowed
# by a burst of decode steps beside it says little of the next seven.
RATIO_BOUND = 4.0
# The later chunks :class:`LaterChunks` keeps (the newest): its median turns within half of them.
LATER_WINDOW = 32


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
    """How the chunks after a job's first ran on one instance lately: its last
    :data:`LATER_WINDOW` later chunks, each a shape and its seconds, and :meth:`ratio` their median
    of seconds over the price the instance's model *as it stands* puts on that shape; None until
    one was kept. A broken timing is refused and kept out.

    Priced anew, not a factor learned against the model of the day: the model is the refiner's
    (``instance/refine.py``) and moves as the instance serves; on Zen 3 its first refinement put
    c0, c1 and c2 at 2.1-2.2x the profile's (short prompts beside a busy decode), and a moving
    average of log(seconds / price) learned before it priced a long job's rest ~2x long until
    bounded steps (≤ 16% a chunk) wore it off. In two runs the 2,724-token prompt running when
    the slice's fourth burst came was reported 9.2 and 11.6 s from its end, 6.4 s before it ended
    in each, and the burst's four short prompts were refused in both that would have met their
    SLOs. A median, not an average: the short tail chunk of a prompt just over a chunk is priced
    mostly by ``later_c0`` and runs at another ratio than the full chunks of a long job's rest.
    Replayed on every report of two live runs (docs/results/2026-12-01-zen3-admission.md §17):
    the rest after one chunk off by a median 0.24 s and p90 2.0 s (the moving average), 0.18 s
    and 0.36 s (this)."""

    __slots__ = ("_chunks", "_cfg")

    def __init__(self, cfg: CorrectionConfig | None = None, window: int = LATER_WINDOW) -> None:
        self._cfg = cfg or CorrectionConfig()
        self._chunks: deque[tuple[int, int, float]] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._chunks)

    def observe(self, model: PrefillCostModel, num_tokens: int, num_prefix_tokens: int, seconds: float) -> str | None:
        """A later chunk of tokens ``num_prefix_tokens`` to ``num_tokens`` ran ``seconds``;
        returns why it was refused against ``model``'s price of it (None: kept)."""
        why = ratio_refusal(model.chunk_after(num_tokens, num_prefix_tokens), seconds, self._cfg)
        if why is None:
            self._chunks.append((num_tokens, num_prefix_tokens, seconds))
        return why

    def ratio(self, model: PrefillCostModel) -> float | None:
        """The kept chunks' median of seconds over ``model``'s price of each (None: none kept,
        or ``model`` prices them all at nothing)."""
        ratios = [s / p for n, q, s in self._chunks if (p := model.chunk_after(n, q)) > 0.0]
        return median(ratios) if ratios else None
