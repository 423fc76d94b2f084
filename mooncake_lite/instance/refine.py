"""Keeping an instance's cost model current from the work it actually runs.

The start-up profile (``profile.py``) is a handful of timings taken once: a CPU that happens to
be busy then makes it several times too pessimistic, and nothing would ever correct it (issue
#15: an idle cluster answered every request 429 until restarted). A refiner takes every
measurement the instance makes while serving — prefill: each chunk's seconds against its new
tokens and the context before it; decode: each step's seconds against the batch size and its
total context — and fits the same cost model to them, robust to outliers:

* measurements fall into buckets by shape (the power of two of each feature); a bucket keeps
  its last ``WINDOW`` samples and speaks through their median, so a step stalled by a busy
  neighbour or a GC pause moves nothing, while a lasting change turns the median within
  ``WINDOW / 2`` samples;
* a bucket counts once it holds ``MIN_SAMPLES``; every counting bucket is one point of the fit,
  so a flood of one shape does not drown the others;
* shapes nobody has run yet keep the start-up profile's *shape*, scaled by the ratio of measured
  to predicted at the counting bucket nearest them (a busy CPU at start-up gets the level wrong,
  not the shape): those prior points join the fit, so a model measured only on short prompts
  still extrapolates to long ones. Nearest, not all buckets' median: the profile times the bare
  model, while a served forward also hands each layer to the event loop, stages and sends its KV
  and samples, which weighs most on a short prompt. At the level the many long buckets set, the
  profile's short shapes (no prefix; the trace's prompts all had one cached) outvoted the few
  measured: replayed on four live runs (issue #36), forwards under 128 new tokens measured
  1.4-1.8x the fit, at the nearest bucket's level 1.1-1.2x;
* the fit is least squares in relative error with every coefficient >= 0 (``relative_fit``);
  with fewer shapes than coefficients it is the start-up model scaled by the median ratio
  measured / predicted over the counting buckets;
* the model speaks for a bucket's median, but a step's time scatters around it (a busy
  neighbour, a GC pause, KV writes queued in the model thread) and TBT, the mean of a request's
  slowest 10% of gaps, feels exactly that tail: :meth:`Refiner.ratio_quantiles` says how the
  newest samples (each step once, not a bucket's window) spread around the current model (each one's seconds over its prediction), which
  a decode reports beside its model for the simulator to replay (``sim/batch.py``);
* a prefill's chunk after a prompt's first is a shape of its own (its bucket and its row): it
  neither takes the request in nor loads the prefix, and it runs beside a quieter decode than the
  first, which runs beside the first tokens and KV intake of the jobs just before it. One formula
  for both, on Zen 3, priced a prompt's second chunk 1.33x what it took and its first at its time
  (docs/results/2026-12-01-zen3-admission.md §3), and over three live runs the conductor priced
  forwards over 8 s 1.18x long and those of 1-2 s 0.93x: the later chunks have their own fixed
  cost (``later_c0``) and carry no load (``c3``), fitted together with the first's
  (docs/results/2026-12-01-zen3-admission.md §12);
* the model :meth:`Refiner.current` returns changes only when the new fit moves a prediction
  at some counting bucket by more than ``REPORT_TOLERANCE``: the conductor re-derives an
  instance's estimates whenever its model changes (its caches key on the model object), so
  noise must not change it at every heartbeat.

Pure: no clock, no IO, no torch. The roles feed it timings and read :meth:`Refiner.current`
for each heartbeat.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from statistics import median

import numpy as np

from mooncake_lite.common.cost_report import CostReport, DecodeCost, PrefillCost
from mooncake_lite.scheduler.costs import DecodeCostModel, PrefillCostModel

WINDOW = 32              # samples a bucket keeps (the newest)
MIN_SAMPLES = 5          # a bucket counts from this many: its median outvotes 2 outliers
REPORT_TOLERANCE = 0.10  # a new model is reported once it moves some prediction by more
# Equal-mass midpoints: a draw of one of them at random follows the measured spread.
RATIO_QUANTILES = tuple((2 * i + 1) / 20 for i in range(10))
MIN_RATIO_SAMPLES = 20   # fewer samples say little about a tail
RATIO_WINDOW = 512       # the newest samples, every one once, that the spread is read from
# Their names in a decode's load (``InstanceLoad``'s step_ratio_q* fields, in this order).
STEP_RATIO_PREFIX = "step_ratio_q"
STEP_RATIO_KEYS = tuple(f"{STEP_RATIO_PREFIX}{round(q * 100):02d}" for q in RATIO_QUANTILES)

Model = PrefillCostModel | DecodeCostModel
Sample = tuple[int, int, float, int]     # (x, y, seconds, kind): Refiner's doc
LATER = 1                                # a prefill chunk's kind after a prompt's first


def cost_report(model: Model | None) -> CostReport | None:
    """What an instance says of its ``model`` (``Register.cost``, ``Heartbeat.cost``): the
    nested form, under its role (None: it has none)."""
    if model is None:
        return None
    if isinstance(model, PrefillCostModel):
        return CostReport(prefill=PrefillCost(**model.to_dict()))
    return CostReport(decode=DecodeCost(**model.to_dict()))


def nonneg_fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (a negative per-token cost fitted to noisy
    timings would make the conductor predict nonsense): drop the most negative term and refit."""
    a, b = np.asarray(rows, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active] / scale[active], b, rcond=None)
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


