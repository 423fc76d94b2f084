"""The simulator's online correction (issue #36): the live conductor's rule
(``scheduler/correction.py``), fed by the simulated requests, shown to the simulated conductor's
views as the live conductor shows it to its own (``conductor/flight/predictions.py``).

Each request placed on a prefill leaves what was predicted for it: its own forward (the
uncorrected model's), its queue and, on a shortest-first instance, the queue's overtake
allowance (the worst case and the share it was priced with). At its first token the simulator
knows its wait (ready to started) and its forward (started to first token): the compute factor
and the overtake share move by the same :class:`~mooncake_lite.scheduler.correction.Corrections`
as live, each residual fed once. The prefill's model is shown as its compute line only,
and no ``queue`` factor is learned: the simulator's conductor sees its queue exactly (FIFO is
then priced right); only what later arrivals will do is unknown, which the share learns. A decode
is corrected as live, by the ``decode`` term (a request's mean gap over the step predicted: the
step spread's mean, the KV writes and the batch mates that join mid-decode, none of which the
batch foreseen at the first token holds; its steps beside a prefill are not told apart) and the
``tail`` (its TBT over its mean gap). Both roles learn their spread, measured / predicted TTFT at
the first token and TBT at the end (``Corrections.note_ratio``); the TTFT's is shown to the
prefill's view (admission's bound), the TBT's kept only, as live.
Off unless ``SimConfig.correct``: the recorded decision digests are without it.
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncake_lite.scheduler import CostModels, Decision
from mooncake_lite.scheduler.correction import Corrections
from mooncake_lite.scheduler.costs import scaled
from mooncake_lite.scheduler.correction_shown import model_moved, show_queue_bound, show_shares, show_start, show_tail
from mooncake_lite.scheduler.packing import forward_seconds
from mooncake_lite.scheduler.queue_order import worst_cases
from mooncake_lite.scheduler.wait_spread import ShownWait
from mooncake_lite.sim.nodes import DecodeNode, PrefillNode
from mooncake_lite.sim.request import SimRequest


class SimCorrecting:
    """What the simulated conductor predicted per request, and the corrections it learns."""

    def __init__(self, costs: CostModels, prefills: Sequence[PrefillNode] = (),
                 corrections: Corrections | None = None) -> None:
        self.costs = costs
        self.corrections = corrections or Corrections()
        for p in prefills:   # their views show the correction's start, not the worst case
            show_start(p.view)
        # request id -> (own forward uncorrected, queue predicted, overtake allowance used, its worst
        # case, TTFT predicted, join allowance used, its worst case, the scale and offset shown)
        self._predicted: dict[str, tuple[float, ...]] = {}
        self._tbt: dict[str, tuple[float, float]] = {}   # request id -> its predicted TBT and step
        self._shown: dict[str, float] = {}       # instance id -> the scale its view's model has
        self._offset: dict[str, float] = {}      # prefill id -> the seconds it adds per forward

    def placed(self, req: SimRequest, d: Decision, p: PrefillNode, dn: DecodeNode) -> None:
        """``req`` was placed on ``p`` and ``dn`` by ``d`` (its prefix: ``req.planned_prefix_tokens``)."""
        scale, offset = self._shown.get(p.instance_id, 1.0), self._offset.get(p.instance_id, 0.0)
        own = max(d.predicted_prefill_s / scale - offset, 0.0)   # its forward (its pack's), uncorrected
        model, n, prefix = scaled(p.cost or self.costs.prefill, scale, offset), req.input_length, \
            req.planned_prefix_tokens
        full, join = worst_cases(model, p.overtakes, p.pack_tokens, n, prefix, p.view.state().recent_uncached,
                                 d.predicted_queue_s, p.view.join_share)
        self._predicted[req.rid] = (own, d.predicted_queue_s, full * p.view.overtake_share, full,
                                    d.predicted_ttft_s or 0.0, join * p.view.join_share, join, scale, offset)
        if d.predicted_tbt_s is not None:    # and the step it was made of, on the model uncorrected
            shown = dn.view.tail * self._shown.get(dn.instance_id, 1.0)
            self._tbt[req.rid] = (d.predicted_tbt_s, d.predicted_tbt_s / shown)

    def shifted(self, rid: str, shift_s: float) -> None:
        """``rid``'s forward moved by ``shift_s`` (shown seconds) once its burst was placed
        (``SimCluster._reprice``): its own forward and TTFT predicted move with it, as live."""
        predicted = self._predicted.get(rid)
        if predicted is not None:
            own, queue_s, overtake_s, full, ttft_s, join_s, join_full, scale, offset = predicted
            self._predicted[rid] = (max(own + shift_s / scale, 0.0), queue_s, overtake_s, full, ttft_s + shift_s,
                                    join_s, join_full, scale, offset)

    def first_token(self, req: SimRequest, p: PrefillNode, now: float,
                    forward: tuple[float, float] = (0.0, 1.0)) -> None:
        """``req``'s prefill on ``p`` ended at ``now``: correct ``p`` by it, and show the result.
        ``forward``: the computed tokens and jobs of the forward it ran in (as the live prefill reports)."""
        predicted = self._predicted.pop(req.rid, None)
        if predicted is None or req.prefill_start is None:
            return
        own, queue_s, overtake_s, full, ttft_s, join_s, join_full, scale, offset = predicted
        waited, took = req.prefill_start - req.ready_at, now - req.prefill_start
        c, iid = self.corrections, p.instance_id
        ran = forward_seconds(p.cost or self.costs.prefill, req.input_length, req.reused_tokens, *forward) \
            if forward[0] else own     # its speed on the forward that ran: joiners are no slowdown
        c.observe(iid, "compute", ran, took)
        speed = took / (ran + offset) if ran > 0 and took > 0 else None
        c.note_met(iid, wait_s=max(queue_s - overtake_s - join_s, 0.0), overtake_full_s=full, measured_queue_s=waited,
                   speed=None if speed is None else speed / scale, own_s=own * scale, join_full_s=join_full,
                   ran_s=ran * scale)     # (on the model shown)
        c.note_ratio(iid, "ttft", ttft_s, now - req.arrival)
        c.note_wait(iid, ShownWait(queue_s, own * scale, overtake_s, join_s, full, join_full, scale), waited)
        self._show(p)

    def finished(self, req: SimRequest, d: DecodeNode) -> None:
        """``req`` completed on ``d``: its TBT against the predicted one, kept for the decode's
        measured spread (not shown to the scheduler, as live: admission does not judge it); its
        mean gap against the step predicted, and its TBT over its mean gap, which move the
        decode's model and tail as its view shows them."""
        predicted = self._tbt.pop(req.rid, None)
        if predicted is None or req.tbt is None:
            return
        c, iid, (tbt, step) = self.corrections, d.instance_id, predicted
        c.note_ratio(iid, "tbt", tbt, req.tbt)
        if req.mean_gap is None:
            return
        c.observe(iid, "decode", step, req.mean_gap)
        c.observe(iid, "tail", req.mean_gap, req.tbt)    # its TBT over its mean gap
        scale = c.decode_scale(iid)
        if model_moved(scale, 0.0, self._shown.get(iid, 1.0), 0.0, 0.0):
            self._shown[iid] = scale
            d.view.set_cost(scaled(d.batch.model, scale))
        show_tail(c, iid, d.view)

    def _show(self, p: PrefillNode) -> None:
        """``p``'s view as the live conductor's shows it: the model as its compute line, and the
        overtake share, each once it moved by more than ``SHOW_TOLERANCE``."""
        c, iid, view = self.corrections, p.instance_id, p.view
        scale, offset, model = c.prefill_scale(iid), c.prefill_offset(iid), p.cost or self.costs.prefill
        if model_moved(scale, offset, self._shown.get(iid, 1.0), self._offset.get(iid, 0.0), model.c0):
            self._shown[iid], self._offset[iid] = scale, offset
            view.set_instance(p.store_id, None, scaled(model, scale, offset), p.pack_tokens, p.overtakes)
        show_queue_bound(c, iid, view)
        show_shares(c, iid, view)

