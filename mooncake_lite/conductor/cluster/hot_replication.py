"""Hot blocks copied before they are needed: the conductor's background replication loop.

Each accepted request tells the tracker (``scheduler/hot.py``, pure) which prefix blocks it
reused. Every ``--hot-replication-period`` the loop asks it for a plan — hot blocks missing from
the live prefill nodes' stores, within ``--hot-replication-share`` of each link — and asks each
target store to pull its blocks from the planned source (the store REPLICATE op, through one
``StoreClient`` per target store). A target still busy with the previous plan is left out of the
next one, so no two copies to one store are ever in flight. A timed copy feeds the link-speed
table Algorithm 1 prices transfers with (``scheduler/links.py``), as critical-path migrations do.
Failures are counted each time and logged once per store pair until it works again.
With several conductors (``--discovery``) only the one elected through etcd (``leader.py``)
plans and copies; each still counts heat, but the leader's plan reads only the reuses of the
requests it served itself (a balancer's even share: hot blocks stay hot in any share).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from mooncake_lite.conductor.cluster.leader import LEADER
from mooncake_lite.conductor.services import Services
from mooncake_lite.scheduler.decision import Decision
from mooncake_lite.scheduler.hot import HotTracker, Plan, Replication
from mooncake_lite.store.client import StoreClient

log = logging.getLogger(__name__)


class HotReplication:
    """The tracker, the store clients and the copies in flight of one conductor."""

    def __init__(self, svc: Services, tracker: HotTracker) -> None:
        self.svc = svc
        self.tracker = tracker
        self.clients: dict[str, StoreClient] = {}
        self.in_flight: dict[str, asyncio.Task] = {}     # target store -> its copies
        self.failing: set[tuple[str, str]] = set()       # (source, target) pairs whose failure was logged

    def note(self, decision: Decision, keys: list[bytes], now: float) -> None:
        """An accepted request: the blocks of the prefix it reuses count towards their heat."""
        self.tracker.note(now, keys[:decision.reused_prefix_blocks])

    def step(self, now: float) -> Plan:
        """Plan and start this period's copies (one task per target store)."""
        svc, costs = self.svc, self.svc.scheduler.costs
        targets = {i.reg.store for i in svc.membership.alive("prefill") if i.reg.store}
        plan = self.tracker.plan(now, svc.scheduler.index, targets,
                                 block_bytes=costs.kv_bytes_per_token * svc.block_size,
                                 prior_bytes_per_s=costs.bandwidth_bytes_per_s, links=costs.links,
                                 busy=self.in_flight)
        svc.metrics.cluster.hot_blocks.set(plan.num_hot)
        by_target: dict[str, list[Replication]] = {}
        for rep in plan.replications:
            by_target.setdefault(str(rep.target), []).append(rep)
        for target, reps in by_target.items():
            task = asyncio.get_running_loop().create_task(self._copy(target, reps))
            self.in_flight[target] = task
            task.add_done_callback(lambda _, t=target: self.in_flight.pop(t, None))
        return plan

    async def _copy(self, target: str, reps: list[Replication]) -> None:
        for rep in reps:
            if not await self._replicate(target, rep):
                break      # the rest would most likely fail the same way; the next plan retries

    async def _replicate(self, target: str, rep: Replication) -> bool:
        source, loop = str(rep.source), asyncio.get_running_loop()
        try:
            client = await self._client(target)
            start = loop.time()
            reply = await client.replicate(list(rep.keys), source, rep.first_pos)
        # refused or cut (OSError), no answer (NoAnswer), the store's error (RemoteError), a bad frame
        except (OSError, TimeoutError, RuntimeError, ValueError) as exc:
            self._failed(source, target, exc)
            return False
        seconds, num_bytes = loop.time() - start, reply.get("num_bytes", 0)
        self.svc.metrics.cluster.hot_replications.labels("ok").inc()
        self.svc.metrics.cluster.hot_replicated_bytes.inc(num_bytes)
        if self.svc.scheduler.costs.links is not None:
            self.svc.scheduler.costs.links.observe(rep.source, rep.target, num_bytes, seconds)
        if (source, target) in self.failing:
            self.failing.discard((source, target))
            log.info("hot-block replication %s -> %s works again", source, target)
        log.debug("hot blocks: %s pulled %d of %d block(s) from %s in %.3fs", target, reply.get("num_copied", 0),
                  len(rep.keys), source, seconds)
        return True

    def _failed(self, source: str, target: str, exc: BaseException) -> None:
        self.svc.metrics.cluster.hot_replications.labels("failed").inc()
        client = self.clients.get(target)
        if client is not None and client.is_closed:
            del self.clients[target]          # dial afresh next time
        if (source, target) not in self.failing:
            self.failing.add((source, target))
            log.warning("hot-block replication %s -> %s failed: %s (counted; not logged again until it works)",
                        source, target, exc or type(exc).__name__)

    async def _client(self, target: str) -> StoreClient:
        client = self.clients.get(target)
        if client is None or client.is_closed:
            client = await StoreClient.connect(target, token=self.svc.cluster_token, name="conductor-hot",
                                               shm=False)
            self.clients[target] = client
        return client

    async def close(self) -> None:
        tasks = list(self.in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in self.clients.values():
            await client.close()
        self.clients.clear()


HOT = web.AppKey("hot_replication", HotReplication)


async def run(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: plan every period while the app runs; on shutdown stop the copies in
    flight and close the store connections."""
    hot = app[HOT]
    period = hot.tracker.config.period_s
    leadership = app.get(LEADER)   # several conductors (--discovery): only the leader copies

    async def loop() -> None:
        while True:
            await asyncio.sleep(period)
            if leadership is not None and not leadership.is_leader:
                continue
            try:
                hot.step(asyncio.get_running_loop().time())
            except Exception:    # a bug here must not end background replication for good
                log.exception("hot-block replication: planning failed")

    task = asyncio.get_running_loop().create_task(loop())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await hot.close()
