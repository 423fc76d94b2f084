"""Every prediction checked against what happened, and the models corrected by it (issue #36).

At admission a decision carries the TTFT and TBT the scheduler predicted and their parts (queue,
own prefill, transfer); :class:`Prediction` (``checks.py``) keeps them with the correction scales its instances'
models had then. At the end the flight measures TTFT (placement to first token), TBT
(``common/tbt.paper_tbt`` of its gaps) and takes the prefill's own timings: a :class:`Check`. The
:class:`PredictionBook` (one per conductor) puts each in the ``mooncake_conductor_prediction_ratio``
histogram and ``mooncake status``'s last minute, and feeds the online correction
(``scheduler/correction.py``), whose scaled models, spreads and tails it shows the scheduler
(``Membership.shown_costs``, the views). Each conductor learns from the requests it places; nothing is shared.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from mooncake_lite.conductor.cluster.costs import InstanceCosts
from mooncake_lite.conductor.cluster.membership import Instance, Membership
from mooncake_lite.conductor.cluster.metrics import ConductorMetrics
from mooncake_lite.conductor.flight.checks import Check, Prediction, positive
from mooncake_lite.scheduler import CostModels, Decision
from mooncake_lite.scheduler.correction import STATES, TOO_SHORT, Corrections, holds_requests, node_busy
from mooncake_lite.scheduler.costs import scaled
from mooncake_lite.scheduler.correction_shown import model_moved, show_queue_bound, show_queue_scale, show_shares, show_tail
from mooncake_lite.scheduler.packing import forward_seconds
from mooncake_lite.scheduler.prefill_view import PrefillView
from mooncake_lite.scheduler.queue_order import worst_cases
from mooncake_lite.scheduler.view import DecodeView
from mooncake_lite.scheduler.wait_spread import ShownWait, quantile

log = logging.getLogger(__name__)
WINDOW_S = 60.0        # `mooncake status`: the last minute
MAX_RECENT = 4096      # checks kept for that window at most (a burst cannot grow it without end)


class PredictionBook:
    """The conductor's checks and corrections (module doc). One per app; not thread-safe."""

    def __init__(self, membership: Membership, metrics: ConductorMetrics,
                 defaults: Callable[[], CostModels], corrections: Corrections | None = None) -> None:
        self.membership, self.metrics, self.defaults = membership, metrics, defaults
        self.corrections = corrections or Corrections()
        self.recent: deque[tuple[float, str, float]] = deque(maxlen=MAX_RECENT)   # (time, metric, ratio)
        self._shown: dict[str, float] = {}    # instance id -> the scale its shown model has
        self._offset: dict[str, float] = {}   # prefill id -> the seconds its shown model adds per forward
        self._busy: dict[str, bool] = {}      # prefill id -> the node state its shown model is priced in
        # instance id -> (its own model last seen, log of its moves since): see :meth:`_rebased`
        self._base: dict[str, tuple[Any, float]] = {}
        # requests whose TTFT side was settled at token 1 (insertion-ordered: one aborted after its
        # first token never settles, so the oldest are dropped past MAX_RECENT)
        self._first_settled: dict[str, None] = {}
        membership.shown_costs = self.shown_costs

    def predicted(self, d: Decision, num_tokens: int = 0, prefix_tokens: int = 0) -> Prediction:
        """``d``'s prediction; ``num_tokens`` (the prompt's) and ``prefix_tokens`` (the reused
        prefix it was priced with) give the overtake allowance its queue holds (0: none known)."""
        share, full, join, join_full = self._allowance(d.prefill_id, num_tokens, prefix_tokens, d.predicted_queue_s)
        return Prediction(d.predicted_ttft_s or 0.0, d.predicted_tbt_s, d.predicted_queue_s, d.predicted_prefill_s,
                          d.predicted_transfer_s, self.shown_scale(d.prefill_id), self.shown_scale(d.decode_id),
                          (self._base_log(d.prefill_id), self._base_log(d.decode_id)), share * full, full,
                          join * join_full, join_full, self._tail(d.decode_id),
                          self._busy.get(d.prefill_id or "", False), self.shown_offset(d.prefill_id),
                          self._queue_scale(d.prefill_id))

    def _allowance(self, prefill_id: str | None, num_tokens: int, prefix_tokens: int,
                   queue_s: float) -> tuple[float, ...]:
        """(the overtake share ``prefill_id``'s view has, the worst-case overtake allowance the
        scheduler priced a job of this prompt queued ``queue_s`` with there, on the model shown;
        the join share and its worst case likewise: ``queue_order.worst_cases``); the allowances
        0 where there are none."""
        inst = self.membership.get(prefill_id) if prefill_id else None
        if inst is None or num_tokens <= 0 or inst.reg.queue_overtakes <= 0 or not isinstance(inst.view, PrefillView):
            return 1.0, 0.0, 0.0, 0.0
        model = scaled(inst.costs.prefill or self.defaults().prefill, self.shown_scale(inst.instance_id),
                       self.shown_offset(inst.instance_id))
        view = inst.view
        full, join = worst_cases(model, inst.reg.queue_overtakes, inst.reg.pack_tokens, num_tokens, prefix_tokens,
                                 view.state().recent_uncached, queue_s, view.join_share)
        return view.overtake_share, full, view.join_share, join

    def _queue_scale(self, prefill_id: str | None) -> float:
        """The scale ``prefill_id``'s view prices its wait for the work ahead with (1: none)."""
        inst = self.membership.get(prefill_id) if prefill_id else None
        return inst.view.queue_scale if inst is not None and isinstance(inst.view, PrefillView) else 1.0

    def _tail(self, decode_id: str | None) -> float:
        """The tail ``decode_id``'s view shows (the decision's TBT is its step × it)."""
        inst = self.membership.get(decode_id) if decode_id else None
        return inst.view.tail if inst is not None and isinstance(inst.view, DecodeView) else 1.0

    def _base_log(self, instance_id: str | None) -> float:
        return self._base[instance_id][1] if instance_id in self._base else 0.0

    def shown_scale(self, instance_id: str) -> float:
        """The scale of the model the scheduler prices ``instance_id`` with now."""
        return self._shown.get(instance_id, 1.0)

    def shown_offset(self, instance_id: str | None) -> float:
        """The seconds that model adds to each forward before its scale (a prefill's; 0 for a decode)."""
        return self._offset.get(instance_id or "", 0.0)

    def show_node_states(self) -> None:
        """Before a decision: each prefill shown at its node's state's speed (``correction.py``). Busy:
        a job is queued on it (the decodes of the jobs ahead will be running by the time a new job's
        forward starts) or a decode on its node has requests, running or on their way; idle: neither,
        so its next forward runs alone (with the CPUs a busy decode would hold, prefill/threads.py).
        A flip re-prices its queue only where the two states' scales differ past the tolerance."""
        alive = self.membership.alive()
        busy_nodes = {_node(o) for o in alive if o.role == "decode" and holds_requests(o.view.state())}
        for inst in alive:
            if inst.role != "prefill":
                continue
            busy = node_busy(inst.view.state(), _node(inst) in busy_nodes)
            if self._busy.get(inst.instance_id, False) != busy:
                self._busy[inst.instance_id] = busy
                self._reshow_scale(inst)

    def busy_beside(self, decode_id: str) -> bool:
        """Whether a prefill on ``decode_id``'s node has work queued: the decode's steps then run
        beside its forwards (a prefill's own state is :meth:`show_node_states`')."""
        inst = self.membership.get(decode_id)
        if inst is None:
            return False
        node = _node(inst)
        return any(o.role == "prefill" and o.prefill_jobs and _node(o) == node for o in self.membership.alive())

    # ---- a completed request -------------------------------------------------------------------
    def settle_first(self, check: Check, now: float) -> None:
        """The TTFT side of ``check`` as soon as the first token is in (its decode still to come):
        the prefill's terms corrected by it at once. Settled at the request's end instead, a
        correction would reach the scheduler a whole decode later — a burst admitted meanwhile is
        priced on the old speed (measured: the median TTFT error of the first 50 requests)."""
        if check.request_id in self._first_settled:
            return
        self._first_settled[check.request_id] = None
        if len(self._first_settled) > MAX_RECENT:
            del self._first_settled[next(iter(self._first_settled))]
        self._record(check, ("ttft", "queue", "compute", "transfer"), now)
        self._correct_prefill(check)
        self._reshow(check.prefill_id)
        self._export_gauges(check.prefill_id)

    def settle(self, check: Check, now: float) -> None:
        """Record ``check`` (histogram, window, log) and correct both instances' models by it; the
        TTFT side only if :meth:`settle_first` did not."""
        if check.request_id in self._first_settled:
            del self._first_settled[check.request_id]
        else:
            self._record(check, ("ttft", "queue", "compute", "transfer"), now)
            self._correct_prefill(check)
        self._record(check, ("tbt", "gap"), now)
        log.info("%s", check.describe())   # tagged with the request's id by the relay's log context
        self._correct_decode(check)
        for iid in (check.prefill_id, check.decode_id):
            self._reshow(iid)
        self._export_gauges(check.prefill_id, check.decode_id)

    def _record(self, check: Check, metrics: tuple[str, ...], now: float) -> None:
        ratios = check.ratios()
        for metric in metrics:
            if (ratio := ratios.get(metric)) is None:
                continue
            iid = check.decode_id if metric in ("tbt", "gap") else check.prefill_id
            self.metrics.prediction_ratio.labels(iid, metric).observe(ratio)
            if metric in ("ttft", "tbt"):
                self.recent.append((now, metric, ratio))

    def _reshow(self, iid: str) -> None:
        """Show the scheduler ``iid``'s model anew once its scale moved past the tolerance."""
        inst = self.membership.get(iid)
        if inst is None:
            return
        self._reshow_scale(inst)
        if isinstance(inst.view, PrefillView):
            # Only the queue's bound is shown (1 unless a quantile is asked for: admission.bounds);
            # a decode's spread would rebuild its state for nothing (/metrics and status read the
            # spreads from the corrections)
            show_queue_bound(self.corrections, iid, inst.view)
            show_shares(self.corrections, iid, inst.view)
            show_queue_scale(self.corrections, iid, inst.view)
        elif isinstance(inst.view, DecodeView):
            show_tail(self.corrections, iid, inst.view)

    def _reshow_scale(self, inst: Instance) -> None:
        iid = inst.instance_id
        scale, offset = self._scale(iid, inst.role), self._state_offset(inst)
        c0 = (inst.costs.prefill or self.defaults().prefill).c0 if inst.role == "prefill" else 0.0
        if model_moved(scale, offset, self.shown_scale(iid), self.shown_offset(iid), c0):
            self._shown[iid], self._offset[iid] = scale, offset
            self.membership.show_costs(inst)

    def _state_offset(self, inst: Instance) -> float:
        if inst.role != "prefill":
            return 0.0
        return self.corrections.prefill_offset(inst.instance_id, self._busy.get(inst.instance_id, False))

    def _correct_prefill(self, check: Check) -> None:
        """Each term from its own measured residual: compute (or interference) from the request's
        forward, the queue from its wait over how fast that forward ran (``speed``)."""
        p, c, iid = check.predicted, self.corrections, check.prefill_id
        # the uncorrected prediction, on the instance's own model as it is now (it may have refined
        # since: its seconds, and so the offset, are exp(moved) what they were)
        moved = self._base_log(iid) - p.bases[0]
        s, offset = p.prefill_scale * math.exp(-moved), p.prefill_offset * math.exp(moved)
        # each state's term learns from the requests priced in it: what the prediction must be right for
        term = "interference" if p.busy else "compute"
        own = max(p.prefill_s / s - offset, 0.0)
        # its speed on the forward that ran: later arrivals that joined it are not a slowdown
        ran = self._forward_s(iid, check.forward) or own
        self._observe(iid, term, ran, check.compute_s)
        speed = check.compute_s / (ran + offset) if positive(check.compute_s) and ran > 0 else None
        if p.overtake_full_s > 0 or p.join_full_s > 0:   # shortest first: residuals are the shares met
            c.note_met(iid, wait_s=max(p.queue_s - p.overtake_s - p.join_s, 0.0), overtake_full_s=p.overtake_full_s,
                       measured_queue_s=check.queue_s, speed=None if speed is None else speed / s, own_s=own * s,
                       join_full_s=p.join_full_s, ran_s=ran * s, passed=check.passed, queue_scale=p.queue_scale,
                       jobs=_jobs(check.forward))
        elif p.queue_s >= p.prefill_s or not 0.0 <= (check.queue_s or 0.0) < math.inf:
            # FIFO: the whole wait is the queue ahead's, on the scales it was shown; one priced under its
            # own forward is mostly dispatch (note_wait's rule), kept out unless broken (refused, logged)
            self._observe(iid, "queue", p.queue_s / (s * p.queue_scale), check.queue_s, speed, _jobs(check.forward))
        self._observe(iid, "transfer", p.transfer_s, check.transfer_s)   # corrected per link by LinkSpeeds
        c.note_busy(iid, p.busy)
        self._observe(iid, "ttft", p.ttft_s, check.ttft_s)
        shown = ShownWait(p.queue_s, p.prefill_s, p.overtake_s, p.join_s, p.overtake_full_s, p.join_full_s, s,
                          p.queue_scale, p.busy)
        self._refused(iid, "wait", c.note_wait(iid, shown, check.queue_s))

    def _forward_s(self, iid: str, forward: tuple[int, int, float, float] | None) -> float | None:
        """The forward a request's prefill ran in, on its instance's own model (None: not reported)."""
        inst = self.membership.get(iid)
        if forward is None or not forward[2] or inst is None:
            return None
        return forward_seconds(inst.costs.prefill or self.defaults().prefill, *forward)

    def _correct_decode(self, check: Check) -> None:
        p, iid = check.predicted, check.decode_id
        if p.tbt_s is None:
            return
        term = "decode_interference" if check.decode_busy else "decode"
        s = p.decode_scale * math.exp(p.bases[1] - self._base_log(iid))
        self._observe(iid, term, p.step_s / s, check.mean_gap_s)
        if check.mean_gap_s is not None:
            self._observe(iid, "tail", check.mean_gap_s, check.tbt_s)
        self.corrections.note_busy(iid, check.decode_busy)
        self._observe(iid, "tbt", p.tbt_s, check.tbt_s)

    def _observe(self, instance_id: str, term: str, predicted_s: float, measured_s: float | None,
                 speed: float | None = None, jobs: float = 1.0) -> None:
        """``term``: a correction term, or ``ttft``/``tbt``: the shown prediction's ratio kept for
        its spread (``Corrections.note_ratio``)."""
        if measured_s is None:
            return
        c = self.corrections
        why = c.note_ratio(instance_id, term, predicted_s, measured_s) if term in ("ttft", "tbt") else \
            c.observe(instance_id, term, predicted_s, measured_s, speed, 1.0 / jobs)
        self._refused(instance_id, term, why)

    def _refused(self, instance_id: str, term: str, why: str | None) -> None:
        if why is not None and why != TOO_SHORT:
            self.metrics.prediction_refused.labels(instance_id, term).inc()
            log.warning("%s: %s measurement refused by the online correction (%s); its model is unchanged",
                        instance_id, term, why)

    def _export_gauges(self, *instance_ids: str) -> None:
        c = self.corrections
        for iid in instance_ids:
            corr = c.get(iid)
            for term, f in corr.factors.items():
                self.metrics.correction.labels(iid, term).set(f.value)
            self.metrics.correction.labels(iid, "scale").set(self.shown_scale(iid))
            self.metrics.correction.labels(iid, "offset_s").set(self.shown_offset(iid))
            for metric in corr.spread_metrics:
                self.metrics.correction.labels(iid, f"{metric}_spread").set(c.spread(iid, metric))

    def _scale(self, instance_id: str, role: str) -> float:
        c = self.corrections
        return c.prefill_scale(instance_id, self._busy.get(instance_id, False)) if role == "prefill" \
            else c.decode_scale(instance_id)

    # ---- what the scheduler is shown -------------------------------------------------------
    def shown_costs(self, inst: Instance) -> InstanceCosts:
        """``inst``'s own costs (the cluster default where it reported none), its role's model
        multiplied by its correction scale as last shown; its own object while that is 1. First
        seen, a prefill's node states start where it measured them (``Register.busy_scale``)."""
        if inst.instance_id not in self._base and inst.role == "prefill":
            self.corrections.seed_states(inst.instance_id, inst.reg.busy_scale)
        self._rebased(inst)
        return self._scaled(inst, self.shown_scale(inst.instance_id), self.shown_offset(inst.instance_id))

    def _rebased(self, inst: Instance) -> None:
        """When ``inst``'s own model moved by itself since last seen (the instance refined its
        profile from the slowdown the correction had learned too), its factor moves back by as
        much (``Corrections.rebase``) and the shown scale with it: model × factor is unchanged,
        and the slowdown counted once. The move is the mean log ratio of the two models'
        predictions over a spread of shapes (prompts of 64–4096 tokens; batches of 1–32)."""
        iid, role = inst.instance_id, inst.role
        own = inst.costs.prefill if role == "prefill" else inst.costs.decode
        seen = self._base.get(iid)
        if seen is None or own is None or seen[0] is None or own == seen[0]:
            self._base[iid] = (own, seen[1] if seen else 0.0)
            return
        shift = _log_shift(seen[0], own, role)
        self._base[iid] = (own, seen[1] + shift)
        self.corrections.rebase(iid, "compute" if role == "prefill" else "decode", shift)
        if iid in self._shown:
            self._shown[iid] = self._scale(iid, role)
            self._offset[iid] = self._state_offset(inst)

    def simulated_costs(self, inst: Instance) -> InstanceCosts:
        """What ``sim export-costs`` exports: a prefill's model with its compute terms corrected
        (measured against its own prefill's prediction: a forward's speed), not its queue's (the
        simulator queues by itself); a decode's as it reports it. The decode's correction is
        learned against the TBT admission predicted for the load it foresaw, so it also holds
        that load's error; the simulator draws its steps from the measured step spread instead
        (``decode_step_ratios``). Measured: exporting it put the simulated TBT at -51% of live."""
        if inst.role == "prefill":
            c = self.corrections
            return self._scaled(inst, c.prefill_scale(inst.instance_id), c.prefill_offset(inst.instance_id))
        return inst.costs

    def simulated_states(self, inst: Instance) -> tuple[InstanceCosts, InstanceCosts] | None:
        """A prefill's model in each node state, idle and busy, corrected as :meth:`simulated_costs`
        (which weighs the two by the share of busy requests): the simulator runs each forward at its
        state's speed. None until both states have a factor (measured, or seeded at start-up)."""
        c, iid = self.corrections, inst.instance_id
        if inst.role != "prefill" or not all(t in c.get(iid).factors for t in STATES):
            return None
        idle, busy = ((c.prefill_scale(iid, b), c.prefill_offset(iid, b)) for b in (False, True))
        return self._scaled(inst, *idle), self._scaled(inst, *busy)

    def _scaled(self, inst: Instance, scale: float, offset: float = 0.0) -> InstanceCosts:
        costs = inst.costs
        if scale == 1.0 and offset == 0.0:
            return costs
        if inst.role == "prefill":
            return replace(costs, prefill=scaled(costs.prefill or self.defaults().prefill, scale, offset))
        return replace(costs, decode=scaled(costs.decode or self.defaults().decode, scale))

    # ---- the last minute (`mooncake status`) ------------------------------------------------------
    def recent_errors(self, now: float, window_s: float = WINDOW_S) -> dict[str, dict[str, float | int | None]]:
        """Per metric (ttft, tbt) over the last ``window_s``: how many checks, the median and p90 of
        the relative error |measured/predicted − 1|, and the median ratio (its sign: > 1, the
        predictions were optimistic)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for metric in ("ttft", "tbt"):
            ratios = [r for t, m, r in self.recent if m == metric and now - t <= window_s]
            errors = sorted(abs(r - 1.0) for r in ratios)
            out[metric] = {"count": len(ratios), "median_error": quantile(errors, 0.5),
                           "p90_error": quantile(errors, 0.9), "median_ratio": quantile(sorted(ratios), 0.5)}
        return out

    def export(self) -> dict[str, Mapping[str, Any]]:
        """Every corrected instance's factors, by instance id (``sim export-costs``, status)."""
        c = self.corrections
        return {iid: {"scale": self.shown_scale(iid), "offset_s": round(self.shown_offset(iid), 6),
                      "factors": {t: round(f.value, 6) for t, f in corr.factors.items()},
                      "observed": {t: f.num_observed for t, f in corr.factors.items()},
                      "offsets_s": {t: round(line.offset, 6) for t, line in corr.lines.items()},
                      "busy_share": round(corr.busy_share, 4), "queue_scale": round(c.queue_scale(iid), 4),
                      "overtake_share": round(corr.overtake_share, 4), "join_share": round(corr.join_share, 4),
                      "spread": {m: round(c.spread(iid, m), 4) for m in corr.spread_metrics}}
                for iid, corr in c.items()}


def _jobs(forward: tuple[int, int, float, float] | None) -> float:
    """The jobs of the forward a request ran in, as its prefill reported them (1: alone, or not
    said): they waited for one queue, one observation of it between them (``Corrections.note_met``)."""
    jobs = forward[3] if forward is not None else 1.0
    return jobs if isinstance(jobs, (int, float)) and 1.0 <= jobs < math.inf else 1.0


def _log_shift(old, new, role: str) -> float:
    """Mean log(new / old) of two models' predictions over a spread of shapes (0: none usable)."""
    pairs = ([(old.predict(n), new.predict(n)) for n in (64, 256, 1024, 4096)] if role == "prefill" else
             [(old.predict(b, b * c), new.predict(b, b * c)) for b in (1, 4, 32) for c in (256, 2048)])
    logs = [math.log(b / a) for a, b in pairs if positive(a) and positive(b)]
    return sum(logs) / len(logs) if logs else 0.0


def _node(inst: Instance) -> str:
    return inst.reg.http.rsplit(":", 1)[0]
