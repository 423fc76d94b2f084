"""Simulated prefill and decode instances: queues, stores and batches, no policy of their own
beyond what the real roles do (FIFO prefill, the decode's local SLO double check)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from itertools import compress, count
from operator import is_not

from mooncake_lite.scheduler.costs import PrefillCostModel
from mooncake_lite.scheduler.state import (DecodeInstanceState, DecodingRequest, IncomingRequest,
                                           PrefillInstanceState, QueuedPrefill)
from mooncake_lite.scheduler.view import MAX_TBT_DRIFT, context_lag_bound
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


def queued(r: SimRequest) -> QueuedPrefill:
    """The request as a queued prefill job, built once while waiting and once when started."""
    q = r.snap
    if q is None or q.started_at != r.prefill_start:
        q = r.snap = QueuedPrefill(r.rid, r.input_length, r.planned_prefix_tokens, r.prefill_start)
    return q



class PrefillNode:
    """One prefill instance (a CPP group of nodes) with its node store and inbound link."""

    def __init__(self, instance_id: str, cache: NodeStore, hw: Hardware, group_size: int, chunk: int,
                 cost: PrefillCostModel | None) -> None:
        self.instance_id = instance_id
        self.store_id = instance_id
        self.cache = cache
        self.hw = hw
        self.group_size = group_size
        self.chunk = chunk
        self.cost = cost
        self.waiting: deque[SimRequest] = deque()
        self.current: SimRequest | None = None
        self.link_free_at = 0.0
        self.busy_s = 0.0
        self._state: PrefillInstanceState | None = None

    def fetch(self, now: float, num_bytes: int) -> float:
        """Reserve the inbound link for a KV fetch; returns when it completes (FIFO link)."""
        start = max(now, self.link_free_at)
        self.link_free_at = start + num_bytes / self.hw.network_bytes_per_s
        return self.link_free_at

    def true_seconds(self, num_tokens: int, prefix_tokens: int) -> float:
        return cpp_prefill_seconds(self.hw, num_tokens, prefix_tokens, self.group_size, self.chunk)

    def state(self) -> PrefillInstanceState:
        """The conductor's view: the running job (with its start) and the FIFO behind it."""
        if self._state is None:
            jobs = [self.current] if self.current is not None else []
            jobs.extend(self.waiting)
            self._state = PrefillInstanceState(self.instance_id, self.store_id, tuple(queued(r) for r in jobs),
                                               None, self.cost)
        return self._state

    def touched(self) -> None:
        self._state = None


