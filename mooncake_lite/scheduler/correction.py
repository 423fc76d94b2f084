"""Online correction of the cost models from measured residuals (issue #36), per instance and per term.

An instance's cost model is a profile fitted once (and refined by the instance from its own
forwards); what a request really meets also holds what no profile sees: the queue as it really
drains, other processes on the machine, a CPU limit set after start-up, the roles sharing cores.
Each finished request gives, per term, a *ratio*: what was measured over what the **uncorrected**
model predicted. Terms (``TERMS``): ``queue`` (the wait in the prefill's queue, over what the
corrected compute speed explains: per-job work a forward's profile misses), ``compute`` (its
own prefill, no decode computing on its node), ``interference`` (its prefill beside a busy decode,
over ``compute``), ``transfer`` (a prefix fetched between stores: shown, not applied here, since
the scheduler corrects each store pair's speed itself, ``links.py``), ``decode`` (the request's mean
token gap, no prefill computing on the decode's node: what the decode model predicts, a step),
``decode_interference`` (the reverse) and ``tail`` (the request's TBT as the paper defines it, the
mean of its slowest tenth of gaps, over its mean gap: both measured, no model's). ``tail`` scales
no model: it turns the step foreseen into the TBT predicted (``DecodeInstanceState.tbt_tail``;
admission still judges the step, ``scheduler._decision``). Without it the TBT shown was a step,
which the TBT measured exceeded on nearly every request (docs/results/2026-11-29-decode-load.md).

The update rule, one for every term (:func:`step`): a moving average of ``log(ratio)`` with
weight ``alpha``, its change per observation bounded by ``max_step`` and the factor kept within
``[1/max_factor, max_factor]``. Working in logs makes a factor of 2 and of 1/2 equally far from 1
and a product of terms a sum. The bounds make it safe to feed: one absurd measurement moves a
factor by at most ``max_step`` (about 16%), so it cannot run away, and a ratio outside
``[1/max_ratio, max_ratio]``, or not a finite positive number, is refused and moves nothing.
None of these constants describes a machine: they say how fast to believe new evidence.

What the scheduler is given (:meth:`Corrections.prefill_scale`, :meth:`Corrections.decode_scale`)
is one factor per model, its coefficients all multiplied by it, so every rule that prices with the
model (Algorithm 1's queue and prefill, packing, the relative SLOs) follows without a change:
``compute · interference^b · queue^w``, where ``w`` is the moving share of the predicted TTFT that
was queue and ``b`` says whether the instance's next forwards run beside a busy neighbour. The
live conductor knows that of a prefill (``PredictionBook.show_node_states``: a job queued on it,
or a decode on its node with requests, is busy; b 1 or 0) and learns each term from the requests
priced in its state; the simulator, and every decode, use the moving share of busy requests.
The two differ, either way: on a 2-CPU box a burst's first forward, the decode idle, ran 0.7x the
shown model with the decode's CPU borrowed (``prefill/threads.py``) and the pack after it
1.3-1.45x; replaying a trace's bursts, each burst's first forward (its intake running beside it)
learned 1.47 and the rest 1.12. An instance never observed has factor 1 exactly.

The queue of an instance serving shortest first is priced with an allowance for the later, shorter
arrivals that may still pass a job (``queue_order.overtake_allowance``: ``bound`` × its own prefill,
the worst case). Most jobs meet a share of it (the shortest of a burst none, a pass by a job packed
into the same forward only that job's tokens), and how much is a matter of the traffic, not of a
speed: no factor fits it, a share does. Each job says what share it met (:func:`overtakes_used`: its
measured wait at its forward's speed, less the wait predicted before any overtake, over the
allowance), and the instance's ``overtake_share`` (the scheduler's
``PrefillInstanceState.overtake_share``) is the moving average of those, weight ``alpha``, within
[0, 1] by construction (so a step is at most ``alpha``), from 0 (:func:`show_start`). On such an
instance the queue's residual goes to the share, not to the ``queue`` factor: one rule for each
residual, never both. With packing, later arrivals also *join* a job's forward
(``queue_order.join_allowance``): the prefill reports the forward that ran (its tokens and jobs),
``compute`` learns that forward's speed (a joined forward is no slowdown) and ``join_share`` (0
until fed) what the joiners added over the allowance's worst case, by the same moving average.

What all this learns is a central prediction: half the requests meet less, half more. Admission must
refuse on what a request may meet, not on what it meets usually (a refusal priced on the median
admits half the requests near the limit to miss it). So each instance also keeps the ratios measured
/ shown of its last ``spread_window`` requests, per metric (``ttft`` and ``wait`` on a prefill,
``tbt`` on a decode), and :meth:`Corrections.spread` is their ``spread_quantile``: the scheduler is
shown the wait's (``PrefillInstanceState.queue_spread``; the TTFT's and the TBT's are measured and
shown to people, not judged) and admission judges what others add to a request's time × spread
against the SLO (``admission.bounds``), while the prediction shown and checked stays the central
one. The spread is measured on what it multiplies: a job's wait (:meth:`Corrections.note_wait`), not
its TTFT, whose own forward (a burst's later members joining it) is no part of the queue; judged on
the TTFT's, admission refused 31-60% of requests that would have met their SLO in the simulator, on
the wait's 0-4% (docs/results/2026-11-29-burst-window.md). A window, not a moving quantile: it
forgets a machine that changed after ``spread_window`` requests, and a broken report is refused as
above.
Pure: no IO, no clock; the live conductor (``conductor/flight/predictions.py``) and the simulator
(``sim/correcting.py``) feed it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from mooncake_lite.scheduler.snapshot import Shown

TERMS = ("queue", "compute", "interference", "transfer", "decode", "decode_interference", "tail")
TOO_SHORT = "too short to time"   # not a refusal: a sub-timer-resolution observation is skipped
# A correction is shown the scheduler anew only once it moved this much (a scale in log, ~3%; a
# share in absolute terms): a new model makes the scheduler derive that instance's estimates afresh,
# so noise must not at every request (the live conductor and the simulator alike).
SHOW_TOLERANCE = 1 / 32


@dataclass(frozen=True)
class CorrectionConfig:
    """The update rule's constants (module doc)."""

    alpha: float = 0.25          # weight of one observation in the moving average of log(ratio)
    max_step: float = 0.15       # largest change of a log factor per observation (x1.16)
    max_factor: float = 16.0     # factors stay within [1/16, 16]
    max_ratio: float = 1000.0    # a measured/predicted beyond this is a broken report, not a slowdown
    min_seconds: float = 1e-4    # predictions or measurements shorter than this are timer noise
    spread_quantile: float = 0.9  # admission's bound: this quantile of the recent ratios (module doc)
    spread_window: int = 64      # the ratios it is taken over, per instance and metric
    spread_min: int = 8          # fewer observed: no spread (1), the prediction alone

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"CorrectionConfig.alpha must be in (0, 1], got {self.alpha}")
        if not self.max_step > 0.0:
            raise ValueError(f"CorrectionConfig.max_step must be > 0, got {self.max_step}")
        if not 1.0 < self.max_factor <= self.max_ratio:
            raise ValueError("CorrectionConfig: need 1 < max_factor <= max_ratio, got "
                             f"{self.max_factor} and {self.max_ratio}")
        if not 0.5 <= self.spread_quantile < 1.0:
            raise ValueError(f"CorrectionConfig.spread_quantile must be in [0.5, 1), got {self.spread_quantile}")
        if not 1 <= self.spread_min <= self.spread_window:
            raise ValueError("CorrectionConfig: need 1 <= spread_min <= spread_window, got "
                             f"{self.spread_min} and {self.spread_window}")


