"""The colocated vLLM-style baseline: every instance prefills *and* decodes.

Each instance has a waiting queue, a continuous batch and a prefix cache in its own GPU memory.
At every step boundary the engine runs, prefill first (vLLM v0's default): if a request is
waiting and its KV fits, it prefills it (one prompt per step: long-context prompts fill the
token budget alone) while the running batch waits; otherwise one decode step of the batch.
The time a prefill takes is added to the next token gap of every running request, which is
exactly the interference the disaggregated design removes. With ``chunked_prefill_tokens``
(vLLM's chunked prefill) every step instead carries the decode batch plus up to that many
prompt tokens of one waiting request, so each token gap grows by a chunk's prefill time.

Requests are routed with the scheduler core's own prefill selection (``choose_prefill``,
default ``cache-aware``: smallest predicted queue + prefill given the instance's local prefix).
Nothing is rejected: requests that miss the SLOs count against goodput.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence

from mooncake_lite.scheduler import (BlockIndex, CostModels, EstimateCache, PrefillInstanceState, PrefillView,
                                     ScheduleRequest, SchedulerConfig, prefill_queue_time)
from mooncake_lite.scheduler.prefill_select import choose_prefill
from mooncake_lite.sim.batch import Batch
from mooncake_lite.sim.config import ColocatedConfig
from mooncake_lite.sim.costs import Hardware, get_hardware
from mooncake_lite.sim.driver import TraceDriver
from mooncake_lite.sim.events import EventQueue
from mooncake_lite.sim.nodes import cached_prefix
from mooncake_lite.sim.recorder import Recorder
from mooncake_lite.sim.request import SimRequest
from mooncake_lite.sim.store import NodeStore, store_chain


class ColocatedInstance:
    """One vLLM-style engine: waiting queue → (prefill | decode step) at each boundary."""

    def __init__(self, instance_id: str, sim: ColocatedSim) -> None:
        self.instance_id = instance_id
        self.sim = sim
        hw = sim.hw
        self.cache = NodeStore(hw.decode_max_context_tokens // sim.block_size
                               if hw.decode_max_context_tokens else None, 0, sim.cfg.eviction)
        self.batch = Batch(hw.decode)
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: SimRequest | None = None
        self.seg_start = self.seg_gap = 0.0
        self.seg_steps = 0
        self.version = 0
        self.view = PrefillView(instance_id, instance_id)   # the prompt prefilling, then the waiting ones

    def state(self) -> PrefillInstanceState:
        return self.view.state()

    def is_idle(self) -> bool:
        return self.prefilling is None and self.seg_steps == 0

    def enqueue(self, now: float, req: SimRequest) -> None:
        self.waiting.append(req)
        self.view.add(req.rid, req.input_length, req.planned_prefix_tokens)
        if self.is_idle():
            self._boundary(now, self.version)
        elif self.seg_steps:  # cut the decode segment at the next step boundary
            done = math.floor((now - self.seg_start) / self.seg_gap + 1e-9)
            cut = min(done + 1, self.seg_steps)
            if cut < self.seg_steps:
                self.seg_steps = cut
                self.version += 1
                self.sim.events.push(self.seg_start + cut * self.seg_gap, self._boundary_event, self.version)

    def _fits(self, req: SimRequest) -> bool:
        b, hw, cfg = self.batch, self.sim.hw, self.sim.cfg
        if cfg.max_batch is not None and len(b) + 1 > cfg.max_batch:
            return False
        limit = hw.decode_max_context_tokens
        # A request that could never fit runs alone rather than blocking forever.
        return limit is None or not b.running or b.context_tokens + req.input_length + req.max_tokens <= limit

    def _boundary_event(self, now: float, version: int) -> None:
        if version == self.version:
            self._boundary(now, version)

    def _boundary(self, now: float, version: int) -> None:
        b = self.batch
        if self.seg_steps:
            for req in b.advance(self.seg_steps, self.seg_gap):
                req.finish = now
                self.sim.finish(now, req)
            self.seg_steps = 0
        self.version += 1
        if self.prefilling is None and self.waiting and self._fits(self.waiting[0]):
            req = self.waiting.popleft()
            self.prefilling = req
            self.view.start(req.rid, now)
            req.prefill_start = now
            req.reused_tokens = min(cached_prefix(self.cache, req.keys) * self.sim.block_size, req.input_length - 1)
            req.prefilled = req.reused_tokens
            if self.sim.cfg.chunked_prefill_tokens is None:
                duration = self.sim.hw.prefill_seconds(req.input_length, req.reused_tokens)
                b.stall(duration)
                self.sim.events.push(now + duration, self._prefill_done, self.version)
                return
        if self.prefilling is not None:  # chunked prefill: one mixed step (decode batch + a chunk)
            req = self.prefilling
            budget = max(1, self.sim.cfg.chunked_prefill_tokens - len(b))
            num = min(budget, req.input_length - req.prefilled)
            step = self.sim.hw.prefill.predict(req.prefilled + num, req.prefilled)
            if b.running:
                step += b.step_time()
            self.sim.events.push(now + step, self._chunk_done, (num, step))
            return
        if b.running:
            self.seg_start, self.seg_gap = now, max(b.step_time(), 1e-9)
            self.seg_steps = b.steps_to_next_finish()
            self.sim.events.push(now + self.seg_steps * self.seg_gap, self._boundary_event, self.version)

    def _chunk_done(self, now: float, step: tuple[int, float]) -> None:
        num, gap = step
        for done in self.batch.advance(1, gap) if self.batch.running else ():
            done.finish = now
            self.sim.finish(now, done)
        self.prefilling.prefilled += num
        if self.prefilling.prefilled >= self.prefilling.input_length:
            self._prefill_done(now, self.version)
        else:
            self._boundary(now, self.version)

    def _prefill_done(self, now: float, version: int) -> None:
        req = self.prefilling
        self.prefilling = None
        self.view.remove(req.rid)
        self.sim.store(self, req.keys)
        req.first_token = now
        if req.tokens_to_generate() <= 1:
            req.finish = now
            self.sim.finish(now, req)
        else:
            self.batch.add(req, now)
        self._boundary(now, self.version)


class ColocatedSim(TraceDriver):
    """``num_instances`` colocated engines behind a cache-aware router."""

    system = "colocated"

    def __init__(self, cfg: ColocatedConfig, hardware: Hardware | None = None, block_size: int = 512) -> None:
        self.cfg = cfg
        self.hw = hw = hardware or get_hardware(cfg.hardware)
        self.block_size = block_size
        self.costs = CostModels(prefill=hw.prefill, decode=hw.decode, kv_bytes_per_token=hw.kv_bytes_per_token,
                                bandwidth_bytes_per_s=hw.network_bytes_per_s)
        self.sched_cfg = SchedulerConfig(strategy=cfg.routing, admission="none", block_size=block_size)
        self.index = BlockIndex()
        self.estimates = EstimateCache()
        self.rng = random.Random(cfg.seed)
        self.events = EventQueue()
        self.instances = [ColocatedInstance(f"C{i}", self) for i in range(cfg.num_instances)]
        self.by_id = {c.instance_id: c for c in self.instances}
        self.recorder = Recorder(self, cfg.sample_interval_s)

    def store(self, inst: ColocatedInstance, keys: Sequence) -> None:
        store_chain(inst.cache, self.index, inst.instance_id, keys)

    def finish(self, now: float, req: SimRequest) -> None:
        req.status = "completed"
        self.recorder.ended(req)

    def _arrive(self, now: float, req: SimRequest) -> None:
        sreq = ScheduleRequest(req.rid, req.keys, req.input_length, req.max_tokens)
        states = tuple(c.state() for c in self.instances)
        queues = self.estimates.prefill_queues(states, self.costs, now)
        choice = choose_prefill(sreq, states, self.index.match(req.keys), self.sched_cfg, self.costs, queues, self.rng)
        req.prefill_id = req.decode_id = choice.instance.instance_id
        req.planned_prefix_tokens = min(choice.local_blocks * self.block_size, req.input_length - 1)
        self.by_id[req.prefill_id].enqueue(now, req)

    def sample(self, now: float) -> dict[str, float]:
        queue = [prefill_queue_time(c.state(), self.costs, now) for c in self.instances]
        tbts = [c.batch.step_time() for c in self.instances]
        ttft_slo, tbt_slo = self.cfg.ttft_slo_s, self.cfg.tbt_slo_s
        return {"prefill_load": sum(queue) / len(queue) / ttft_slo, "decode_load": sum(tbts) / len(tbts) / tbt_slo,
                "decode_load_max": max(tbts) / tbt_slo,
                "prefill_queued": float(sum(len(c.waiting) + (c.prefilling is not None) for c in self.instances)),
                "decode_running": float(sum(len(c.batch) for c in self.instances))}