class DecodeNode:
    """One decode instance: KV arrivals wait for the next step boundary, then join the batch."""

    def __init__(self, instance_id: str, batch: Batch, events: EventQueue, max_batch: int | None,
                 max_context_tokens: int | None, on_finish: Callable[[float, SimRequest], None]) -> None:
        self.instance_id = instance_id
        self.batch = batch
        self.events = events
        self.max_batch = max_batch
        self.max_context_tokens = max_context_tokens
        self.on_finish = on_finish
        self.pending: list[SimRequest] = []
        self.committed: dict[str, SimRequest] = {}   # dispatched here, KV not yet arrived
        self._view: DecodeInstanceState | None = None
        self._base: DecodeInstanceState | None = None    # what conductor_view last showed, and
        self._shown: DecodeInstanceState | None = None   # with the TBT its t_d are sized with
        self.seg_start = 0.0
        self.seg_gap = 0.0
        self.seg_steps = 0          # steps planned for the running segment (0 = idle)
        self.version = 0
        self._state: DecodeInstanceState | None = None

    def state(self, now: float) -> DecodeInstanceState:
        if self._state is None:
            steps = self.batch.steps_done
            batch = self.batch.running.values()
            shown = [r for r in batch if r.snap_step >= 0]
            lag = sum(steps - r.snap_step for r in shown)
            refresh = lag > context_lag_bound(sum(r.snap.context_tokens for r in shown))
            running = []
            for r in batch:
                if r.snap_step < 0 or (refresh and r.snap_step != steps):
                    r.snap = DecodingRequest(r.rid, r.input_length + 1 + steps - r.join_step, r.join_time,
                                             r.output_length)
                    r.snap_step = steps
                running.append(r.snap)
            running.extend(DecodingRequest(r.rid, r.input_length + 1, now, r.output_length)
                           for r in self.pending)
            self._state = DecodeInstanceState(self.instance_id, tuple(running), self.max_batch,
                                              self.max_context_tokens)
        return self._state

    def conductor_view(self, now: float) -> DecodeInstanceState:
        """What the conductor sees: the local state plus, as ``incoming``, the requests it has
        dispatched here whose KV has not arrived yet (prefill queued/running or KV in transit),
        and the TBT its running requests' t_d are sized with: kept from the last view while
        the batch is the same or one request joined or left and its TBT moved less than
        MAX_TBT_DRIFT, else the batch's current one."""
        base = self._committed_view(now) if self.committed else self.state(now)
        if base is not self._base:
            running, shown = base.running, self._shown
            tbt = None if shown is None else shown.tbt_s
            if shown is None or running is not shown.running:
                current = self.batch.model.predict(len(running), sum(r.context_tokens for r in running))
                if shown is None or not _one_change(running, shown.running) or abs(current - tbt) > tbt * MAX_TBT_DRIFT:
                    tbt = current
            self._base, self._shown = base, replace(base, tbt_s=tbt)
        return self._shown

    def _committed_view(self, now: float) -> DecodeInstanceState:
        if self._view is None:
            base = self.state(now)
            incoming = tuple(IncomingRequest(r.rid, r.input_length + 1, r.output_length)
                             for r in self.committed.values())
            self._view = DecodeInstanceState(base.instance_id, base.running, base.max_batch_size,
                                             base.max_context_tokens, incoming=incoming)
        return self._view

    def commit(self, req: SimRequest) -> None:
        self.committed[req.rid] = req
        self._view = None

    def uncommit(self, req: SimRequest) -> None:
        self.committed.pop(req.rid, None)
        self._view = None

    def arrive(self, now: float, req: SimRequest) -> None:
        """KV fully received: join at the next step boundary (now, if idle)."""
        self.pending.append(req)
        self._state = self._view = None
        if self.seg_steps == 0:
            self._boundary(now, self.version)
            return
        done = math.floor((now - self.seg_start) / self.seg_gap + 1e-9)
        cut = min(done + 1, self.seg_steps)
        if cut < self.seg_steps:
            self.seg_steps = cut
            self.version += 1
            self.events.push(self.seg_start + cut * self.seg_gap, self._boundary_event, self.version)

    def _boundary_event(self, now: float, version: int) -> None:
        if version == self.version:
            self._boundary(now, version)

    def _boundary(self, now: float, version: int) -> None:
        b = self.batch
        if self.seg_steps:
            for req in b.advance(self.seg_steps, self.seg_gap):
                req.finish = now
                self.on_finish(now, req)
            self._state = self._view = None
        for req in self.pending:
            b.add(req, now)
        if self.pending:
            self.pending = []
            self._state = self._view = None
        if not b.running:
            self.seg_steps = 0
            return
        self.seg_start, self.seg_gap = now, max(b.step_time(), 1e-9)
        self.seg_steps = b.steps_to_next_finish()
        self.version += 1
        self.events.push(now + self.seg_steps * self.seg_gap, self._boundary_event, self.version)


def _one_change(running: tuple, old_running: tuple) -> bool:
    """``running`` is ``old_running`` plus one record at the end, or less one record."""
    n, k = len(running), len(old_running)
    if n == k + 1 and running[:k] == old_running:
        return True
    if n == k - 1:
        i = next(compress(count(), map(is_not, running, old_running)), n)
        return running[i:] == old_running[i + 1:]
    return False
