"""Online correction of the cost models from measured residuals (issue #36), per instance and per term.

An instance's cost model is a profile fitted once (and refined by the instance from its own
forwards); what a request really meets also holds what no profile sees: the queue as it really
drains, other processes on the machine, a CPU limit set after start-up, the roles sharing cores.
Each finished request gives, per term, a *ratio*: what was measured over what the **uncorrected**
model predicted. Terms (``TERMS``): ``queue`` (the wait in the prefill's queue, over what the
corrected compute speed explains: per-job work a forward's profile misses), ``compute`` (its
own prefill, no decode computing on its node), ``interference`` (its prefill beside a busy
decode), ``transfer`` (a prefix fetched between stores: shown, not applied here, since
the scheduler corrects each store pair's speed itself, ``links.py``), ``decode`` (the request's mean
token gap, no prefill computing on the decode's node: what the decode model predicts, a step),
``decode_interference`` (the reverse) and ``tail`` (the request's TBT as the paper defines it, the
mean of its slowest tenth of gaps, over its mean gap: both measured). ``tail`` scales no model: it
turns the step foreseen into the TBT shown (``DecodeInstanceState.tbt_tail``; admission judges the
step), which a step alone was under on nearly every request (2026-11-29-decode-load.md).

The update rule (:func:`step`; a prefill's states fit a line, below): a moving average of
``log(ratio)``, weight ``alpha``, its change per observation within ``max_step`` (both × the share of
an observation it is, ``weight``: a pack's jobs waited for one queue), the factor within
``[1/max_factor, max_factor]``. Working in logs makes a factor of 2 and of 1/2 equally far from 1
and a product of terms a sum. The bounds make it safe to feed: one absurd measurement moves a
factor by at most ``max_step`` (about 16%), so it cannot run away, and a ratio outside
``[1/max_ratio, max_ratio]``, or not a finite positive number, is refused and moves nothing.
None of these constants describes a machine: they say how fast to believe new evidence.

What the scheduler is given (:meth:`Corrections.prefill_scale`, :meth:`Corrections.decode_scale`)
is one factor per model, its coefficients all multiplied by it, so every rule that prices with the
model (Algorithm 1's queue and prefill, packing, the relative SLOs) follows without a change: its
node state's for a prefill (below), ``decode · decode_interference^b`` for a decode. A prefill's
``queue`` factor scales the wait for the work queued ahead alone (:meth:`Corrections.queue_scale`):
on the model it priced each forward 0.81x too (docs/results/2026-11-30-zen5.md §19). A prefill's
state is ``interference`` when its next forwards run beside a busy neighbour, else ``compute``: the
live conductor knows which (:func:`node_busy`: a job queued on it, or a decode on its node with
requests, is busy) and learns each state from the requests priced in it; the simulated conductor and every
decode weigh the two by the moving share ``b`` of busy requests (a simulated forward runs at the state
:func:`node_busy` gave it when placed). They differ either way: on a 2-CPU box
a burst's first forward, the decode idle, ran 0.7x the shown model with the decode's CPU borrowed
(``prefill/threads.py``) and the pack after it 1.3-1.45x. Each state is a line, not a factor
(``forward_fit.py``): ``scale · (x + offset)``, its offset added to the model's ``c0`` once a job
(:meth:`Corrections.prefill_offset`, :func:`~mooncake_lite.scheduler.costs.scaled`); a state not yet observed borrows the
other's, except where the prefill measured its busy state at start-up (:meth:`Corrections.seed_states`).
An instance never observed has factor 1 and offset 0 exactly (its busy state: that measure).

The queue of an instance serving shortest first is priced with an allowance for the later, shorter
arrivals that may still pass a job (``queue_order.overtake_allowance``: ``bound`` × its own prefill,
the worst case). Most jobs meet a share of it, a matter of the traffic, not of a speed: a share
fits it. Each job passed says what share it met (``shares.overtakes_used``: its measured wait at its
forward's speed, less the queue ahead as priced, over the allowance), and ``overtake_share`` (the
scheduler's ``PrefillInstanceState.overtake_share``) is their moving average, weight ``alpha``, in
[0, 1], from 0 (:func:`show_start`); a job the prefill says nobody passed met 0 and teaches the
``queue`` factor instead: each residual once (:meth:`Corrections.note_met`). With packing, later
arrivals also *join* a job's forward (``queue_order.join_allowance``): the prefill reports the
forward that ran, ``compute`` learns its speed (a joined forward is no slowdown) and ``join_share``
(0 until fed) what the joiners added over the allowance's worst case, by the same average.

What all this learns is a central prediction: half the requests meet less, half more. How far
above it they land, the spread, is kept beside it (``wait_spread.py``) and shown; admission judges
the central prediction unless ``bound_quantile`` asks for a quantile of it (:meth:`Corrections.queue_bound`).
Pure: no IO, no clock; the live conductor (``conductor/flight/predictions.py``) and the simulator
(``sim/correcting.py``) feed it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from mooncake_lite.scheduler.forward_fit import ForwardLine, moved_line
from mooncake_lite.scheduler.shares import overtakes_used
from mooncake_lite.scheduler.state import DecodeInstanceState, PrefillInstanceState
from mooncake_lite.scheduler.update_rule import TOO_SHORT, CorrectionConfig, Factor, ratio_refusal, step
from mooncake_lite.scheduler.wait_spread import KeptWait, ShownWait, kept, quantile, repriced

TERMS = ("queue", "compute", "interference", "transfer", "decode", "decode_interference", "tail")
STATES = ("compute", "interference")   # a prefill's two node states: idle, beside a busy neighbour
# A correction is shown the scheduler anew only once it moved this much (a scale in log, ~3%; a share
# in absolute terms): a new model makes the scheduler derive that instance's estimates afresh.
SHOW_TOLERANCE = 1 / 32


def holds_requests(decode: DecodeInstanceState) -> bool:
    """A decode with requests, running or with their KV to come: the prefills on its node are busy."""
    return bool(decode.running or decode.incoming)


def node_busy(prefill: PrefillInstanceState, decode_beside_holds: bool) -> bool:
    """A prefill's node state before a decision, the one each state's speed is learned by (module
    doc): busy with a job queued on it or a decode on its node holding requests (:func:`holds_requests`)."""
    return bool(prefill.queue) or decode_beside_holds


@dataclass(frozen=True)
class InstanceCorrection:
    """One instance's factors by term, and the moving shares the combined scale weighs them by."""

    factors: Mapping[str, Factor] = field(default_factory=dict)
    busy_share: float = 0.0       # of its observations, those beside a busy neighbour
    overtake_share: float = 0.0   # of the overtake allowance's worst case, the share jobs met (0: none learned)
    join_share: float = 0.0       # of the join allowance's worst case, the share jobs met (0: none learned)
    ratios: Mapping[str, tuple[float, ...]] = field(default_factory=dict)   # metric -> last measured / shown
    lines: Mapping[str, ForwardLine] = field(default_factory=dict)   # each state's (forward_fit.py)
    waits: tuple[KeptWait, ...] = ()     # the last waits measured, their prices taken apart (wait_spread.py)

    @property
    def spread_metrics(self) -> tuple[str, ...]:
        """The metrics a spread is measured of here."""
        return (*self.ratios, "wait") if self.waits else tuple(self.ratios)

    def factor(self, term: str) -> float:
        f = self.factors.get(term)
        return 1.0 if f is None else f.value

    def offset(self, term: str) -> float:
        return self.lines[term].offset if term in self.lines else 0.0

    def state_term(self, busy: bool) -> str:
        """The term a prefill's forwards in this node state are corrected by: its own, or the other
        state's until its own has been observed (the same forward, more or less crowded)."""
        own, other = ("interference", "compute") if busy else ("compute", "interference")
        return own if own in self.factors or other not in self.factors else other

    def log_of(self, term: str) -> float:
        return self.factors[term].log if term in self.factors else 0.0


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
                speed: float | None = None, weight: float = 1.0) -> str | None:
        """Move ``instance_id``'s ``term`` by one observation of the uncorrected prediction and the
        measurement; returns why it was refused (None: applied). ``speed``, for ``queue``: how much
        slower than the uncorrected model (its state's offset added) the same request's forward ran,
        so the queue's factor holds only what the forwards' speed does not explain; without it the
        corrected speed stands in, which lags a change of load, and both terms overshoot.
        ``weight``: the share of one observation it is (:func:`step`)."""
        if term not in TERMS:
            raise ValueError(f"unknown correction term {term!r}; expected one of {TERMS}")
        why = ratio_refusal(predicted_s, measured_s, self.cfg)
        if why is not None:
            self.num_refused += why != TOO_SHORT
            return why
        cur = self.get(instance_id)
        if term in STATES:
            self._observe_state(instance_id, cur, term, predicted_s, measured_s)
            return None
        if term == "decode_interference":   # over the decode's own factor alone
            measured_s /= cur.factor("decode")
        elif term == "queue":      # the queue drains at the forwards' speed; beyond it, this
            usable = speed is not None and ratio_refusal(1.0, speed, self.cfg) is None
            measured_s /= speed if usable else math.exp(self._compute_log(cur))
        new = step(cur.factors.get(term, Factor()), measured_s / predicted_s, self.cfg,
                   weight if 0.0 < weight <= 1.0 else 1.0)
        self._by_instance[instance_id] = replace(cur, factors={**cur.factors, term: new})
        return None

    def _observe_state(self, instance_id: str, cur: InstanceCorrection, term: str, x: float, y: float) -> None:
        """A prefill state's line (``forward_fit.py``) moved by one forward (``x`` on the instance's own
        model, ``y`` measured); first seen, from the state it borrowed (its factor and offset)."""
        cfg, was = self.cfg, cur.state_term(term == "interference")
        start = cur.factors[term] if term in cur.factors else Factor(cur.log_of(was))
        line, scale = moved_line(cur.lines.get(term, ForwardLine(cur.offset(was))), x, y, cfg.line_window,
                                 cfg.line_min, cfg.alpha)
        new = step(start, y / (x + line.offset) if scale is None else scale, cfg)
        self._by_instance[instance_id] = replace(cur, factors={**cur.factors, term: new},
                                                 lines={**cur.lines, term: line})

    def seed_states(self, instance_id: str, busy_scale: float) -> None:
        """A prefill's node states before either was observed: idle as its model, busy ``busy_scale``
        times it (measured at start-up, ``Register.busy_scale``), clamped to the bounds; none
        borrows the other's then. Once a state was observed, nothing changes."""
        cur = self.get(instance_id)
        if busy_scale == 1.0 or any(t in cur.factors for t in STATES) or not 0.0 < busy_scale < math.inf:
            return
        bound = math.log(self.cfg.max_factor)
        seeded = {"compute": Factor(), "interference": Factor(min(bound, max(-bound, math.log(busy_scale))))}
        self._by_instance[instance_id] = replace(cur, factors={**cur.factors, **seeded})

    def rebase(self, instance_id: str, term: str, log_shift: float) -> None:
        """The model ``term`` corrects moved by ``exp(log_shift)`` by itself (an instance refines
        its own profile from its forwards and steps, ``instance/refine.py``): the factor moves the
        other way, so model × factor is what it was and the slowdown both saw is counted once.
        Observations made against the old model must be converted by the caller."""
        if not math.isfinite(log_shift):
            return
        bound = math.log(self.cfg.max_factor)
        if term in STATES and (cur := self.get(instance_id)).waits:   # kept in its seconds: the same work
            self._by_instance[instance_id] = replace(cur, waits=tuple(w.rebased(math.exp(log_shift)) for w in cur.waits))
        for t in STATES if term in STATES else (term,):   # a prefill's model: both states' lines
            cur = self.get(instance_id)
            f = cur.factors.get(t)
            if f is None:
                continue
            moved = Factor(min(bound, max(-bound, f.log - log_shift)), f.num_observed)
            lines = {**cur.lines, t: cur.lines[t].rebased(math.exp(log_shift))} if t in cur.lines else cur.lines
            self._by_instance[instance_id] = replace(cur, factors={**cur.factors, t: moved}, lines=lines)

    def note_busy(self, instance_id: str, busy: bool) -> None:
        """Move the moving share of observations that ran beside a busy neighbour."""
        cur = self.get(instance_id)
        self._by_instance[instance_id] = replace(cur, busy_share=cur.busy_share + self.cfg.alpha *
                                                 (float(busy) - cur.busy_share))

    def note_overtakes(self, instance_id: str, used: float) -> str | None:
        """Move ``instance_id``'s overtake share toward ``used`` (one job's, ``shares.overtakes_used``);
        returns why it was refused (None: applied): a share is a number in [0, 1]."""
        return self._move_share(instance_id, "overtake_share", used)

    def note_met(self, instance_id: str, *, wait_s: float, overtake_full_s: float, measured_queue_s: float | None,
                 speed: float | None, own_s: float, join_full_s: float, ran_s: float, passed: float | None = None,
                 queue_scale: float = 1.0, jobs: float = 1.0) -> None:
        """One shortest-first job's shares met (module doc), each on the model it was priced with:
        of the overtake allowance's worst case ``overtake_full_s``, what its measured wait (at its
        forward's ``speed`` over that model) added to ``wait_s``, the queue ahead as priced (×
        ``queue_scale``), or 0 when the prefill says no later arrival passed it (``passed`` 0; None:
        not said); of the join allowance's ``join_full_s``, what its forward as run (``ran_s``)
        added to its own (``own_s``). A job with no allowance, or a figure that is no number, moves
        nothing. A job nobody passed waited for the queue ahead alone: its wait against that queue
        unscaled moves the ``queue`` factor, both ways (Zen 5's ran 0.8x their price, §18), as
        ``1/jobs`` of an observation: its forward's ``jobs`` waited for one queue (Zen 3: a pack of
        two behind a rest priced 0.58 s that took 1.2 s moved it x1.35)."""
        alone = passed == 0
        overtaken = 0.0 if alone and overtake_full_s > 0 else \
            overtakes_used(wait_s, overtake_full_s, measured_queue_s, speed)
        joined = overtakes_used(own_s, join_full_s, ran_s, None)
        for share, used in (("overtake_share", overtaken), ("join_share", joined)):
            if used is not None:
                self._move_share(instance_id, share, used)
        if alone and wait_s > 0.0 and measured_queue_s is not None and speed is not None and speed > 0.0:
            self.observe(instance_id, "queue", wait_s / queue_scale, measured_queue_s / speed, 1.0,
                         1.0 / jobs if jobs >= 1.0 else 1.0)

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

    def note_wait(self, instance_id: str, shown: ShownWait, measured_s: float | None) -> str | None:
        """A job's measured wait and the price it was shown (``wait_spread.py``), kept for the
        ``wait`` spread (module doc) only if it was priced to wait at least its own forward: a
        shorter wait is mostly dispatch, and its ratio would say nothing of a queue. Returns why it
        was refused (None: kept, or not a queue)."""
        if measured_s is None or not shown.queue_s >= shown.own_s > 0:
            return None
        why = ratio_refusal(shown.queue_s, measured_s, self.cfg)
        wait = kept(shown, measured_s) if why is None else None
        if wait is None:
            self.num_refused += why != TOO_SHORT
            return why or f"a wait priced at scales {shown.scale!r} and {shown.queue_scale!r}"
        cur = self.get(instance_id)
        self._by_instance[instance_id] = replace(cur, waits=(*cur.waits[1 - self.cfg.spread_window:], wait))
        return None

    def queue_bound(self, instance_id: str) -> float:
        """What admission multiplies ``instance_id``'s predicted queue by: 1, the central prediction
        (why: ``wait_spread.py``), unless ``bound_quantile``: that quantile of the waits' ratios."""
        q = self.cfg.bound_quantile
        return 1.0 if q is None else self.spread(instance_id, "wait", q)

    def spread(self, instance_id: str, metric: str, q: float | None = None) -> float:
        """The ``q`` quantile (default ``spread_quantile``) of ``instance_id``'s recent ratios of
        ``metric`` (a wait's priced again as the corrections stand), within the factors' bounds;
        1 with too few."""
        c = self.get(instance_id)
        if metric == "wait":
            ratios = repriced(c.waits, lambda busy: self.prefill_scale(instance_id, busy),
                              self.queue_scale(instance_id), c.overtake_share, c.join_share)
        else:
            ratios = list(c.ratios.get(metric, ()))
        if len(ratios) < self.cfg.spread_min:
            return 1.0
        return self._clamped(math.log(quantile(sorted(ratios), self.cfg.spread_quantile if q is None else q)))

    def overtake_share(self, instance_id: str) -> float:
        """The share of the overtake allowance a new job on ``instance_id`` is priced with."""
        return self.get(instance_id).overtake_share

    def join_share(self, instance_id: str) -> float:
        """The share of the join allowance a new job on ``instance_id`` is priced with."""
        return self.get(instance_id).join_share

    def prefill_scale(self, instance_id: str, busy: bool | None = None) -> float:
        """The factor a prefill instance's model is multiplied by (module doc); ``busy``: the
        state of its node its next forwards are priced in (a neighbour at work: ``interference``;
        idle: ``compute``), None: the two weighed by the moving share of busy requests."""
        c = self.get(instance_id)
        return self._clamped(self._compute_log(c, busy))

    def queue_scale(self, instance_id: str) -> float:
        """What a prefill's wait for the work queued ahead is multiplied by (module doc)."""
        return self._clamped(self.get(instance_id).log_of("queue"))

    def prefill_offset(self, instance_id: str, busy: bool | None = None) -> float:
        """The seconds a prefill instance's model adds to each forward before its scale
        (``forward_fit.py``), in the state ``busy`` as :meth:`prefill_scale` takes it."""
        c = self.get(instance_id)
        return sum(w * c.offset(c.state_term(b)) for b, w in _state_weights(c, busy))

    @staticmethod
    def _compute_log(c: InstanceCorrection, busy: bool | None = None) -> float:
        return sum(w * c.log_of(c.state_term(b)) for b, w in _state_weights(c, busy))

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


def _state_weights(c: InstanceCorrection, busy: bool | None) -> tuple[tuple[bool, float], ...]:
    """(state, weight): the one given, or both by the moving share of busy requests."""
    return ((busy, 1.0),) if busy is not None else ((False, 1.0 - c.busy_share), (True, c.busy_share))
