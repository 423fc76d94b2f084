"""Cluster membership and in-flight bookkeeping: who is alive, what each instance is doing.

Prefill and decode instances register (refused on model / block size / hash seed mismatch) and
heartbeat; one silent for ``dead_after_s`` is marked dead, leaves every scheduling snapshot,
and the requests in flight on it are told (their ``on_death`` callback) so they fail cleanly.
A dead instance that heartbeats again comes back. Dispatch reports what it sees at once: a
refused or broken connection makes an instance *suspect* (left out of snapshots while another
of its role is not), ``max_failures`` of them in a row mark it dead, and an answer or a
heartbeat clears it. Stores are watched too (``stores``: the silent ones, for the index to
drop). Queues and batches are the conductor's own record of what it dispatched — the
scheduler reads them as a :class:`ClusterState` snapshot; a request dispatched to a decode
instance counts there as ``incoming`` from dispatch until its KV has arrived (the first
token), so a burst is spread instead of herding onto one instance.

Each instance's scheduler state comes from its instance view (``scheduler/view.py``, the class
the simulator drives too): the event handlers here tell it what happened, and it builds a new
state only when something the state shows changed (a job added, started, finished or released;
a heartbeat changing its capacity or bandwidth; death; generated tokens only once a batch's
requests together are further ahead than :func:`~mooncake_lite.scheduler.context_lag_bound`
allows). A snapshot replaces only the entries of the instances touched since the last one, so
an unchanged instance keeps its state object and the scheduler's estimate cache hits.

No IO here and no clock: ``now`` is passed in (the app uses the event loop's monotonic time).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from mooncake_lite.common.protocol import Heartbeat, InstanceLoad, Register
from mooncake_lite.conductor.costs import InstanceCosts, parse_instance_costs
from mooncake_lite.conductor.cluster.store_watch import StoreWatch
from mooncake_lite.model.source import model_id
from mooncake_lite.scheduler import ClusterState, DecodeView, PrefillView
from mooncake_lite.scheduler.costs import uncached_tokens
from mooncake_lite.scheduler.packing import first_pack
from mooncake_lite.scheduler.queue_order import enqueue, withdraw

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
# Heartbeat load fields that appear in a scheduler state: a change rebuilds it.
STATE_LOAD_KEYS = ("bandwidth_bytes_per_s", "max_context_tokens", "max_batch_size")


class RegistrationError(Exception):
    """Registration refused: 409 for a cluster mismatch, 400 for a malformed message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class PrefillJob:
    request_id: str
    num_tokens: int
    num_prefix_tokens: int
    decode_id: str
    started_at: float | None = None
    max_output_tokens: int | None = None
    passed_ids: tuple[str, ...] = ()     # the jobs it overtook (queue order), for withdraw_prefill


@dataclass
class DecodeJob:
    request_id: str
    context_tokens: int
    joined_at: float
    max_output_tokens: int


@dataclass
class Instance:
    reg: Register
    costs: InstanceCosts
    last_seen: float
    # The scheduler's view of this instance (its queue, or its batch and incoming requests).
    view: PrefillView | DecodeView
    is_alive: bool = True
    load: InstanceLoad = field(default_factory=InstanceLoad)
    prefill_jobs: dict[str, PrefillJob] = field(default_factory=dict)   # dispatch order
    decode_jobs: dict[str, DecodeJob] = field(default_factory=dict)
    # Decode side: dispatched here, KV not arrived yet (the scheduler counts them as coming).
    incoming_jobs: dict[str, PrefillJob] = field(default_factory=dict)
    # request id -> on_death(reason[, retry]): ends that request's attempt (Membership.watch)
    watchers: dict[str, Callable[..., None]] = field(default_factory=dict)
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


