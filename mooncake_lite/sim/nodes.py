"""Simulated prefill and decode instances: queues, stores and batches, no policy of their own
beyond what the real roles do (FIFO prefill, the decode's local SLO double check).

What the conductor sees of each instance is kept by the scheduler's own instance views
(``scheduler/view.py``), the class the live conductor's Membership drives: the simulator tells
them the same events (a job queued, started, ended; a request committed, its KV arrived, tokens
generated, finished), so its snapshots are built by the conductor's code."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence

from mooncake_lite.scheduler.admission import Held, held_load_at, tbt_refusal
from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.scheduler.queue_order import enqueue
from mooncake_lite.scheduler.state import DecodeInstanceState, PrefillInstanceState
from mooncake_lite.scheduler.view import DecodeView, PrefillView
from mooncake_lite.sim.batch import Batch
from mooncake_lite.sim.costs import Hardware
from mooncake_lite.store.eviction import BlockCache
from mooncake_lite.sim.events import EventQueue
from mooncake_lite.sim.request import SimRequest
from mooncake_lite.sim.store import NodeStore


def cached_prefix(cache: BlockCache | NodeStore, keys: Sequence[Hashable]) -> int:
    """Leading keys held, without touching them (the touch happens once, at insert)."""
    n = 0
    for key in keys:
        if key not in cache:
            break
        n += 1
    return n


def cpp_prefill_seconds(hw: Hardware, num_tokens: int, prefix_tokens: int, group_size: int,
                        chunk: int) -> float:
    """Prefill on a CPP group of ``group_size`` nodes: the new tokens are cut into chunks of
    ``chunk`` tokens that flow through ``group_size`` pipeline stages (each owns 1/X of the
    layers), so c chunks take (c + X − 1) stage-times of T/(c·X) each. One chunk: no gain."""
    single = hw.prefill_seconds(num_tokens, prefix_tokens)
    if group_size == 1:
        return single
    chunks = max(1, math.ceil((num_tokens - prefix_tokens) / chunk))
    return single * (chunks + group_size - 1) / (chunks * group_size)


def cpp_cost_model(hw: Hardware, group_size: int, chunk: int) -> PrefillCostModel | None:
    """What a CPP group would report after profiling itself: the scheduler's prefill model fitted
    to the group's true times (None for single nodes: the cluster default is exact)."""
    if group_size == 1:
        return None
    samples = [(n, p, cpp_prefill_seconds(hw, n, p, group_size, chunk))
               for n in (512, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
               for p in (0, n // 4, n // 2, 3 * n // 4)]
    return PrefillCostModel.fit(samples)


class PrefillNode:
    """One prefill instance (a CPP group of nodes) with its node store and inbound link."""

    def __init__(self, instance_id: str, cache: NodeStore, hw: Hardware, group_size: int, chunk: int,
                 cost: PrefillCostModel | None, batch_tokens: int = 0, overtakes: int = 0) -> None:
        self.instance_id = instance_id
        self.store_id = instance_id
        self.cache = cache
        self.hw = hw
        self._idle_hw, self._busy_hw = hw.in_state(busy=False), hw.in_state(busy=True)   # its true speed by state
        self.group_size = group_size
        self.chunk = chunk
        self.cost = cost
        # Prefill batching, as the live role: its --prefill-batch-tokens capped at its chunk, off
        # in a CPP group; registered with the conductor's view, which prices the queue packed.
        self.pack_tokens = min(batch_tokens, chunk) if batch_tokens > 0 and group_size == 1 else 0
        self.waiting: deque[SimRequest] = deque()
        self.current: SimRequest | None = None
        self.packed: list[SimRequest] = []      # prefill batching: the others in current's forward
        self.link_free_at = 0.0
        self.busy_s = 0.0
        self.overtakes = overtakes     # the queue order's bound (0: FIFO), registered with the view too
        self.view = PrefillView(instance_id, self.store_id, None, cost, self.pack_tokens, overtakes)

    def fetch(self, now: float, num_bytes: int) -> float:
        """Reserve the inbound link for a KV fetch; returns when it completes (FIFO link)."""
        start = max(now, self.link_free_at)
        self.link_free_at = start + num_bytes / self.hw.network_bytes_per_s
        return self.link_free_at

    def true_seconds(self, num_tokens: int, prefix_tokens: int, busy: bool = False) -> float:
        """A forward's time, started with its node ``busy`` or idle (``Hardware.in_state``)."""
        hw = self._busy_hw if busy else self._idle_hw
        return cpp_prefill_seconds(hw, num_tokens, prefix_tokens, self.group_size, self.chunk)

    def state(self) -> PrefillInstanceState:
        """The conductor's view: the running job (with its start) and the FIFO behind it."""
        return self.view.state()

    def enqueue(self, req: SimRequest) -> None:
        """Dispatched here, with the prefix the decision planned to reuse: behind the others, or
        where the queue order lands it (scheduler/queue_order.py, ordered by that prefix as the
        live instance orders by the prefix the conductor names)."""
        self.waiting.append(req)
        order = enqueue(self.view, req.rid, req.input_length, req.planned_prefix_tokens, self.overtakes,
                        None, req.pack_cap)
        if order:
            waiting = {r.rid: r for r in self.waiting}
            self.waiting = deque(waiting[rid] for rid in order if rid in waiting)

    def num_jobs(self) -> int:
        """Jobs queued or running here (a packed forward's each)."""
        return len(self.waiting) + (self.current is not None) + len(self.packed)

    def begin(self, now: float) -> SimRequest:
        """The head of the FIFO starts."""
        req = self.current = self.waiting.popleft()
        req.prefill_start = now
        self.view.start(req.rid, now)
        return req

    def begin_packed(self, now: float) -> SimRequest:
        """The next in the FIFO starts too, packed into the running forward."""
        req = self.waiting.popleft()
        self.packed.append(req)
        req.prefill_start = now
        self.view.start(req.rid, now)
        return req

    def report_end(self, now: float, report: tuple[SimRequest, float]) -> None:
        """The live prefill's heartbeat after its first chunk (``scheduler/progress.py``): the
        conductor prices the job to end when it will. Here the end is known exactly and heard
        at the first chunk's end; live it is estimated from the chunks done and heard at the
        next heartbeat (up to ``--heartbeat-interval`` later)."""
        req, ends_at = report
        if self.current is req:
            self.view.report_end(req.rid, ends_at)

    def end(self) -> SimRequest:
        """The running prefill is done."""
        req, self.current = self.current, None
        assert req is not None   # called for a running prefill only
        self.view.remove(req.rid)
        return req

    def end_packed(self) -> list[SimRequest]:
        """The others of the running forward are done with it."""
        done, self.packed = self.packed, []
        for req in done:
            self.view.remove(req.rid)
        return done


class DecodeNode:
    """One decode instance: KV arrivals wait for the next step boundary, then join the batch."""

    def __init__(self, instance_id: str, batch: Batch, events: EventQueue, max_batch: int | None,
                 max_context_tokens: int | None, on_finish: Callable[[float, SimRequest], None]) -> None:
        self.instance_id = instance_id
        self.colocated = 1.0                         # the co-location slowdown now (rescale)
        self.writes: dict[str, float] = {}           # prefill id -> the stretch its forward's KV writes add
        self.write_wait = 0.0                        # KV writes a forward left for the next join (written)
        self.batch = batch
        self.events = events
        self.max_batch = max_batch
        self.max_context_tokens = max_context_tokens
        self.on_finish = on_finish
        self.pending: list[SimRequest] = []          # KV arrived, joining at the next step boundary
        self.pending_tokens = 0                      # their contexts (prompt + first token each)
        self.committed: dict[str, SimRequest] = {}   # dispatched here, KV not yet arrived
        self.committed_tokens = 0                    # their prompts' tokens
        self.held: dict[str, float] = {}             # requests holding a KV reservation here: when their KV is due
        self.reserved_tokens = 0                     # prompt + max_tokens of each of them
        self.seg_start = 0.0
        self.seg_gap = 0.0
        self.seg_steps = 0          # steps planned for the running segment (0 = idle)
        self.version = 0
        # What the conductor sees, as the live one would: requests committed here (KV to
        # come) and, from their KV's arrival, running — whether or not they have reached a step
        # boundary yet; it has the instance's own cost model, as a live decode reports it.
        self.view = DecodeView(instance_id, batch.model, max_batch, max_context_tokens)

    def state(self) -> DecodeInstanceState:
        return self.view.state()

    def refusal(self, req: SimRequest, tbt_slo_s: float | None, tbt_slo_factor: float | None = None,
                now: float = 0.0, kv_in_s: float | None = None) -> str | None:
        """The live decode's check at reservation (``decode/batcher.check_admit``): room for
        prompt + max_tokens beside every reservation held, then the shared TBT check on what still
        decodes when its KV is due in ``kv_in_s`` (None: everything held: running, waiting for the
        step boundary or for KV); against ``tbt_slo_s``, else ``tbt_slo_factor`` x one step of the
        request alone (the live decode's default). None: admitted."""
        if self.max_context_tokens is not None and \
                self.reserved_tokens + req.input_length + req.max_tokens > self.max_context_tokens:
            return "reserve-kv"
        held, context = self._held_load()
        if self.max_batch is not None and held >= self.max_batch:
            return "reserve-batch"
        model, n, exact = self.batch.model, req.input_length, kv_in_s is not None
        # Everything held at once first: what still decodes when its KV is due is a part of it (no
        # more sequences nor context, so no slower step where the model grows with both), counted
        # only when that refuses — the simulator's per-request cost (issue #31).
        if (not exact or (model.c1 >= 0.0 and model.c2 >= 0.0)) and \
                tbt_refusal(model, held, context, n, tbt_slo_s, tbt_slo_factor) is None:
            return None
        if kv_in_s is not None:
            held, context = held_load_at(self._held_seqs(now), model, now, now + kv_in_s)
            if tbt_refusal(model, held, context, n, tbt_slo_s, tbt_slo_factor) is None:
                return None
        return "reserve-tbt"

    def _held_load(self) -> tuple[int, int]:
        """(sequences, context tokens) of everything here: running, waiting for the next step
        boundary, or dispatched here with KV still to come."""
        held = len(self.batch) + len(self.pending) + len(self.committed)
        return held, self.batch.context_tokens + self.pending_tokens + self.committed_tokens

    def _held_seqs(self, now: float) -> list[Held]:
        """Everything here as the live decode's check reads it (``scheduler/admission.Held``), with
        the contexts :meth:`_held_load` sums: running (steps run since the last boundary counted
        off its tokens left) or about to, from ``now``; KV to come, from when it is due."""
        steps, done = self._steps_done(now), self.batch.steps_done
        seqs: list[Held] = [(now, r.max_tokens - 1 - (done - r.join_step) - steps,
                             r.input_length + 1 + done - r.join_step) for r in self.batch.running.values()]
        seqs += [(now, r.max_tokens - 1, r.input_length + 1) for r in self.pending]
        due = self.held
        seqs += [(due.get(rid, now), r.max_tokens, r.input_length) for rid, r in self.committed.items()]
        return seqs

    def _steps_done(self, now: float) -> int:
        """Steps of the running segment done by ``now`` (0 when idle)."""
        if not self.seg_steps:
            return 0
        return min(self.seg_steps, math.floor((now - self.seg_start) / self.seg_gap + 1e-9))

    def held_step_time(self) -> float:
        """The step time with everything held here decoding at once (the reservation check's bound)."""
        held, context = self._held_load()
        return self.batch.model.predict(held, context) if held else 0.0

    def hold(self, req: SimRequest, kv_due: float) -> None:
        """Reserve KV room for the whole request (prompt + max_tokens), as the live decode does;
        its KV is due at ``kv_due`` (the decision's predicted first token)."""
        self.held[req.rid] = kv_due
        self.reserved_tokens += req.input_length + req.max_tokens

    def release(self, req: SimRequest) -> None:
        if self.held.pop(req.rid, None) is not None:
            self.reserved_tokens -= req.input_length + req.max_tokens

    def commit(self, req: SimRequest) -> None:
        """Dispatched here: incoming until its KV arrives (``input + 1`` tokens of it); the
        conductor sizes its t_d with the output it expects (max_tokens or a prediction)."""
        self.committed[req.rid] = req
        self.committed_tokens += req.input_length
        self.view.commit(req.rid, req.input_length + 1, req.expected_output)

    def uncommit(self, req: SimRequest) -> None:
        if self.committed.pop(req.rid, None) is not None:
            self.committed_tokens -= req.input_length
        self.view.uncommit(req.rid)

    def arrive(self, now: float, req: SimRequest) -> None:
        """KV fully received: join at the next step boundary (now, if idle)."""
        self.pending.append(req)
        self.pending_tokens += req.input_length + 1
        self.view.join(req.rid, req.input_length + 1, now, req.expected_output)
        if self.seg_steps == 0:
            self._boundary(now, self.version)
            return
        self._cut(now)

    def rescale(self, now: float, factor: float) -> None:
        """Steps take ``factor`` × their time from the next step boundary on (``Batch.scale``)."""
        self.colocated = factor
        self._stretch(now)

    def writing(self, now: float, prefill_id: str, stretch: float) -> None:
        """A forward of ``prefill_id`` streams KV here, written in this model thread as it comes:
        steps take ``1 + stretch`` × their time from the next step boundary (``sim/cluster.py``)."""
        self.writes[prefill_id] = stretch
        self._stretch(now)

    def written(self, now: float, prefill_id: str, left: float) -> None:
        """That forward is over, ``left`` seconds of its writes still to do: the next join waits."""
        self.writes.pop(prefill_id, None)
        self.write_wait += left
        self._stretch(now)

    def _stretch(self, now: float) -> None:
        # a slowdown other than 1 is set only while a prefill computes (MooncakeSim._colocate)
        self.batch.scale(self.colocated * (1.0 + sum(self.writes.values())), self.colocated != 1.0)
        if self.seg_steps:
            self._cut(now)

    def _cut(self, now: float) -> None:
        """End the running segment at the first step boundary after ``now``."""
        cut = min(self._steps_done(now) + 1, self.seg_steps)
        if cut < self.seg_steps:
            self.seg_steps = cut
            self.version += 1
            self.events.push(self.seg_start + cut * self.seg_gap, self._boundary, self.version)

    def _boundary(self, now: float, version: int) -> None:
        """A step boundary (an event, or a join while idle): a boundary of an older ``version``
        was cut short by a later one and does nothing."""
        if version != self.version:
            return
        b, view = self.batch, self.view
        if self.seg_steps:
            view.progress_group(self.seg_steps)     # the batch's members: the view's step group
            for req in b.advance(self.seg_steps, self.seg_gap):
                view.leave(req.rid)
                self.release(req)
                req.finish = now
                self.on_finish(now, req)
        if self.pending and self.write_wait:   # writes a forward could not hold: the join waits for them
            wait, self.write_wait = self.write_wait, 0.0
            b.stall(wait)
            now += wait
        for req in self.pending:
            b.add(req, now)
            view.enter_group(req.rid)
        self.pending = []
        self.pending_tokens = 0
        if not b.running:
            self.seg_steps = 0
            return
        self.seg_start, self.seg_gap = now, max(b.step_time(), 1e-9)
        self.seg_steps = b.steps_to_next_finish()
        self.version += 1
        self.events.push(now + self.seg_steps * self.seg_gap, self._boundary, self.version)


# At most this share of a decode's model thread goes to one forward's KV writes while it runs (a
# prompt mostly cached streams its prefix in a short forward); the rest waits for the join.
MAX_WRITE_SHARE = 0.5


def write_charges(now: float, p: PrefillNode, duration: float, decodes: Mapping[Hashable, DecodeNode],
                  per_token: float) -> list[tuple[DecodeNode, float]]:
    """The forward ``p`` just started streams its prompts' KV layer by layer, each frame written in
    its decode's model thread as it comes (``decode/engine.py``): over the forward a decode loses
    those seconds, its steps stretched by 1 / (1 − their share of it); past ``MAX_WRITE_SHARE``
    the rest is written after the forward, and the join waits for it (``DecodeNode.written``).
    Returns each decode charged and the seconds it has left to write when the forward ends."""
    head = p.current
    assert head is not None   # the forward just started
    seconds: dict[str, float] = {}
    for req in (head, *p.packed):
        decode_id = req.decode_id
        assert decode_id is not None   # placed before it was queued
        seconds[decode_id] = seconds.get(decode_id, 0.0) + per_token * req.input_length
    charged: list[tuple[DecodeNode, float]] = []
    for decode_id, total in seconds.items():
        d = decodes[decode_id]
        share = min(total / duration, MAX_WRITE_SHARE)
        d.writing(now, p.instance_id, share / (1.0 - share))
        charged.append((d, max(0.0, total - MAX_WRITE_SHARE * duration)))
    return charged
