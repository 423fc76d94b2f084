"""Continuous batching in aggregate steps.

Between two changes of batch membership every step of a batch costs the same (the step time
is computed from batch size and context at the segment start), so a run of K steps is one
log entry ``(gap, K)`` instead of K events. A segment ends at the step where the first running
request finishes, or earlier at the step boundary after a new request arrives. Context grows
by one token per request per step; only the step *time* ignores the growth inside a segment
(segments are short: a few seconds, tens of tokens on top of thousands).

With ``step_ratios`` (a live cluster's measured spread of step times around its model,
``Hardware.decode_step_ratios``) a step takes the model's time × their mean, and a finished
request's gaps are replayed step by step, each × one of the ratios drawn at random (seeded by
the request id, so a run repeats) over their mean: the same time in total, with the tail that
TBT — the slowest 10% of a request's gaps — measures live. Without them nothing changes.
With ``busy_ratios`` too (``Hardware.decode_busy_step_ratios``: the spread of steps run beside a
computing prefill) a step timed while one computed is drawn from those over their mean instead:
the co-location slowdown (``scale``) keeps the level beside a prefill, the busy spread gives its
shape, whose slow tail the idle one lacks. The log then keeps a flag per entry (``beside_log``).
With a delivery jitter (:meth:`Batch.deliver_with`: what the path from the decode to a client
adds to or takes from a gap, as ``bench fidelity`` measures it) each gap after a request's first
gets one drawn at random too (after the step draws, so those stay as they were): a token that
reaches the client late makes its gap longer and the next shorter, and TBT reads the longer.
"""

from __future__ import annotations

import heapq
import zlib

import numpy as np

from mooncake_lite.instance.colocation import padded_step
from mooncake_lite.scheduler.costs import DecodeCostModel
from mooncake_lite.sim.request import Segment, SimRequest, fold_gaps, fold_steady_gaps, slowest_share_mean



# Log entries appended between two trims of a batch's log.
LOG_TRIM_EVERY = 4096