def relative_fit(rows: list[list[float]], seconds: list[float]) -> list[float]:
    """:func:`nonneg_fit` in relative error: each row and its target divided by its own seconds
    (positive), so every timing weighs alike whatever its length."""
    return nonneg_fit([[v / t for v in row] for row, t in zip(rows, seconds)], [1.0] * len(seconds))


def _seconds(sample: Sample) -> float:
    return sample[2]


def _nearest_ratio(level: list[tuple[tuple[int, ...], float]], key: tuple[int, ...]) -> float:
    """Of ``(bucket, ratio)`` pairs, the median ratio of the buckets nearest ``key``: by the first
    feature's power of two (a prefill's new tokens, a decode's batch), then by the second's."""
    def far(bucket: tuple[int, ...]) -> tuple[int, int]:
        return abs(bucket[0] - key[0]), abs(bucket[1] - key[1])
    nearest = min(far(b) for b, _ in level)
    return median(r for b, r in level if far(b) == nearest)


class Refiner:
    """Recent measurements of one cost model, bucketed by shape (module doc). A measurement
    is ``(x, y, seconds, kind)`` in the model's own terms: prefill ``(num_tokens,
    num_prefix_tokens)``, decode ``(batch_size, context_tokens)``; ``kind`` 0, or a prefill's
    ``LATER`` chunk. Subclasses say how a shape becomes a fit row and a prediction."""

    MODEL: type[Model]

    def __init__(self, prior: Model | None, prior_points: Sequence[tuple[int, int]] = (),
                 window: int = WINDOW, min_samples: int = MIN_SAMPLES,
                 tolerance: float = REPORT_TOLERANCE) -> None:
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples} and {window}")
        self.prior = prior
        self.prior_points = tuple(p for p in prior_points if self._valid(*p))
        self.window, self.min_samples, self.tolerance = window, min_samples, tolerance
        self._buckets: dict[tuple[int, ...], deque[Sample]] = {}
        self._published: Model | None = prior
        self._num_new = 0        # samples since the last fit
        self.num_samples = 0
        # The buckets keep each shape's newest, so a rare shape weighs as much as a common one:
        # the spread is read from the newest steps in the order they ran instead.
        self._recent: deque[Sample] = deque(maxlen=RATIO_WINDOW)

    # ---- what subclasses define -----------------------------------------------------------
    @staticmethod
    def _valid(x: int, y: int) -> bool:
        raise NotImplementedError

    @staticmethod
    def _bucket(x: int, y: int, kind: int = 0) -> tuple[int, ...]:
        raise NotImplementedError

    @staticmethod
    def _row(x: int, y: int, kind: int = 0) -> list[float]:
        raise NotImplementedError

    @staticmethod
    def _predict(model: Model, x: int, y: int, kind: int = 0) -> float:
        return model.predict(x, y)

    # ---- feeding and reading --------------------------------------------------------------
    def observe(self, x: int, y: int, seconds: float, kind: int = 0) -> None:
        """One measurement; nonsense (non-positive, non-finite) is ignored."""
        if not self._valid(x, y) or not (math.isfinite(seconds) and seconds > 0):
            return
        key = self._bucket(x, y, kind)
        samples = self._buckets.get(key)
        if samples is None:
            samples = self._buckets[key] = deque(maxlen=self.window)
        sample = (x, y, seconds, kind)
        samples.append(sample)
        self._recent.append(sample)
        self._num_new += 1
        self.num_samples += 1

    def current(self) -> Model | None:
        """The model to report: the prior (None without one) until measurements move it by
        more than the tolerance; the same object while nothing does."""
        if self._num_new:
            self._num_new = 0
            points = self.points()
            fitted = self._fit(points)
            if fitted is not None and self._moved(fitted, points):
                self._published = fitted
        return self._published

    def points(self) -> list[Sample]:
        """Each counting bucket's median sample ``(x, y, seconds, kind)`` (by time; a real sample,
        so its shape and time belong together)."""
        return [sorted(samples, key=_seconds)[len(samples) // 2] for samples in self._buckets.values()
                if len(samples) >= self.min_samples]

    def ratio_quantiles(self, quantiles: Sequence[float] = RATIO_QUANTILES,
                        min_samples: int = MIN_RATIO_SAMPLES) -> list[float] | None:
        """Quantiles of measured / predicted seconds over the newest ``RATIO_WINDOW`` samples
        (by the model last reported); None before ``min_samples`` of them or without a model."""
        model = self._published
        if model is None:
            return None
        ratios = [t / p for x, y, t, k in self._recent if (p := self._predict(model, x, y, k)) > 0]
        if len(ratios) < min_samples:
            return None
        return [float(v) for v in np.quantile(ratios, quantiles)]

    # ---- fitting --------------------------------------------------------------------------
    def _fit(self, points: list[Sample]) -> Model | None:
        if not points:
            return None
        pts = points + self._prior_points(points)
        width = self._width(pts)
        if len(pts) < width:      # too few shapes to fit every coefficient
            return self._scaled_prior(points)
        # Relative error, so a 2 ms step weighs as much as a 2 s prefill.
        coef = relative_fit([self._row(x, y, k)[:width] for x, y, _, k in pts], [t for _, _, t, _ in pts])
        if not all(math.isfinite(c) for c in coef) or not any(coef):
            return None
        return self._carried(self.MODEL(*coef))

    def _carried(self, model: Model) -> Model:
        """``model`` with what the prior has that the work run cannot refit (a subclass's)."""
        return model

    def _width(self, points: list[Sample]) -> int:
        """The coefficients ``points`` can fit (all of a row's, unless a subclass says fewer)."""
        return len(self._row(1, 0))

    def _scaled_prior(self, points: list[Sample]) -> Model | None:
        scale = self._scale(points)
        if scale is None:
            return None
        return self.MODEL(**{k: scale * c for k, c in self.prior.to_dict().items()})

    def _scale(self, points: list[Sample]) -> float | None:
        """The median ratio measured / predicted by the prior (None: nothing to compare)."""
        if self.prior is None:
            return None
        ratios = [t / p for x, y, t, k in points if (p := self._predict(self.prior, x, y, k)) > 0]
        return median(ratios) if ratios else None

    def _prior_points(self, points: list[Sample]) -> list[Sample]:
        """The prior's shapes no counting bucket covers, each at the prior's prediction scaled by
        the measured/predicted ratio of the counting buckets nearest it (module doc)."""
        if self.prior is None:
            return []
        level = [(self._bucket(x, y, k), t / p) for x, y, t, k in points
                 if (p := self._predict(self.prior, x, y, k)) > 0]
        covered = {self._bucket(x, y, k) for x, y, _, k in points}
        out = []
        for x, y in self.prior_points:
            key = self._bucket(x, y)
            if key in covered or not level:
                continue
            t = _nearest_ratio(level, key) * self.prior.predict(x, y)
            if t > 0:
                out.append((x, y, t, 0))
        return out

    def _moved(self, fitted: Model, points: list[Sample]) -> bool:
        old = self._published
        if old is None:
            return True
        for x, y, _, k in points:
            before, after = self._predict(old, x, y, k), self._predict(fitted, x, y, k)
            if abs(after - before) > self.tolerance * max(before, 1e-12):
                return True
        return False


class PrefillRefiner(Refiner):
    """``PrefillCostModel`` from ``(num_tokens, num_prefix_tokens, seconds)``: a chunk of
    ``num_tokens - num_prefix_tokens`` new tokens computed on top of ``num_prefix_tokens``, a
    prompt's first (its prefix loaded) or a ``LATER`` one (module doc): the row's coefficients
    are the model's fields in order, ``later_c0`` last, fitted once a later chunk's bucket counts."""

    MODEL = PrefillCostModel

    @staticmethod
    def _valid(x: int, y: int) -> bool:
        return 0 <= y < x

    @staticmethod
    def _bucket(x: int, y: int, kind: int = 0) -> tuple[int, ...]:
        return (x - y).bit_length(), y.bit_length(), kind

    @staticmethod
    def _row(x: int, y: int, kind: int = 0) -> list[float]:
        n = x - y
        return [0.0, n, n * x, 0.0, 1.0] if kind == LATER else [1.0, n, n * x, y, 0.0]

    @staticmethod
    def _predict(model: Model, x: int, y: int, kind: int = 0) -> float:
        return model.chunk_after(x, y) if kind == LATER else model.predict(x, y)   # type: ignore[union-attr]

    def _width(self, points: list[Sample]) -> int:
        return 5 if any(k == LATER for *_, k in points) else 4    # no later chunk: later_c0 is c0

    def _carried(self, model: Model) -> Model:
        # a pack's member cost was timed at start-up; the chunks refined from run one prompt each
        member = getattr(self.prior, "member_c0", None)
        return model if member is None else dataclasses.replace(model, member_c0=member)


class DecodeRefiner(Refiner):
    """``DecodeCostModel`` from ``(batch_size, context_tokens, seconds)`` of each step."""

    MODEL = DecodeCostModel

    @staticmethod
    def _valid(x: int, y: int) -> bool:
        return x > 0 and y >= x

    @staticmethod
    def _bucket(x: int, y: int, kind: int = 0) -> tuple[int, ...]:
        return x.bit_length(), y.bit_length()

    @staticmethod
    def _row(x: int, y: int, kind: int = 0) -> list[float]:
        return [1.0, x, y]