class Membership:
    """Owns the instance table. One owner (the conductor app); not thread-safe."""

    def __init__(self, model: str, block_size: int, hash_seed: int, dead_after_s: float,
                 max_failures: int = 3) -> None:
        self.model_id = model_id(model)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.dead_after_s = dead_after_s
        self.max_failures = max_failures
        self.instances: dict[str, Instance] = {}
        self.stores = StoreWatch(dead_after_s)
        # (role, event) -> count, for /metrics: suspect, cleared, dead-failures, dead-silent,
        # dead-replaced, connection-failure.
        self.events: Counter[tuple[str, str]] = Counter()
        self.kv_bytes_per_token: int | None = None
        # Set by end_requests (the drain ran out): a request placed after it (its body was still
        # arriving, or being parsed) is ended as it is watched, instead of running past the drain.
        self.ended_reason: str | None = None
        self._cluster: ClusterState | None = None     # the last snapshot
        # Where each live instance sits in _cluster's tuples (None: the set of live instances
        # changed, rebuild the tuples) and the instances touched since: a snapshot replaces
        # only their entries.
        self._positions: dict[str, int] | None = None
        self._changed: dict[str, Instance] = {}
        # The smallest KV capacity among _cluster's prefill instances: a prompt within it fits
        # them all (the common case), so fitting() need not look them up one by one.
        self._smallest_prefill: int = 0

    # ---- membership messages --------------------------------------------------------------
    def register(self, reg: Register, now: float) -> Instance:
        """Add or replace an instance; raises RegistrationError with a clear reason."""
        self._check(reg)
        costs = self._costs(reg)
        old = self.instances.get(reg.instance_id)
        if old is not None and (old.reg.http != reg.http or old.role != reg.role):
            # Same id, new process or address: whatever ran on the old one is gone.
            self._kill(old, f"{reg.role} instance {reg.instance_id} re-registered at {reg.http}", "replaced",
                       f"{reg.role} instance {reg.instance_id} restarted")
        same_address = old is not None and old.reg.http == reg.http and old.role == reg.role
        inst = Instance(reg, costs, now, old.view if same_address else self._new_view(reg, costs))
        if same_address:
            inst.prefill_jobs, inst.decode_jobs, inst.watchers = old.prefill_jobs, old.decode_jobs, old.watchers
            inst.incoming_jobs = old.incoming_jobs
            if reg.role == "decode":
                inst.view.set_cost(costs.decode)
        self._describe(inst)
        self.instances[reg.instance_id] = inst
        self._positions = None
        if self.kv_bytes_per_token is None:
            self.kv_bytes_per_token = reg.kv_bytes_per_token
        log.info("registered %s %s at %s (store %s)", reg.role, reg.instance_id, reg.http, reg.store)
        return inst

    def _check(self, reg: Register) -> None:
        if reg.role not in ROLES:
            raise RegistrationError(400, f"role must be one of {', '.join(ROLES)}, got {reg.role!r}")
        if reg.role == "decode" and not reg.data:
            raise RegistrationError(400, "a decode instance must give its data address ('data')")
        mismatches = []
        if model_id(reg.model) != self.model_id:
            mismatches.append(f"model {reg.model!r} (conductor serves {self.model_id!r})")
        if reg.block_size != self.block_size:
            mismatches.append(f"block_size {reg.block_size} (cluster uses {self.block_size})")
        if reg.hash_seed != self.hash_seed:
            mismatches.append(f"hash_seed {reg.hash_seed} (cluster uses {self.hash_seed})")
        others = [i for i in self.instances.values() if i.instance_id != reg.instance_id]
        if others and self.kv_bytes_per_token not in (None, reg.kv_bytes_per_token):
            mismatches.append(f"kv_bytes_per_token {reg.kv_bytes_per_token} (other instances use "
                              f"{self.kv_bytes_per_token}: different dtype?)")
        if mismatches:
            raise RegistrationError(409, f"{reg.role} instance {reg.instance_id} refused: mismatched "
                                         + "; ".join(mismatches))

    @staticmethod
    def _new_view(reg: Register, costs: InstanceCosts) -> PrefillView | DecodeView:
        if reg.role == "prefill":
            return PrefillView(reg.instance_id, None)    # its store: _describe
        return DecodeView(reg.instance_id, costs.decode)

    @staticmethod
    def _describe(inst: Instance) -> None:
        """Tell the view what the registration and the last heartbeat say about the instance."""
        reg, load, costs = inst.reg, inst.load, inst.costs
        if reg.role == "prefill":
            # No store: a unique id no block event names, so nothing counts as cached there.
            store_id = reg.store if reg.store else f"(no store):{reg.instance_id}"
            bandwidth = costs.bandwidth_bytes_per_s or load.bandwidth_bytes_per_s or None
            inst.view.set_instance(store_id, bandwidth, costs.prefill, max(reg.pack_tokens, 0),
                                   max(reg.queue_overtakes, 0))
        else:
            # Register.max_context of a decode instance is its KV capacity in tokens.
            max_context = _int_or_none(load.max_context_tokens) or _int_or_none(reg.max_context)
            inst.view.set_limits(_int_or_none(load.max_batch_size), max_context)

    @staticmethod
    def _costs(reg: Register) -> InstanceCosts:
        try:
            return parse_instance_costs(reg.cost, reg.role)
        except ValueError as exc:
            raise RegistrationError(400, f"{reg.role} instance {reg.instance_id}: {exc}") from None

    def heartbeat(self, hb: Heartbeat, now: float) -> Instance | None:
        """Record liveness, load and a refined cost model; None if the instance is unknown (it
        must register). A malformed cost raises RegistrationError (400) before anything applies."""
        inst = self.instances.get(hb.instance_id)
        if inst is None:
            return None
        costs = self._heartbeat_costs(inst, hb)
        if costs != inst.costs:
            self._set_costs(inst, costs)
        if not inst.is_alive:
            log.warning("%s %s is back after being marked dead", inst.role, inst.instance_id)
            inst.is_alive = True
            self._positions = None
            self._touch(inst)
        inst.last_seen = now
        old, inst.load = inst.load, hb.load
        if any(getattr(old, k) != getattr(inst.load, k) for k in STATE_LOAD_KEYS):
            self._describe(inst)
            self._touch(inst)
        return inst

    def _heartbeat_costs(self, inst: Instance, hb: Heartbeat) -> InstanceCosts:
        """The instance's costs with what the heartbeat reports in place of what it replaces."""
        if not hb.cost:
            return inst.costs
        try:
            new = parse_instance_costs(hb.cost, inst.role)
        except ValueError as exc:
            raise RegistrationError(400, f"{inst.role} instance {inst.instance_id} heartbeat: {exc}") from None
        return InstanceCosts(new.prefill or inst.costs.prefill, new.decode or inst.costs.decode,
                             new.bandwidth_bytes_per_s or inst.costs.bandwidth_bytes_per_s)

    def _set_costs(self, inst: Instance, costs: InstanceCosts) -> None:
        """A changed cost model reaches the scheduler: the view shows it in a new state, so the
        estimate cache, which keys on the model object, derives this instance's estimates anew
        (a decode batch is shown afresh and its TBT re-read from the new model)."""
        log.info("%s %s reports a refined cost model: %s", inst.role, inst.instance_id,
                 (costs.prefill if inst.role == "prefill" else costs.decode))
        old, inst.costs = inst.costs, costs
        if inst.role == "decode" and costs.decode != old.decode:
            inst.view.set_cost(costs.decode)
        self._describe(inst)
        self._touch(inst)

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
        inst.prefill_jobs.clear()
        inst.decode_jobs.clear()
        inst.incoming_jobs.clear()
        inst.view.clear()
        self._positions = None
        self._touch(inst)
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
        self._positions = None
        return "suspect"

    def trust(self, instance_id: str, why: str) -> None:
        """The instance answered a call or heartbeated: no longer suspect."""
        inst = self.instances.get(instance_id)
        if inst is None or not inst.num_failures:
            return
        log.info("%s instance %s is trusted again (%s)", inst.role, instance_id, why)
        self.events[inst.role, "cleared"] += 1
        inst.num_failures = 0
        self._positions = None

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
        if not inst.prefill_jobs:
            job.started_at = now
        jobs = inst.prefill_jobs
        jobs[job.request_id] = job
        # Where the instance's queue order puts it (scheduler/queue_order.py; FIFO: last), with
        # the same uncached tokens the instance orders by (the prefix_keys dispatch sends it).
        order = enqueue(inst.view, job.request_id, job.num_tokens, job.num_prefix_tokens,
                        max(inst.reg.queue_overtakes, 0), job.started_at)
        if order:       # it passed some: the head is still the one the instance serves next
            job.passed_ids = order[order.index(job.request_id) + 1:]
            reordered = {rid: jobs[rid] for rid in order}
            jobs.clear()
            jobs.update(reordered)
        self._touch(inst)
        decode = self.instances.get(job.decode_id)
        if decode is not None:
            decode.incoming_jobs[job.request_id] = job
            # the context it brings: prompt + first token, as add_decode will record
            decode.view.commit(job.request_id, job.num_tokens + 1, job.max_output_tokens)
            self._touch(decode)

    def withdraw_prefill(self, instance_id: str, request_id: str, now: float) -> None:
        """The job added by :meth:`add_prefill` never reached the instance (its decode
        reservation failed): the overtakes it took are given back, then it is done."""
        inst = self.instances.get(instance_id)
        job = inst.prefill_jobs.get(request_id) if inst is not None else None
        if job is not None and job.passed_ids:
            withdraw(inst.view, request_id, job.passed_ids)
        self.prefill_done(instance_id, request_id, now)

    def prefill_done(self, instance_id: str, request_id: str, now: float) -> None:
        inst = self.instances.get(instance_id)
        if inst is not None:
            # Its KV has reached the decode: the prefill dying now must not fail the request.
            inst.watchers.pop(request_id, None)
        if inst is None or inst.prefill_jobs.pop(request_id, None) is None:
            return
        self._touch(inst)
        inst.view.remove(request_id)
        head = next(iter(inst.prefill_jobs.values()), None)
        if head is not None and head.started_at is None:
            head.started_at = now  # the next in the queue order starts when this one ends
            inst.view.start(head.request_id, now)
        if head is not None and inst.reg.pack_tokens > 0:
            self._start_pack(inst, now)

    @staticmethod
    def _start_pack(inst: Instance, now: float) -> None:
        """Prefill batching: the jobs the running head takes along into its forward (the
        instance's rule, ``scheduler.packing.first_pack``) start with it. Re-run as members'
        results arrive one by one, so the forward after a pack is shown whole once its own
        head is."""
        jobs = inst.prefill_jobs.values()
        size = first_pack((uncached_tokens(j.num_tokens, j.num_prefix_tokens) for j in jobs), inst.reg.pack_tokens)
        for job in islice(jobs, 1, size):
            if job.started_at is None:
                job.started_at = now
                inst.view.start(job.request_id, now)

    def add_decode(self, instance_id: str, job: DecodeJob) -> None:
        inst = self.get(instance_id)
        if inst is not None:
            inst.incoming_jobs.pop(job.request_id, None)
            inst.decode_jobs[job.request_id] = job
            inst.view.join(job.request_id, job.context_tokens, job.joined_at, job.max_output_tokens)
            self._touch(inst)

    def decode_progress(self, instance_id: str, request_id: str, num_new_tokens: int = 1) -> None:
        inst = self.instances.get(instance_id)
        job = inst.decode_jobs.get(request_id) if inst is not None else None
        if job is not None:
            job.context_tokens += num_new_tokens
            if inst.view.progress(request_id, num_new_tokens):
                self._touch(inst)

    def release(self, request_id: str, instance_ids: tuple[str, ...], now: float) -> None:
        """The request is over (any outcome): forget it everywhere."""
        for iid in instance_ids:
            inst = self.instances.get(iid)
            if inst is None:
                continue
            inst.watchers.pop(request_id, None)
            running = inst.decode_jobs.pop(request_id, None)
            incoming = inst.incoming_jobs.pop(request_id, None)
            if running is not None or incoming is not None:
                inst.view.leave(request_id)
                self._touch(inst)
            self.prefill_done(iid, request_id, now)

    # ---- scheduler view -------------------------------------------------------------------
    def _touch(self, inst: Instance) -> None:
        self._changed[inst.instance_id] = inst

    def snapshot(self) -> ClusterState:
        """The live instances as the scheduler sees them (dead ones left out). Unchanged
        instances keep their state objects (so the scheduler's estimate cache hits); only the
        entries of instances touched since the last snapshot are replaced."""
        if self._cluster is None or self._positions is None:
            return self._rebuild()
        if self._changed:
            prefills, decodes = list(self._cluster.prefills), list(self._cluster.decodes)
            positions = self._positions
            for iid, inst in self._changed.items():
                if inst.is_alive and iid in positions:     # a suspect may be left out
                    (prefills if inst.reg.role == "prefill" else decodes)[positions[iid]] = inst.view.state()
            self._changed.clear()
            self._cluster = ClusterState(tuple(prefills), tuple(decodes))
        return self._cluster

    def fitting(self, snap: ClusterState, num_tokens: int) -> ClusterState:
        """``snap`` without the prefill instances whose KV cache cannot hold a ``num_tokens``
        prompt (the scheduler core does not know their capacity); no prefills if none can."""
        if snap is self._cluster and num_tokens <= self._smallest_prefill:
            return snap
        instances = self.instances
        fits = tuple(p for p in snap.prefills if instances[p.instance_id].reg.max_context >= num_tokens)
        return snap if len(fits) == len(snap.prefills) else ClusterState(fits, snap.decodes)

    def _rebuild(self) -> ClusterState:
        prefills, decodes = [], []
        self._positions = {}
        # Suspects are left out of a role that has a trusted instance; a role with only suspects
        # keeps them, so a request probes them (an answer clears, more failures kill).
        trusted_roles = {i.role for i in self.instances.values() if i.is_alive and not i.is_suspect}
        for inst in self.instances.values():
            if inst.is_alive and not (inst.is_suspect and inst.role in trusted_roles):
                same_role = prefills if inst.reg.role == "prefill" else decodes
                self._positions[inst.instance_id] = len(same_role)
                same_role.append(inst.view.state())
        self._changed.clear()
        self._cluster = ClusterState(tuple(prefills), tuple(decodes))
        # Only this rebuild changes which prefills are live (and their registrations).
        self._smallest_prefill = min((self.instances[p.instance_id].reg.max_context for p in prefills), default=0)
        return self._cluster


def _int_or_none(value: float | None) -> int | None:
    return int(value) if value is not None and value > 0 else None