class Batch:
    """The running requests of one decode engine and the log of its steps."""

    __slots__ = ("model", "running", "_heap", "_seq", "steps_done", "context_tokens", "log", "_log_base", "_trim_at",
                 "stalled", "step_ratios", "_step_scale", "_spread_mean", "padding", "busy_ratios", "_busy_mean",
                 "beside_log", "_beside", "_seg_beside", "delivery")

    def __init__(self, model: DecodeCostModel, step_ratios: tuple[float, ...] = (), padding: float = 0.0,
                 busy_ratios: tuple[float, ...] = ()) -> None:
        self.model = model
        self.padding = padding    # s per padding token: attention runs all to the longest context (Hardware)
        spread = len(set(step_ratios)) > 1      # a flat spread only scales the steps
        self.step_ratios = np.asarray(step_ratios, dtype=np.float64) if spread else None
        self._spread_mean = float(np.mean(step_ratios)) if step_ratios else 1.0
        self._step_scale = self._spread_mean     # × a co-location slowdown while it lasts (scale)
        # drawn like the idle spread, so only beside one (a flat idle spread draws nothing)
        self.busy_ratios = np.asarray(busy_ratios, dtype=np.float64) if busy_ratios and spread else None
        self._busy_mean = float(np.mean(busy_ratios)) if busy_ratios else 1.0
        # per log entry: timed while a prefill computed (only with busy_ratios; trimmed with the log)
        self.beside_log: list[bool] | None = [] if self.busy_ratios is not None else None
        self._beside = False        # a prefill computes now (scale)
        self._seg_beside = False    # one did when the running segment was timed
        self.running: dict[str, SimRequest] = {}
        self._heap: list[tuple[int, int, SimRequest]] = []
        self._seq = 0
        self.steps_done = 0
        self.context_tokens = 0
        self.log: list[Segment] = []
        # The log keeps only what running requests may still read: entries before the oldest
        # one's join are dropped now and then, and ``_log_base`` counts them (join_log is an
        # absolute position), so a long run's memory does not grow with its requests.
        self._log_base = 0
        self._trim_at = LOG_TRIM_EVERY
        self.stalled = False      # a stall was logged: requests' gaps are folded step by step
        self.delivery: np.ndarray | None = None    # a gap's delivery jitter, seconds (deliver_with)

    def deliver_with(self, jitter: tuple[float, ...]) -> None:
        """Each gap after a request's first, as its client sees it, moves by one of ``jitter``
        (seconds, equal-mass bins) drawn at random (module doc); empty: as the decode ends it."""
        self.delivery = np.asarray(jitter, dtype=np.float64) if jitter else None

    def add(self, req: SimRequest, now: float) -> None:
        """Join at a step boundary ``now``; the request needs its true output length − 1 more
        tokens (its first token came from prefill): the model's own stop, planned here."""
        req.join_step = self.steps_done
        req.join_log = self._log_base + len(self.log)
        first = req.first_token
        assert first is not None   # a request joins a batch after its prefill
        req.wait_extra = now - first
        req.join_time = now
        self.running[req.rid] = req
        self._seq += 1
        heapq.heappush(self._heap, (self.steps_done + req.tokens_to_generate() - 1, self._seq, req))
        self.context_tokens += req.input_length + 1

    def step_time(self) -> float:
        if self.padding and self.running:
            return padded_step(self.model, len(self.running), self.context_tokens, self._longest(),
                               self.padding) * self._step_scale
        return self.model.predict(len(self.running), self.context_tokens) * self._step_scale

    def _longest(self) -> int:
        """The longest running request's context now (prompt, its first token, one per step)."""
        return max(r.input_length + 1 + self.steps_done - r.join_step for r in self.running.values())

    def scale(self, factor: float, beside: bool = False) -> None:
        """Steps timed from now on take ``factor`` × the spread's mean × the model's time (a
        prefill computing on the same host, ``beside``: ``Hardware.decode_colocated_slowdown``).
        A running segment was timed before: it keeps its flag till it is logged (``advance``)."""
        self._step_scale = self._spread_mean * factor
        self._beside = beside
        if not self.running:
            self._seg_beside = beside

    def steps_to_next_finish(self) -> int:
        return self._heap[0][0] - self.steps_done

    def stall(self, seconds: float) -> None:
        """The engine did something else (a colocated prefill) for ``seconds``."""
        if self.running:
            self.log.append((seconds, 0))
            self.stalled = True
            if self.beside_log is not None:
                self.beside_log.append(False)    # no step: the flag is never read

    def advance(self, num_steps: int, gap: float) -> list[SimRequest]:
        """Run ``num_steps`` steps of ``gap`` seconds; return the requests that finished."""
        if num_steps <= 0:
            return []
        self.log.append((gap, num_steps))
        if self.beside_log is not None:
            self.beside_log.append(self._seg_beside)
            self._seg_beside = self._beside      # the next segment is timed now
        self.steps_done += num_steps
        self.context_tokens += num_steps * len(self.running)
        done: list[SimRequest] = []
        heap = self._heap
        end = len(self.log)
        stalled = self.stalled
        # then the wait is added to the drawn first step
        spread = self.step_ratios is not None or self.delivery is not None
        while heap and heap[0][0] <= self.steps_done:
            last, _, req = heapq.heappop(heap)
            del self.running[req.rid]
            self.context_tokens -= req.input_length + 1 + last - req.join_step   # prompt + every token
            # each fold called by name, not through a variable: a compiled build calls it natively
            if stalled:
                gaps = fold_gaps(self.log, req.join_log - self._log_base, end, 0.0 if spread else req.wait_extra)
            else:
                gaps = fold_steady_gaps(self.log, req.join_log - self._log_base, end, 0.0 if spread else req.wait_extra)
            # the log since its join counts every step since then (a stall counts none)
            req.num_gaps = self.steps_done - req.join_step
            if spread:
                self._replay_spread(req, gaps, req.join_log - self._log_base, end)
            else:
                req.tbt = slowest_share_mean(gaps, total=req.num_gaps)
                # the same floats summed in the same order as sum(starmap(mul, gaps)); a compiled
                # build builds the products natively instead of a C call per segment
                req.mean_gap = sum([gap * count for gap, count in gaps]) / req.num_gaps
            done.append(req)
        if end >= self._trim_at:
            self._trim_log()
        return done

    def _replay_spread(self, req: SimRequest, gaps: list[Segment], start: int, end: int) -> None:
        """``req``'s TBT and mean gap with each step's time drawn from the measured spread (module
        doc); ``gaps`` are its steps' (time, count) without the wait before its first, folded from
        log entries ``[start, end)``."""
        ratios = self.step_ratios
        times = np.repeat([g for g, _ in gaps], [c for _, c in gaps])
        rng = np.random.default_rng(zlib.crc32(str(req.rid).encode()))
        if ratios is not None:
            draws = ratios[rng.integers(len(ratios), size=len(times))] / self._spread_mean
            if self.beside_log is not None:
                draws = self._draw_beside(draws, rng, start, end)
            times = times * draws
        times[0] += req.wait_extra
        if self.delivery is not None:   # a client's gap is never negative
            jitter = self.delivery[rng.integers(len(self.delivery), size=len(times) - 1)]
            times[1:] = np.maximum(times[1:] + jitter, 0.0)
        steps = [(t, 1) for t in times.tolist()]
        req.tbt = slowest_share_mean(steps, total=len(steps))
        req.mean_gap = sum(t for t, _ in steps) / len(steps)

    def _draw_beside(self, draws: np.ndarray, rng: np.random.Generator, start: int, end: int) -> np.ndarray:
        """``draws`` with those of the steps timed beside a computing prefill drawn again from the
        busy spread over its mean (module doc); the others, drawn first, as without it."""
        busy, flags = self.busy_ratios, self.beside_log
        assert busy is not None and flags is not None   # only called with a busy spread
        # a fold keeps each entry's steps in order (a stall's seconds go to the next step)
        beside = np.repeat(flags[start:end], [c for _, c in self.log[start:end]])
        return np.where(beside, busy[rng.integers(len(busy), size=len(draws))] / self._busy_mean, draws)

    def _trim_log(self) -> None:
        oldest = min((r.join_log for r in self.running.values()), default=self._log_base + len(self.log))
        del self.log[:oldest - self._log_base]
        if self.beside_log is not None:
            del self.beside_log[:oldest - self._log_base]
        self._log_base = oldest
        self._trim_at = len(self.log) + LOG_TRIM_EVERY    # amortized: a scan per this many entries

    def __len__(self) -> int:
        return len(self.running)