@dataclass(frozen=True)
class Factor:
    """One term's correction: ``log`` of the factor, and how many observations moved it."""

    log: float = 0.0
    num_observed: int = 0

    @property
    def value(self) -> float:
        return math.exp(self.log)


def ratio_refusal(predicted_s: float, measured_s: float, cfg: CorrectionConfig) -> str | None:
    """Why an observation is refused (None: it may be used). A NaN, an infinity, a negative or a
    ratio beyond ``max_ratio`` says the report is broken, and a broken report must not move a model."""
    for name, v in (("predicted", predicted_s), ("measured", measured_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            return f"{name} seconds must be a finite number >= 0, got {v!r}"
    if predicted_s < cfg.min_seconds or measured_s < cfg.min_seconds:
        return TOO_SHORT    # (a queue a packing prefill skipped, a fully cached prefix: nothing to time)
    if not 1.0 / cfg.max_ratio <= measured_s / predicted_s <= cfg.max_ratio:
        return f"ratio {measured_s / predicted_s:.3g} outside [1/{cfg.max_ratio:g}, {cfg.max_ratio:g}]"
    return None


def step(f: Factor, ratio: float, cfg: CorrectionConfig) -> Factor:
    """``f`` moved toward ``ratio`` by the bounded moving average (module doc); ``ratio`` must have
    passed :func:`ratio_refusal`."""
    bound = math.log(cfg.max_factor)
    target = min(bound, max(-bound, math.log(ratio)))
    delta = cfg.alpha * (target - f.log)
    delta = min(cfg.max_step, max(-cfg.max_step, delta))
    return Factor(min(bound, max(-bound, f.log + delta)), f.num_observed + 1)


@dataclass(frozen=True)
class InstanceCorrection:
    """One instance's factors by term, and the moving shares the combined scale weighs them by."""

    factors: Mapping[str, Factor] = field(default_factory=dict)
    busy_share: float = 0.0       # of its observations, those beside a busy neighbour
    queue_share: float = 0.0      # of its predicted TTFT, the share that was queue
    overtake_share: float = 0.0   # of the overtake allowance's worst case, the share jobs met (0: none learned)
    join_share: float = 0.0       # of the join allowance's worst case, the share jobs met (0: none learned)
    ratios: Mapping[str, tuple[float, ...]] = field(default_factory=dict)   # metric -> last measured / shown

    def factor(self, term: str) -> float:
        f = self.factors.get(term)
        return 1.0 if f is None else f.value

    def log_of(self, term: str) -> float:
        f = self.factors.get(term)
        return 0.0 if f is None else f.log


class Corrections:
    """Every instance's :class:`InstanceCorrection`, by instance id. One owner; not thread-safe."""

    def __init__(self, cfg: CorrectionConfig | None = None) -> None:
        self.cfg = cfg or CorrectionConfig()
        self._by_instance: dict[str, InstanceCorrection] = {}
        self.num_refused = 0

    def get(self, instance_id: str) -> InstanceCorrection:
        return self._by_instance.get(instance_id) or InstanceCorrection()

    def items(self) -> Iterator[tuple[str, InstanceCorrection]]:
        return iter(sorted(self._by_instance.items()))

    def forget(self, instance_id: str) -> None:
        self._by_instance.pop(instance_id, None)

    def observe(self, instance_id: str, term: str, predicted_s: float, measured_s: float,
                speed: float | None = None) -> str | None:
        """Move ``instance_id``'s ``term`` by one observation of the uncorrected prediction and the
        measurement; returns why it was refused (None: applied). ``speed``, for ``queue``: how much
        slower than the uncorrected model the forwards ran just then (the same request's own
        compute ratio), so the queue's factor holds only what the forwards' speed does not explain.
        Without it the corrected compute speed stands in, which lags a change of load: the queue
        factor then takes the change up too, and both terms overshoot once compute catches up."""
        if term not in TERMS:
            raise ValueError(f"unknown correction term {term!r}; expected one of {TERMS}")
        why = ratio_refusal(predicted_s, measured_s, self.cfg)
        if why is not None:
            self.num_refused += why != TOO_SHORT
            return why
        cur = self.get(instance_id)
        if term in ("interference", "decode_interference"):   # over the same role's factor alone
            measured_s /= cur.factor("compute" if term == "interference" else "decode")
        elif term == "queue":      # the queue drains at the forwards' speed; beyond it, this
            usable = speed is not None and ratio_refusal(1.0, speed, self.cfg) is None
            measured_s /= speed if usable else math.exp(self._compute_log(cur))
        new = step(cur.factors.get(term, Factor()), measured_s / predicted_s, self.cfg)
        self._by_instance[instance_id] = replace(cur, factors={**cur.factors, term: new})
        return None

    def rebase(self, instance_id: str, term: str, log_shift: float) -> None:
        """The model ``term`` corrects moved by ``exp(log_shift)`` by itself (an instance refines
        its own profile from its forwards and steps, ``instance/refine.py``): the factor moves the
        other way, so model × factor is what it was and the slowdown both saw is counted once.
        Observations made against the old model must be converted by the caller."""
        cur = self.get(instance_id)
        f = cur.factors.get(term)
        if f is None or not math.isfinite(log_shift):
            return
        bound = math.log(self.cfg.max_factor)
        moved = Factor(min(bound, max(-bound, f.log - log_shift)), f.num_observed)
        self._by_instance[instance_id] = replace(cur, factors={**cur.factors, term: moved})

    def note_shares(self, instance_id: str, *, busy: bool | None = None, queue_share: float | None = None) -> None:
        """Move the moving shares: whether this observation ran beside a busy neighbour, and what
        share of its predicted TTFT was queue (a number in [0, 1])."""
        cur, a = self.get(instance_id), self.cfg.alpha
        busy_share = cur.busy_share if busy is None else cur.busy_share + a * (float(busy) - cur.busy_share)
        share = cur.queue_share
        if queue_share is not None and 0.0 <= queue_share <= 1.0:
            share += a * (queue_share - share)
        self._by_instance[instance_id] = replace(cur, busy_share=busy_share, queue_share=share)

    def note_overtakes(self, instance_id: str, used: float) -> str | None:
        """Move ``instance_id``'s overtake share toward ``used`` (one job's, :func:`overtakes_used`);
        returns why it was refused (None: applied): a share is a number in [0, 1]."""
        return self._move_share(instance_id, "overtake_share", used)

    def note_met(self, instance_id: str, *, wait_s: float, overtake_full_s: float, measured_queue_s: float | None,
                 speed: float | None, own_s: float, join_full_s: float, ran_s: float) -> None:
        """One shortest-first job's shares met (module doc), each on the model it was priced with:
        of the overtake allowance's worst case ``overtake_full_s``, what its measured wait (at its
        forward's ``speed`` over that model) added to ``wait_s``, the queue priced before any
        overtake; of the join allowance's ``join_full_s``, what its forward as run (``ran_s``)
        added to its own (``own_s``). A job with no allowance, or a figure that is no number,
        moves nothing. The live conductor and the simulator both learn through this."""
        used = overtakes_used(wait_s, overtake_full_s, measured_queue_s, speed)
        if used is not None:
            self._move_share(instance_id, "overtake_share", used)
        used = overtakes_used(own_s, join_full_s, ran_s, None)
        if used is not None:
            self._move_share(instance_id, "join_share", used)

    def _move_share(self, instance_id: str, share: str, used: float) -> str | None:
        if isinstance(used, bool) or not isinstance(used, (int, float)) or not 0.0 <= used <= 1.0:
            self.num_refused += 1
            return f"{share.replace('_', ' ')} must be a number in [0, 1], got {used!r}"
        cur = self.get(instance_id)
        was = getattr(cur, share)
        self._by_instance[instance_id] = replace(cur, **{share: was + self.cfg.alpha * (used - was)})
        return None

    def note_ratio(self, instance_id: str, metric: str, shown_s: float, measured_s: float) -> str | None:
        """One request's measured ``metric`` (``ttft``, ``tbt``) against the prediction it was shown
        and admitted with, kept for :meth:`spread`; returns why it was refused (None: kept)."""
        why = ratio_refusal(shown_s, measured_s, self.cfg)
        if why is not None:
            self.num_refused += why != TOO_SHORT
            return why
        cur = self.get(instance_id)
        kept = (*cur.ratios.get(metric, ())[1 - self.cfg.spread_window:], measured_s / shown_s)
        self._by_instance[instance_id] = replace(cur, ratios={**cur.ratios, metric: kept})
        return None

    def note_wait(self, instance_id: str, queue_s: float, own_s: float, measured_s: float | None) -> str | None:
        """A job's measured wait against the queue it was priced with (both on the model shown),
        kept for the ``wait`` spread (module doc) only if it was priced to wait at least its own
        forward: a shorter wait is mostly dispatch, and its ratio would say nothing of a queue."""
        if measured_s is None or not queue_s >= own_s > 0:
            return None
        return self.note_ratio(instance_id, "wait", queue_s, measured_s)

    def spread(self, instance_id: str, metric: str) -> float:
        """What admission multiplies ``instance_id``'s predicted ``metric`` by (module doc): the
        ``spread_quantile`` of its recent ratios, within the factors' bounds; 1 with too few."""
        kept = sorted(self.get(instance_id).ratios.get(metric, ()))
        if len(kept) < self.cfg.spread_min:
            return 1.0
        return self._clamped(math.log(quantile(kept, self.cfg.spread_quantile)))

    def overtake_share(self, instance_id: str) -> float:
        """The share of the overtake allowance a new job on ``instance_id`` is priced with."""
        return self.get(instance_id).overtake_share

    def join_share(self, instance_id: str) -> float:
        """The share of the join allowance a new job on ``instance_id`` is priced with."""
        return self.get(instance_id).join_share

    def prefill_scale(self, instance_id: str, busy: bool | None = None) -> float:
        """The factor a prefill instance's model is multiplied by (module doc); ``busy``: the
        state of its node its next forwards are priced in (a neighbour at work: ``interference``
        applies in full; idle: not at all), None: the moving share of the two."""
        c = self.get(instance_id)
        return self._clamped(self._compute_log(c, busy) + c.queue_share * c.log_of("queue"))

    def compute_scale(self, instance_id: str) -> float:
        """:meth:`prefill_scale` without the queue: what a forward takes (the simulator, which
        queues by itself, is exported this one)."""
        return self._clamped(self._compute_log(self.get(instance_id)))

    @staticmethod
    def _compute_log(c: InstanceCorrection, busy: bool | None = None) -> float:
        share = c.busy_share if busy is None else float(busy)
        return c.log_of("compute") + share * c.log_of("interference")

    def decode_scale(self, instance_id: str) -> float:
        """The factor a decode instance's model is multiplied by."""
        c = self.get(instance_id)
        return self._clamped(c.log_of("decode") + c.busy_share * c.log_of("decode_interference"))

    def tail(self, instance_id: str) -> float:
        """A decode's TBT (the paper's) over its mean gap: what its predicted step is multiplied by
        to predict a TBT; 1 until observed."""
        return self.get(instance_id).factor("tail")

    def _clamped(self, log: float) -> float:
        bound = math.log(self.cfg.max_factor)
        return math.exp(min(bound, max(-bound, log)))


def overtakes_used(wait_s: float, allowance_s: float, measured_queue_s: float | None,
                   speed: float | None) -> float | None:
    """The share of its overtake allowance one job met (module doc), in [0, 1]: its measured
    queue in the model's seconds (over ``speed``, how much slower than predicted its own forward
    ran; 1 when unknown), less ``wait_s`` (the queue predicted before any overtake), over
    ``allowance_s`` (the worst case, ``bound`` × its own prefill; both on the model it was priced
    with). None when it had no allowance or a figure is not a finite number >= 0."""
    figures = (wait_s, allowance_s, measured_queue_s)
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
           for v in figures) or allowance_s <= 0:
        return None
    usable = isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0
    queue = measured_queue_s / speed if usable else measured_queue_s
    return min(1.0, max(0.0, (queue - wait_s) / allowance_s))


def show_spread(c: Corrections, instance_id: str, metric: str, view: Shown) -> None:
    """``view`` (the instance's, live or simulated) shows its spread once it moved by more than
    ``SHOW_TOLERANCE``: a new state makes the scheduler derive the instance's estimates afresh."""
    spread = c.spread(instance_id, metric)
    if abs(math.log(spread / view.spread)) >= SHOW_TOLERANCE:
        view.set_spread(spread)


def show_tail(c: Corrections, instance_id: str, view) -> None:
    """``view`` (a ``DecodeView``, live or simulated) shows its tail once it moved by more than
    ``SHOW_TOLERANCE``."""
    tail = c.tail(instance_id)
    if abs(math.log(tail / view.tail)) >= SHOW_TOLERANCE:
        view.set_tail(tail)


def show_start(view) -> None:
    """A prefill view (live or simulated) that this correction will feed shows its start, not the
    worst case: no job measured, the overtake and join shares 0 (the queue as it stands), learned
    from there. Started at the worst case (1), the simulator on a replayed trace refused up to
    23% of requests that would have met their TTFT SLO, all before the share was learned
    (docs/results/2026-11-29-burst-window.md)."""
    start = InstanceCorrection()
    view.set_overtake_share(start.overtake_share, start.join_share)


def show_shares(c: Corrections, instance_id: str, view) -> None:
    """``view`` (a ``PrefillView``, live or simulated) shows the overtake and join shares once
    either moved by more than ``SHOW_TOLERANCE``: a new state derives the estimates afresh."""
    share, join = c.overtake_share(instance_id), c.join_share(instance_id)
    if abs(share - view.overtake_share) >= SHOW_TOLERANCE or abs(join - view.join_share) >= SHOW_TOLERANCE:
        view.set_overtake_share(share, join)


def quantile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def scaled(model, factor: float):
    """A cost model (prefill or decode) with every coefficient multiplied by ``factor``: each of
    its predictions is multiplied by it (the formulas, a prefill's chunked sum too, are linear in
    the coefficients), its chunk kept. The same object when ``factor`` is 1, so an uncorrected
    instance's state is the one it had."""
    if factor == 1.0 or model is None:
        return model
    return replace(model, **{k: v * factor for k, v in model.to_dict().items()})
