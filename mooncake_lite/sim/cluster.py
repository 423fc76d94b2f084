"""The Mooncake cluster simulation: the conductor's scheduling core driven by simulated time.

Per request: arrival → ``Scheduler.schedule`` (the live conductor's code, unchanged) → reject,
or (optional hot-spot migration over the target's inbound link) → FIFO prefill on the chosen
instance (reusing what its store really holds when the job starts) → KV stream to the chosen
decode instance (overlapped with prefill, layer-wise) → continuous batching until the last
token. The decode's own double check runs where ``SimConfig.decode_check`` says: at dispatch
(``reserve``, as the live decode) or when the KV arrives (``arrival``, the paper's).
The conductor knows ``max_tokens`` and a predicted output length, never the true one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace

from mooncake_lite.scheduler import (ClusterState, CostModels, Decision, Scheduler, ScheduleRequest,
                                     decode_admits)
from mooncake_lite.sim.batch import Batch
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import Hardware, get_hardware
from mooncake_lite.sim.driver import TraceDriver
from mooncake_lite.sim.events import EventQueue
from mooncake_lite.sim.load import load_sample
from mooncake_lite.sim.nodes import DecodeNode, PrefillNode, cpp_cost_model, write_charges
from mooncake_lite.scheduler.costs import pack_sizes, packed_seconds, uncached_tokens
from mooncake_lite.scheduler import arrivals
from mooncake_lite.scheduler.admission import slo_limits as request_limits
from mooncake_lite.scheduler.correction import holds_requests, node_busy
from mooncake_lite.scheduler.predict import OutputPredictor
from mooncake_lite.scheduler.prediction_accuracy import PredictionAccuracy
from mooncake_lite.scheduler.snapshot import StateTuple
from mooncake_lite.sim.recorder import Recorder, SimResult
from mooncake_lite.sim.correcting import SimCorrecting
from mooncake_lite.sim.request import MaxTokensPolicy, SimRequest
from mooncake_lite.sim.store import NodeStore, store_chain
from mooncake_lite.trace.format import TraceRequest


class MooncakeSim(TraceDriver):
    """One run over one trace. ``run()`` returns a :class:`SimResult`; every request ends
    exactly once, as completed or rejected."""

    def __init__(self, cfg: SimConfig, hardware: Hardware | None = None,
                 scheduler: Scheduler | None = None) -> None:
        self.cfg = cfg
        hw = hardware or get_hardware(cfg.hardware)
        self.hw = hw = hw.with_prefill_chunk(cfg.prefill_chunk) if cfg.prefill_chunked else hw
        self.block_size = cfg.scheduler.block_size
        self.costs = CostModels(prefill=hw.prefill, decode=hw.decode, kv_bytes_per_token=hw.kv_bytes_per_token,
                                bandwidth_bytes_per_s=hw.network_bytes_per_s)
        self.scheduler = scheduler or Scheduler(cfg.scheduler, self.costs, rng=random.Random(cfg.seed))
        self.events = EventQueue()
        self.prefills, self.decodes = self._nodes()
        # keyed as the scheduler names stores (a Decision's ``transfer_source`` is any Hashable)
        self.prefill_by_id: dict[Hashable, PrefillNode] = {p.instance_id: p for p in self.prefills}
        self.decode_by_id: dict[Hashable, DecodeNode] = {d.instance_id: d for d in self.decodes}
        # None: relative, as the live conductor's defaults (factor x the request alone: slo_limits)
        self.ttft_slo_s: float | None = cfg.scheduler.ttft_slo_s
        self.tbt_slo_s: float | None = cfg.scheduler.tbt_slo_s
        # the decode's own check takes the conductor's factor, as `mooncake up`'s decodes do by default
        self.tbt_slo_factor: float | None = cfg.scheduler.tbt_slo_factor if self.tbt_slo_s is None else None
        # a snapshot rebuilds only the entries of the instances whose view changed
        self._states = (StateTuple(p.view for p in self.prefills), StateTuple(d.view for d in self.decodes))
        self.scheduler.cache.follow(*self._states)
        self.recorder = Recorder(self, cfg.sample_interval_s)
        self.decisions: list[Decision] | None = None   # set to [] to keep every decision (tests)
        self.max_tokens_policy = MaxTokensPolicy.parse(cfg.max_tokens_policy)
        self.predictor = OutputPredictor() if cfg.predict_output else None
        self.accuracy = PredictionAccuracy()
        self.refused = {"conductor": 0, "prefill": 0, "decode": 0}   # rejections so far, by stage
        # One box (Hardware.decode_colocated_slowdown != 1): decodes slow while any prefill computes.
        self.slowdown = hw.decode_colocated_slowdown
        self._prefilling = False
        self._writes: dict[str, list[tuple[DecodeNode, float]]] = {}   # prefill id -> (decode, s left): write_charges
        # the conductor's online correction, as live (sim/correcting.py); None: off
        self.correcting: SimCorrecting | None = SimCorrecting(self.costs, self.prefills) \
            if cfg.correct else None
        self._held: list[SimRequest] = []   # a burst waiting for its window to close (arrivals.py)
        # read per request: native attributes (the config is a plain dataclass: a dict lookup each)
        self._window: float = cfg.burst_window_s
        self._reserve: bool = cfg.decode_check == "reserve"
        self._local_ttft_check: bool = cfg.local_ttft_check
        self.held_s: dict[int, float] = {}   # request id -> how long it was held (the client waited that too)
        self.burst_shift_s: dict[int, float] = {}   # request id -> its TTFT's move once its burst was placed

    def _nodes(self) -> tuple[list[PrefillNode], list[DecodeNode]]:
        """The prefill instances (CPP groups, each with its node store) and the decode nodes."""
        cfg, hw = self.cfg, self.hw
        capacity = cfg.store_blocks_per_node
        if capacity is None:   # the hardware's: a live store's slots (its profile), else its DRAM
            capacity = hw.dram_blocks() * cfg.cpp_group_size
        group_cost = cpp_cost_model(hw, cfg.cpp_group_size, cfg.prefill_chunk)
        ssd = (hw.ssd_blocks() if cfg.ssd_blocks_per_node is None else cfg.ssd_blocks_per_node) * cfg.cpp_group_size
        eviction = cfg.eviction or hw.eviction or "lru"
        prefills = [PrefillNode(f"P{i}", NodeStore(capacity, ssd, eviction), hw, cfg.cpp_group_size,
                                cfg.prefill_chunk, group_cost, cfg.prefill_batch_tokens, cfg.prefill_queue_overtakes)
                    for i in range(cfg.num_prefill)]
        decodes = [DecodeNode(f"D{i}", Batch(hw.decode, hw.decode_step_ratios, hw.decode_padding_s_per_token,
                                              hw.decode_busy_step_ratios),
                              self.events, cfg.decode_max_batch,
                              hw.decode_max_context_tokens, self._finish)
                   for i in range(cfg.num_decode)]
        return prefills, decodes

    def run(self, trace: Iterable[TraceRequest], progress: Callable[[int], None] | None = None) -> SimResult:
        res = super().run(trace, progress)
        res.extra["output_prediction"] = self.accuracy.to_dict()
        res.extra["held_s"] = self.held_s
        res.extra["burst_shift_s"] = self.burst_shift_s
        return res

    # ---- conductor ---------------------------------------------------------------------------
    def cluster_state(self) -> ClusterState:
        """What the conductor sees of every instance (their views' states)."""
        return ClusterState(self._states[0].states(), self._states[1].states())

    def _hold(self, now: float, req: SimRequest) -> bool:
        """Whether ``req`` waits with the rest of its burst (``scheduler/arrivals.py``) till the
        window its burst's first member opened closes."""
        window = self._window
        if not self._held and not arrivals.holds(self.cluster_state(), window):
            return False
        if not self._held:
            self.events.push(now + window, self._release_burst)
        self._held.append(req)
        return True

    def _release_burst(self, now: float, _: object) -> None:
        burst, self._held = self._held, []
        uncached = [arrivals.uncached_now(self.scheduler.index, ScheduleRequest(r.rid, r.keys, r.input_length, 1),
                                          self.block_size) for r in burst]
        order, kept = arrivals.decision_order(uncached), self.decisions
        start = len(kept) if kept is not None else 0
        for i in order:
            self.held_s[burst[i].request_id] = now - burst[i].arrival
            self._arrive(now, burst[i], True)
        self._reprice([burst[i] for i in order if burst[i].prefill_id is not None])
        if kept is not None:   # kept in arrival order, as every other request's
            decided = kept[start:]
            for k, i in enumerate(order):
                kept[start + i] = decided[k]

    def _reprice(self, placed: list[SimRequest]) -> None:
        """A burst's members placed (decision order) with their forwards as the burst left them, as
        live (``scheduler.arrivals.burst_shifts``, ``conductor/flight/arrivals.reprice``)."""
        if len(placed) < 2:
            return
        by_id, default = self.prefill_by_id, self.costs.prefill

        def queue(pid: str) -> tuple:
            state = by_id[pid].view.state()
            return state.queue, by_id[pid].pack_tokens, state.cost or default
        shifts = arrivals.burst_shifts([(r.rid, r.prefill_id or "") for r in placed], queue)
        for r in placed:
            shift = shifts.get(r.rid)
            if shift is not None:
                self.burst_shift_s[r.request_id] = shift
                r.predicted_ttft = (r.predicted_ttft or 0.0) + shift
                if self.correcting is not None:
                    self.correcting.shifted(r.rid, shift)

    def _arrive(self, now: float, req: SimRequest, released: bool = False) -> None:
        if self._window > 0 and not released and self._hold(now, req):   # held for its burst
            return
        req.send_with(self.max_tokens_policy)
        if self.predictor is not None:
            req.expected_output = self.predictor.predict(req.keys, req.input_length, req.max_tokens)
        sreq = ScheduleRequest(req.rid, req.keys, req.input_length, req.max_tokens)
        decision = self._decide(now, req, sreq)
        if self.decisions is not None:
            self.decisions.append(decision)
        if not decision.accepted:
            return self._reject(now, req, "conductor", decision.reject_cause)
        d = self.decode_by_id[decision.decode_id]
        if self._reserve:   # the live conductor reserves decode before prefill, telling it the TTFT foreseen
            kv_in = decision.predicted_ttft_s
            if (cause := d.refusal(req, self.tbt_slo_s, self.tbt_slo_factor, now, kv_in)) is not None:
                return self._reject(now, req, "decode", cause)
            d.hold(req, now if kv_in is None else now + kv_in)
        if (self._local_ttft_check and decision.predicted_ttft_s is not None
                and decision.predicted_ttft_s > self._ttft_limit(req.input_length, decision.prefill_id)):
            d.release(req)
            return self._reject(now, req, "prefill", "ttft")
        p = self.prefill_by_id[decision.prefill_id]
        req.placed_busy = self._placed_busy(p)
        req.prefill_id, req.decode_id = decision.prefill_id, decision.decode_id
        req.predicted_ttft, req.pack_cap = decision.predicted_ttft_s, decision.pack_cap
        req.planned_prefix_tokens = min(decision.reused_prefix_blocks * self.block_size, req.input_length - 1)
        req.ready_at = now
        if (m := decision.migration) is not None and m.keys:
            self._migrate(now, req, p, m.source_store_id, len(m.keys), decision.reused_prefix_blocks)
        d.commit(req)
        if self.correcting is not None:
            self.correcting.placed(req, decision, p, d)
        p.enqueue(req)
        if p.current is None:
            self._start_prefill(now, p)

    def _migrate(self, now: float, req: SimRequest, p: PrefillNode, source, num_blocks: int, reused: int) -> None:
        """The decision's prefix, fetched from ``source``'s store over ``p``'s inbound link."""
        if (src := self.prefill_by_id.get(source)) is not None:
            src.cache.touch(req.keys[:reused])  # a read counts as a use
        req.ready_at = p.fetch(now, num_blocks * self.hw.block_bytes())
        req.fetched_blocks = reused
        self.recorder.migrated(num_blocks)

    def _decide(self, now: float, req: SimRequest, sreq: ScheduleRequest) -> Decision:
        """The conductor's decision (``sim/tenants.py`` adds each tenant's limits and priority)."""
        return self.scheduler.schedule(sreq, self.cluster_state(), now)

    # ---- prefill -----------------------------------------------------------------------------
    def _start_prefill(self, now: float, p: PrefillNode) -> None:
        if p.current is not None or not p.waiting:
            return
        req = p.waiting[0]
        if req.ready_at > now:  # FIFO: the head waits for its KV fetch
            self.events.push(req.ready_at, self._start_prefill, p)
            return
        p.begin(now)
        if self.slowdown != 1.0:
            self._colocate(now)
        if req.fetched_blocks:  # the migrated prefix landed in this node's store before the start
            self._store(p, req.keys[: req.fetched_blocks])
        busy = req.placed_busy
        duration = self._prefill_seconds(p, req, busy)
        if p.pack_tokens:
            duration = self._pack(now, p, req, duration, busy)
        if self.hw.decode_kv_write_s_per_token and duration > 0:   # KV written in the decodes as it streams
            self._writes[p.instance_id] = write_charges(now, p, duration, self.decode_by_id,
                                                        self.hw.decode_kv_write_s_per_token)
        p.busy_s += duration
        self.events.push(now + duration, self._prefill_done, p)
        uncached = uncached_tokens(req.input_length, req.reused_tokens)
        if not p.packed and uncached > p.chunk:   # run alone chunk by chunk: its end is reported
            first = p.true_seconds(req.reused_tokens + p.chunk, req.reused_tokens, busy)
            self.events.push(now + min(first, duration), p.report_end, (req, now + duration))

    def _placed_busy(self, p: PrefillNode) -> bool:
        """``p``'s node state as a job is placed on it, by the live conductor's rule (one box: every
        decode beside it). Read at a forward's start instead, a job behind another read idle and
        the slice ran 0.75x live's TTFT (docs/results/2026-12-04-xeon-2vcpu.md)."""
        return self.hw.prefill_busy is not None and node_busy(
            p.view.state(), any(holds_requests(d.view.state()) for d in self.decodes))

    def _prefill_seconds(self, p: PrefillNode, req: SimRequest, busy: bool = False) -> float:
        """Sets the prefix ``req`` reuses from the node's store; its true time alone, started
        with the node ``busy`` or idle."""
        hits, on_ssd = p.cache.prefix(req.keys)
        req.reused_tokens = min(hits * self.block_size, req.input_length - 1)
        duration = p.true_seconds(req.input_length, req.reused_tokens, busy)
        if on_ssd:  # the prefix load may outlast the compute it is overlapped with
            duration = max(duration, self.hw.prefix_load_seconds(req.reused_tokens, on_ssd * self.block_size))
        return duration

    def _pack(self, now: float, p: PrefillNode, head: SimRequest, head_s: float, busy: bool = False) -> float:
        """Prefill batching as the live instance does it (``scheduler.costs.pack_sizes``): the
        ready requests behind the head join its forward while their uncached tokens fit, under
        every member's cap; the forward takes ``packed_seconds`` of their times alone."""
        limit = p.pack_tokens
        uncached = [uncached_tokens(head.input_length, head.reused_tokens)]
        caps = [head.pack_cap]
        alone = [head_s]
        while p.waiting and p.waiting[0].ready_at <= now and uncached[0] <= limit:
            nxt = p.waiting[0]
            if nxt.fetched_blocks:   # its migrated prefix has landed (ready): in the store first
                self._store(p, nxt.keys[: nxt.fetched_blocks])
            hits, _ = p.cache.prefix(nxt.keys)
            n = uncached_tokens(nxt.input_length, min(hits * self.block_size, nxt.input_length - 1))
            caps.append(nxt.pack_cap)
            if pack_sizes(uncached + [n], limit, caps)[0] <= len(uncached):
                break
            p.begin_packed(now)
            alone.append(self._prefill_seconds(p, nxt, busy))
            uncached.append(n)
        return packed_seconds(alone, self.hw.in_state(busy).prefill.shared_c0)

    def _store(self, p: PrefillNode, keys: Sequence) -> None:
        store_chain(p.cache, self.scheduler.index, p.store_id, keys)

    def _prefill_done(self, now: float, p: PrefillNode) -> None:
        landed = None   # a request whose KV is at its decode now, and nothing else due before it
        if self.hw.decode_kv_write_s_per_token:
            for d, left in self._writes.pop(p.instance_id, []):   # its KV writes are over (write_charges)
                d.written(now, p.instance_id, left)
        forward = [p.end(), *p.end_packed()] if p.packed else [p.end()]
        computed = (float(sum(uncached_tokens(r.input_length, r.reused_tokens) for r in forward)), float(len(forward)))
        for req in forward:
            self._store(p, req.keys)
            req.first_token = now
            if self.correcting is not None:
                self.correcting.first_token(req, p, now, computed)
            if req.tokens_to_generate() <= 1:   # the model stopped at its first token: no decode
                d = self.decode_by_id[req.decode_id]
                d.uncommit(req)
                d.release(req)
                req.finish = now
                self._finish(now, req)
            else:
                kv_bytes = req.input_length * self.hw.kv_bytes_per_token
                start = req.prefill_start
                assert start is not None   # set by p.begin (a compiled build relies on the narrowing)
                arrival = max(now, start + kv_bytes / self.hw.network_bytes_per_s)
                # the stream overlapped the prefill (the usual case): its arrival is the next
                # event, handled below without the heap (one event a request fewer to push and pop)
                if landed is None and arrival == now and self.events.is_next(now):
                    landed = req
                else:
                    self.events.push(arrival, self._kv_arrived, req)
        self._start_prefill(now, p)
        if self.slowdown != 1.0:
            self._colocate(now)
        if landed is not None:
            self.events.run_next(self._kv_arrived, landed)

    def _colocate(self, now: float) -> None:
        """A one-box cluster: every decode's steps take ``slowdown`` × their time while any
        prefill computes, from their next step boundary (the live export's measured ratio)."""
        prefilling = any(p.current is not None for p in self.prefills)
        if prefilling != self._prefilling:
            self._prefilling = prefilling
            for d in self.decodes:
                d.rescale(now, self.slowdown if prefilling else 1.0)

    # ---- decode ------------------------------------------------------------------------------
    def _kv_arrived(self, now: float, req: SimRequest) -> None:
        d = self.decode_by_id[req.decode_id]
        d.uncommit(req)
        if not self._reserve:   # decode_check "arrival"
            sreq = ScheduleRequest(req.rid, req.keys, req.input_length, req.max_tokens)
            # on the decode's own model, as the live decode checks (its view's may be corrected)
            own = replace(d.state(), cost=d.batch.model)
            if not decode_admits(own, sreq, self.costs, self.tbt_slo_s, self.tbt_slo_factor):
                return self._reject(now, req, "decode", "tbt")
            d.hold(req, now)
        d.arrive(now, req)

    def _finish(self, now: float, req: SimRequest) -> None:
        req.status = "completed"
        if self.correcting is not None:
            self.correcting.finished(req, self.decode_by_id[req.decode_id])
        self.accuracy.add(req.expected_output, req.output_length)
        if self.predictor is not None:   # the client has the whole answer now, and so does the conductor
            self.predictor.observe(req.keys, req.input_length, req.output_length)
        self.recorder.ended(req)

    def _reject(self, now: float, req: SimRequest, stage: str, cause: str | None) -> None:
        req.status, req.reject_stage, req.reject_cause, req.finish = "rejected", stage, cause, now
        self.refused[stage] = self.refused.get(stage, 0) + 1
        self.recorder.ended(req)

    def slo_limits(self, num_tokens: int, prefill_id: Hashable | None = None) -> tuple[float, float]:
        """The (TTFT, TBT) limits of a prompt of ``num_tokens`` as the conductor judges it
        (``scheduler/admission.slo_limits``): the absolute SLOs, or factor x alone by that prefill's
        cost model as the conductor sees it (None: the cluster's) and the decodes' model."""
        p = self.prefill_by_id[prefill_id].state().cost if prefill_id is not None and self.ttft_slo_s is None else None
        return request_limits(self.cfg.scheduler, num_tokens, self.costs, p, None)

    def _ttft_limit(self, num_tokens: int, prefill_id: Hashable | None) -> float:
        """:meth:`slo_limits`' TTFT, read at once where it is absolute (once per request: the
        relative one's cost model look-up put the compiled simulator 0.5% over its budget)."""
        slo = self.ttft_slo_s
        return slo if slo is not None else self.slo_limits(num_tokens, prefill_id)[0]

    def sample(self, now: float) -> dict[str, float]:
        """Load as the paper plots it (``sim/load.py``)."""
        return load_sample(self, now)

    # ---- driver ------------------------------------------------------------------------------

