"""Cluster membership and in-flight bookkeeping: who is alive, what each instance is doing.

Prefill and decode instances register (refused on model / block size / hash seed mismatch: ``registration.py``) and
heartbeat; one silent for ``dead_after_s`` is marked dead, leaves every scheduling snapshot, and the requests in
flight on it are told (their ``on_death`` callback) so they fail cleanly. A dead instance that heartbeats again
comes back. Dispatch reports what it sees at once: a refused or broken connection makes an instance *suspect* (left
out of snapshots while another of its role is not), ``max_failures`` of them in a row mark it dead, and an answer or
a heartbeat clears it. Stores are watched too (``stores``: the silent ones, for the index to drop).

Each instance's jobs are kept in one place, its scheduler view (``scheduler/view.py``, which the simulator drives
too): what the conductor dispatched there — the queue in the instance's order, the decode batch, and the requests
whose KV is still coming (``incoming`` until the first token, so a burst is spread instead of herding onto one
instance). The handlers here tell the view what happened; it builds a new state only when what the state shows
changed, and a snapshot is a :class:`~mooncake_lite.scheduler.snapshot.StateTuple` per role over the live views,
as in the simulator: an unchanged instance keeps its state object, so the scheduler's estimate cache hits.

No IO here and no clock: ``now`` is passed in (the app uses the event loop's monotonic time).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from mooncake_lite.common.protocol import Heartbeat, InstanceLoad, Register
from mooncake_lite.conductor.cluster import registration
from mooncake_lite.conductor.cluster.costs import InstanceCosts
from mooncake_lite.conductor.cluster.registration import STATE_LOAD_KEYS, RegistrationError
from mooncake_lite.conductor.cluster.store_watch import StoreWatch
from mooncake_lite.model.source import model_id
from mooncake_lite.scheduler import (ClusterState, DecodeView, DecodingRequest, IncomingRequest, PrefillView,
                                     QueuedPrefill)
from mooncake_lite.scheduler.packing import first_pack, queue_caps
from mooncake_lite.scheduler.queue_order import enqueue, job_uncached, withdraw
from mooncake_lite.scheduler.snapshot import StateTuple

__all__ = ["DecodeJob", "Instance", "Membership", "PrefillJob", "RegistrationError", "model_id"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillJob:
    """A request dispatched to a prefill instance, its KV bound for ``decode_id``."""

    request_id: str
    num_tokens: int
    num_prefix_tokens: int
    decode_id: str
    max_output_tokens: int | None = None
    num_sequences: int = 1             # OpenAI's n: the decode runs n sequences on its KV
    pack_cap: int = 0                  # its decision's cap on its packed forward (QueuedPrefill)
    priced_s: float | None = None      # its forward's seconds as its decision priced them (QueuedPrefill.ends_at)


@dataclass(frozen=True)
class DecodeJob:
    """A request whose KV reached its decode instance: it runs there from ``joined_at``."""

    request_id: str
    context_tokens: int
    joined_at: float
    max_output_tokens: int
    num_sequences: int = 1


@dataclass
class Instance:
    reg: Register
    costs: InstanceCosts
    last_seen: float
    # The scheduler's view of this instance: its jobs (its queue, or its batch and incoming requests).
    view: PrefillView | DecodeView
    is_alive: bool = True
    load: InstanceLoad = field(default_factory=InstanceLoad)
    # request id -> on_death(reason[, retry]): ends that request's attempt (Membership.watch)
    watchers: dict[str, Callable[..., None]] = field(default_factory=dict)
    # A queued job that overtook others (shortest-first order) -> their ids, to give back on withdraw.
    passed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Refused or broken connections in a row (reset by an answer or a heartbeat); > 0: suspect.
    num_failures: int = 0

    @property
    def is_suspect(self) -> bool:
        return self.num_failures > 0

    @property
    def instance_id(self) -> str:
        return self.reg.instance_id

    @property
    def role(self) -> str:
        return self.reg.role

    # What its view shows (for /status, /metrics and tests; the scheduler reads the snapshot).
    @property
    def prefill_jobs(self) -> tuple[QueuedPrefill, ...]:
        return self.view.state().queue if isinstance(self.view, PrefillView) else ()

    @property
    def decode_jobs(self) -> tuple[DecodingRequest, ...]:
        return self.view.state().running if isinstance(self.view, DecodeView) else ()

    @property
    def incoming_jobs(self) -> tuple[IncomingRequest, ...]:
        return self.view.state().incoming if isinstance(self.view, DecodeView) else ()


class Membership:
    """Owns the instance table. One owner (the conductor app); not thread-safe."""

    def __init__(self, model: str, block_size: int, hash_seed: int, dead_after_s: float,
                 max_failures: int = 3, tie_salt: bytes | None = None) -> None:
        self.model_id = model_id(model)
        self.tie_salt = tie_salt   # snapshot order (ties go to the first): docs/conductor.md, Several conductors
        self.block_size, self.hash_seed, self.dead_after_s, self.max_failures = \
            block_size, hash_seed, dead_after_s, max_failures
        self.instances: dict[str, Instance] = {}
        self.stores = StoreWatch(dead_after_s)
        # (role, event) -> count for /metrics: suspect, cleared, dead-{failures,silent,replaced}, connection-failure
        self.events: Counter[tuple[str, str]] = Counter()
        self.kv_bytes_per_token: int | None = None
        # Set by end_requests (the drain ran out): a request placed after it (its body was still
        # arriving, or being parsed) is ended as it is watched, instead of running past the drain.
        self.ended_reason: str | None = None
        # The scheduled instances' views, per role (None: which instances those are changed since,
        # make them again) and the last snapshot made of them.
        self._states: tuple[StateTuple, StateTuple] | None = None
        self._cluster: ClusterState | None = None
        # The smallest KV capacity among the scheduled prefill instances: a prompt within it
        # fits them all (the common case), so fitting() need not look them up one by one.
        self._smallest_prefill: int = 0
        # The costs the scheduler prices an instance with: its own, unless the online correction
        # (conductor/flight/predictions.py) sets this; re-shown by :meth:`show_costs`.
        self.shown_costs: Callable[[Instance], InstanceCosts] = lambda inst: inst.costs

    # ---- membership messages --------------------------------------------------------------
    def register(self, reg: Register, now: float) -> Instance:
        """Add or replace an instance; raises RegistrationError with a clear reason."""
        others = any(iid != reg.instance_id for iid in self.instances)
        registration.check(reg, self.model_id, self.block_size, self.hash_seed,
                           self.kv_bytes_per_token if others else None)
        costs = registration.registered_costs(reg)
        old = self.instances.get(reg.instance_id)
        if old is not None and (old.reg.http != reg.http or old.role != reg.role):
            # Same id, new process or address: whatever ran on the old one is gone.
            self._kill(old, f"{reg.role} instance {reg.instance_id} re-registered at {reg.http}", "replaced",
                       f"{reg.role} instance {reg.instance_id} restarted")
        if old is not None and old.reg.http == reg.http and old.role == reg.role:
            inst = Instance(reg, costs, now, old.view, watchers=old.watchers, passed=old.passed)
            if isinstance(inst.view, DecodeView):
                inst.view.set_cost(costs.decode)
        else:
            inst = Instance(reg, costs, now, registration.new_view(reg, costs))
        self.instances[reg.instance_id] = inst
        self.show_costs(inst)
        self._states = None
        if self.kv_bytes_per_token is None:
            self.kv_bytes_per_token = reg.kv_bytes_per_token
        log.info("registered %s %s at %s (store %s)", reg.role, reg.instance_id, reg.http, reg.store)
        return inst

    def heartbeat(self, hb: Heartbeat, now: float) -> Instance | None:
        """Record liveness, load and a refined cost model; None if the instance is unknown (it
        must register). A malformed cost raises RegistrationError (400) before anything applies."""
        inst = self.instances.get(hb.instance_id)
        if inst is None:
            return None
        costs = registration.heartbeat_costs(inst.reg, inst.costs, hb)
        if costs != inst.costs:
            self._set_costs(inst, costs)
        if not inst.is_alive:
            log.warning("%s %s is back after being marked dead", inst.role, inst.instance_id)
            inst.is_alive = True
            self._states = None
        inst.last_seen = now
        if hb.running is not None and isinstance(inst.view, PrefillView):   # its job by its chunks (progress.py)
            inst.view.report_end(hb.running.request_id, now + hb.running.left_s, now)
        old, inst.load = inst.load, hb.load
        if any(getattr(old, k) != getattr(inst.load, k) for k in STATE_LOAD_KEYS):
            registration.describe(inst.view, inst.reg, inst.load, self.shown_costs(inst))
        return inst

    def _set_costs(self, inst: Instance, costs: InstanceCosts) -> None:
        """A changed cost model reaches the scheduler: the view shows it in a new state, so the
        estimate cache, which keys on the model object, derives this instance's estimates anew
        (a decode batch is shown afresh and its TBT re-read from the new model)."""
        log.info("%s %s reports a refined cost model: %s", inst.role, inst.instance_id,
                 (costs.prefill if inst.role == "prefill" else costs.decode))
        inst.costs = costs
        self.show_costs(inst)

    def show_costs(self, inst: Instance) -> None:
        """Tell the instance's view the costs it is priced with (``shown_costs``): its own, as
        corrected; a decode's batch is shown afresh only when its model changed."""
        costs = self.shown_costs(inst)
        if isinstance(inst.view, DecodeView) and costs.decode != inst.view.cost:
            inst.view.set_cost(costs.decode)
        registration.describe(inst.view, inst.reg, inst.load, costs)

    def reap(self, now: float) -> list[Instance]:
        """Mark every instance silent for longer than ``dead_after_s`` dead; returns them."""
        dead = [i for i in self.instances.values()
                if i.is_alive and now - i.last_seen > self.dead_after_s]
        for inst in dead:
            name = f"{inst.role} instance {inst.instance_id}"
            self._kill(inst, f"{name} stopped heartbeating (silent for {now - inst.last_seen:.1f}s)", "silent",
                       f"{name} stopped heartbeating and was taken out of service")
        return dead

    def _kill(self, inst: Instance, reason: str, cause: str, told: str) -> None:
        """Mark ``inst`` dead: the log gives ``reason`` (the detail), its requests in flight are
        ``told`` (one plain sentence per kind of death, what their clients read)."""
        log.warning("%s; failing its %d request(s) in flight", reason, len(inst.watchers))
        self.events[inst.role, f"dead-{cause}"] += 1
        inst.is_alive = False
        inst.num_failures = 0     # if it comes back, it comes back trusted
        watchers, inst.watchers = inst.watchers, {}
        inst.passed.clear()
        inst.view.clear()
        self._states = None
        for notify in watchers.values():
            notify(told)

    # ---- failures seen by dispatch ---------------------------------------------------------
    def connection_failed(self, instance_id: str, reason: str) -> str | None:
        """A connection to the instance was refused or broke. The first such failure makes it
        suspect (out of snapshots while another of its role is trusted); ``max_failures`` in a
        row mark it dead. Returns "suspect" or "dead" when its state changed, else None."""
        inst = self.get(instance_id)
        if inst is None:
            return None
        self.events[inst.role, "connection-failure"] += 1
        inst.num_failures += 1
        if inst.num_failures >= self.max_failures:
            name = f"{inst.role} instance {inst.instance_id}"
            self._kill(inst, f"{name}: {inst.num_failures} connections in a row refused or broken (last: {reason})",
                       "failures", f"{name} stopped answering and was taken out of service")
            return "dead"
        if inst.num_failures > 1:
            return None
        log.warning("%s instance %s is suspect: %s; not scheduled while another %s instance is trusted, "
                    "until it answers or heartbeats", inst.role, instance_id, reason, inst.role)
        self.events[inst.role, "suspect"] += 1
        self._states = None
        return "suspect"

    def trust(self, instance_id: str, why: str) -> None:
        """The instance answered a call or heartbeated: no longer suspect."""
        inst = self.instances.get(instance_id)
        if inst is None or not inst.num_failures:
            return
        log.info("%s instance %s is trusted again (%s)", inst.role, instance_id, why)
        self.events[inst.role, "cleared"] += 1
        inst.num_failures = 0
        self._states = None

    def alive(self, role: str | None = None) -> list[Instance]:
        return [i for i in self.instances.values() if i.is_alive and (role is None or i.role == role)]

    def get(self, instance_id: str) -> Instance | None:
        inst = self.instances.get(instance_id)
        return inst if inst is not None and inst.is_alive else None

    # ---- in-flight bookkeeping ------------------------------------------------------------
    def watch(self, instance_id: str, request_id: str, on_death: Callable[..., None]) -> None:
        """``on_death(reason)`` when the instance is declared dead (the request may be retried
        elsewhere); ``on_death(reason, False)`` when :meth:`end_requests` ends it (not retried),
        at once if that already happened."""
        self.instances[instance_id].watchers[request_id] = on_death
        if self.ended_reason is not None:
            on_death(self.ended_reason, False)

    def end_requests(self, reason: str) -> int:
        """End every request in flight now, not to be retried, telling its client ``reason``
        (the conductor's drain ran out), and any watched from now on; the instances stay as they
        are. Returns how many were in flight."""
        self.ended_reason = reason
        watchers: dict[str, Callable[..., None]] = {}
        for inst in self.instances.values():
            watchers.update(inst.watchers)   # keyed by request: a request watching two is told once
        for on_death in watchers.values():
            on_death(reason, False)
        return len(watchers)

    def add_prefill(self, instance_id: str, job: PrefillJob, now: float) -> None:
        """Queue ``job`` on its prefill instance and record it as incoming on its decode
        instance (``job.decode_id``) until :meth:`add_decode` says its KV arrived."""
        inst = self.instances[instance_id]
        view = inst.view
        assert isinstance(view, PrefillView), f"{instance_id} is no prefill instance"
        # Where the instance's queue order puts it (scheduler/queue_order.py; FIFO: last), with
        # the same uncached tokens the instance orders by (the prefix_keys dispatch sends it);
        # the head of an empty queue starts now, priced to end as its decision priced it: in the
        # node's state now, not in the busy one its presence shows to the jobs behind it.
        started = None if view.state().queue else now
        ends = now + job.priced_s if started is not None and job.priced_s is not None and job.priced_s > 0 else None
        order = enqueue(view, job.request_id, job.num_tokens, job.num_prefix_tokens,
                        max(inst.reg.queue_overtakes, 0), started, job.pack_cap, ends)
        if order:       # it passed some: the head is still the one the instance serves next
            inst.passed[job.request_id] = order[order.index(job.request_id) + 1:]
        decode = self.instances.get(job.decode_id)
        if decode is not None and isinstance(decode.view, DecodeView):
            # the context it brings: prompt + first token, as add_decode will record
            decode.view.commit(job.request_id, job.num_tokens + 1, job.max_output_tokens, job.num_sequences)

    def withdraw_prefill(self, instance_id: str, request_id: str, now: float) -> None:
        """The job added by :meth:`add_prefill` never reached the instance (its decode
        reservation failed): done, and the overtakes it took are given back."""
        self.prefill_done(instance_id, request_id, now, withdrawn=True)

    def prefill_done(self, instance_id: str, request_id: str, now: float, withdrawn: bool = False) -> None:
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        # Its KV has reached the decode: the prefill dying now must not fail the request.
        inst.watchers.pop(request_id, None)
        passed_ids = inst.passed.pop(request_id, ())
        view = inst.view
        if not isinstance(view, PrefillView) or not view.remove(request_id):
            return
        if withdrawn and passed_ids:
            withdraw(view, request_id, passed_ids)   # (removed already: gives the overtakes back)
        queue = view.state().queue
        if queue and queue[0].started_at is None:
            view.start(queue[0].request_id, now)  # the next in the queue order starts when this one ends
        if queue and inst.reg.pack_tokens > 0:
            self._start_pack(view, queue, inst.reg.pack_tokens, now)

    @staticmethod
    def _start_pack(view: PrefillView, queue: tuple[QueuedPrefill, ...], pack_tokens: int, now: float) -> None:
        """Prefill batching: the jobs the running head takes along into its forward (the instance's rule,
        ``scheduler.packing.first_pack``) start with it. Re-run as members' results arrive one by one,
        so the forward after a pack is shown whole once its own head is."""
        size = first_pack(map(job_uncached, queue), pack_tokens, queue_caps(queue))
        for job in islice(queue, 1, size):
            if job.started_at is None:
                view.start(job.request_id, now)

    def add_decode(self, instance_id: str, job: DecodeJob) -> None:
        inst = self.get(instance_id)
        if inst is not None and isinstance(inst.view, DecodeView):
            inst.view.join(job.request_id, job.context_tokens, job.joined_at, job.max_output_tokens, job.num_sequences)

    def decode_progress(self, instance_id: str, request_id: str, num_new_tokens: int = 1) -> None:
        """``request_id``: the sequence's (``scheduler.view.sequence_id``: a choice of n)."""
        inst = self.instances.get(instance_id)
        if inst is not None and isinstance(inst.view, DecodeView):
            inst.view.progress(request_id, num_new_tokens)

    def release(self, request_id: str, instance_ids: tuple[str, ...], now: float) -> None:
        """The request is over (any outcome): forget it everywhere."""
        for iid in instance_ids:
            inst = self.instances.get(iid)
            if inst is None:
                continue
            inst.watchers.pop(request_id, None)
            if isinstance(inst.view, DecodeView):
                inst.view.leave(request_id)
            else:
                self.prefill_done(iid, request_id, now)

    # ---- scheduler view -------------------------------------------------------------------
    def snapshot(self) -> ClusterState:
        """The live instances as the scheduler sees them (dead ones left out; suspects too,
        from a role with a trusted instance). Unchanged instances keep their state objects (so
        the scheduler's estimate cache hits), and an unchanged cluster its snapshot."""
        if self._states is None:
            self._states = self._scheduled()
        prefills, decodes = self._states[0].states(), self._states[1].states()
        cluster = self._cluster
        if cluster is None or cluster.prefills is not prefills or cluster.decodes is not decodes:
            self._cluster = cluster = ClusterState(prefills, decodes)
        return cluster

    def _scheduled(self) -> tuple[StateTuple, StateTuple]:
        """The views of the instances the scheduler may choose, per role. Suspects are left
        out of a role that has a trusted instance; a role with only suspects keeps them, so a
        request probes them (an answer clears, more failures kill)."""
        trusted_roles = {i.role for i in self.instances.values() if i.is_alive and not i.is_suspect}
        scheduled = [i for i in self.instances.values()
                     if i.is_alive and not (i.is_suspect and i.role in trusted_roles)]
        if self.tie_salt is not None:
            scheduled.sort(key=lambda i: hashlib.blake2b(i.instance_id.encode(), key=self.tie_salt).digest())
        prefills = [i for i in scheduled if i.role == "prefill"]
        # Only a new set of scheduled instances changes which prefills are live (and their registrations).
        self._smallest_prefill = min((i.reg.max_context for i in prefills), default=0)
        return (StateTuple(i.view for i in prefills), StateTuple(i.view for i in scheduled if i.role == "decode"))

    def fitting(self, snap: ClusterState, num_tokens: int) -> ClusterState:
        """``snap`` without the prefill instances whose KV cache cannot hold a ``num_tokens``
        prompt (the scheduler core does not know their capacity); no prefills if none can."""
        if snap is self._cluster and num_tokens <= self._smallest_prefill:
            return snap
        instances = self.instances
        fits = tuple(p for p in snap.prefills if instances[p.instance_id].reg.max_context >= num_tokens)
        return snap if len(fits) == len(snap.prefills) else ClusterState(fits, snap.decodes)
