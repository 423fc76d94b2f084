"""Cluster membership and in-flight bookkeeping: who is alive, what each instance is doing.

Prefill and decode instances register (refused on model / block size / hash seed mismatch) and
heartbeat; one silent for ``dead_after_s`` is marked dead, leaves every scheduling snapshot,
and the requests in flight on it are told (their ``on_death`` callback) so they fail cleanly.
A dead instance that heartbeats again comes back. Queues and batches are the conductor's own
record of what it dispatched — the scheduler reads them as a :class:`ClusterState` snapshot; a
request dispatched to a decode instance counts there as ``incoming`` from dispatch until its KV
has arrived (the first token), so a burst is spread instead of herding onto one instance.

Each instance's scheduler state is built once and kept until something it shows changes (a job
added, started, finished or released; a heartbeat changing its capacity or bandwidth; death):
the scheduler caches derived data on the state objects, so a decision pays only for the
instances that changed since the last one (docs/conductor.md, "Decision time"). The states are
built in ``conductor/view.py``; the event handlers here keep the shown queue, batch and incoming
tuples current. Generated
tokens alone rebuild a decode instance's state only once its running requests together are
further ahead of it than :func:`~mooncake_lite.scheduler.context_lag_bound` allows, as in the
simulator.

No IO here and no clock: ``now`` is passed in (the app uses the event loop's monotonic time).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from mooncake_lite.common.protocol import Heartbeat, Register
from mooncake_lite.conductor.costs import InstanceCosts, parse_instance_costs
from mooncake_lite.conductor.view import build_state, incoming_record, queued_record, shown_record, unshow
from mooncake_lite.scheduler import (ClusterState, DecodeInstanceState, DecodingRequest,
                                     IncomingRequest, PrefillInstanceState, QueuedPrefill,
                                     context_lag_bound)

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


def model_id(name_or_dir: str) -> str:
    """The id a model is served and compared under: the preset name, or a checkpoint
    directory's base name (paths differ between machines, the directory name does not)."""
    if os.path.sep in name_or_dir or os.path.isdir(name_or_dir):
        return os.path.basename(os.path.normpath(name_or_dir))
    return name_or_dir


@dataclass
class PrefillJob:
    request_id: str
    num_tokens: int
    num_prefix_tokens: int
    decode_id: str
    started_at: float | None = None
    max_output_tokens: int | None = None
    # Built once and reused by every state showing the job (a state object costs ~1 µs).
    queued: QueuedPrefill | None = field(default=None, repr=False, compare=False)
    incoming: IncomingRequest | None = field(default=None, repr=False, compare=False)


@dataclass
class DecodeJob:
    request_id: str
    context_tokens: int
    joined_at: float
    max_output_tokens: int
    # The job as the decode state shows it (built when it joins); its context trails ours by
    # the tokens generated since, counted in Instance.context_lag.
    shown: DecodingRequest | None = field(default=None, repr=False, compare=False)


@dataclass
class Instance:
    reg: Register
    costs: InstanceCosts
    last_seen: float
    is_alive: bool = True
    load: dict[str, float] = field(default_factory=dict)
    prefill_jobs: dict[str, PrefillJob] = field(default_factory=dict)   # dispatch order
    decode_jobs: dict[str, DecodeJob] = field(default_factory=dict)
    # Decode side: dispatched here, KV not arrived yet (the scheduler counts them as coming).
    incoming_jobs: dict[str, PrefillJob] = field(default_factory=dict)
    watchers: dict[str, Callable[[str], None]] = field(default_factory=dict)
    # The scheduler's view of this instance, rebuilt at the next snapshot once it is stale.
    state: PrefillInstanceState | DecodeInstanceState | None = field(default=None, repr=False)
    is_stale: bool = field(default=True, repr=False)
    # Decode: the running requests got further ahead of the shown batch than context_lag_bound;
    # the next rebuild refreshes every request's context (other rebuilds reuse the shown ones).
    is_context_stale: bool = field(default=False, repr=False)
    # Decode: the running batch as shown (kept up to date as requests join and leave), the sum
    # of its shown contexts, and how many tokens its requests generated beyond them in total.
    running: tuple[DecodingRequest, ...] | None = field(default=None, repr=False)
    # Decode: how ``running`` was edited since ``state`` was built — (True, record) appended,
    # (False, record) removed — so the scheduler can edit its estimates by just those (None:
    # not known, e.g. the batch was rebuilt; see carry_running_estimates).
    batch_edits: list[tuple[bool, DecodingRequest]] | None = field(default=None, repr=False)
    shown_context: int = field(default=0, repr=False)
    context_lag: int = field(default=0, repr=False)
    # Prefill: the queue as shown (kept up to date as jobs are added and end; None: rebuild).
    queue: tuple[QueuedPrefill, ...] | None = field(default=None, repr=False)
    # Decode: incoming_jobs as shown (None: rebuild). Both roles: what the state shows from the
    # registration and the last heartbeat (None: recompute), so a rebuild need not re-derive it.
    incoming: tuple[IncomingRequest, ...] | None = field(default=None, repr=False)
    limits: tuple | None = field(default=None, repr=False)

    @property
    def instance_id(self) -> str:
        return self.reg.instance_id

    @property
    def role(self) -> str:
        return self.reg.role


class Membership:
    """Owns the instance table. One owner (the conductor app); not thread-safe."""

    def __init__(self, model: str, block_size: int, hash_seed: int, dead_after_s: float) -> None:
        self.model_id = model_id(model)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.dead_after_s = dead_after_s
        self.instances: dict[str, Instance] = {}
        self.kv_bytes_per_token: int | None = None
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
            self._kill(old, f"{reg.role} instance {reg.instance_id} re-registered at {reg.http}")
        inst = Instance(reg, costs, now)
        if old is not None and old.reg.http == reg.http and old.role == reg.role:
            inst.prefill_jobs, inst.decode_jobs, inst.watchers = old.prefill_jobs, old.decode_jobs, old.watchers
            inst.incoming_jobs = old.incoming_jobs
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
    def _costs(reg: Register) -> InstanceCosts:
        try:
            return parse_instance_costs(reg.cost, reg.role)
        except ValueError as exc:
            raise RegistrationError(400, f"{reg.role} instance {reg.instance_id}: {exc}") from None

    def heartbeat(self, hb: Heartbeat, now: float) -> Instance | None:
        """Record liveness and load; None if the instance is unknown (it must register)."""
        inst = self.instances.get(hb.instance_id)
        if inst is None:
            return None
        if not inst.is_alive:
            log.warning("%s %s is back after being marked dead", inst.role, inst.instance_id)
            inst.is_alive = True
            self._positions = None
            self._touch(inst)
        inst.last_seen = now
        old, inst.load = inst.load, dict(hb.load)
        if any(old.get(k) != inst.load.get(k) for k in STATE_LOAD_KEYS):
            inst.limits = None
            self._touch(inst)
        return inst

    def reap(self, now: float) -> list[Instance]:
        """Mark every instance silent for longer than ``dead_after_s`` dead; returns them."""
        dead = [i for i in self.instances.values()
                if i.is_alive and now - i.last_seen > self.dead_after_s]
        for inst in dead:
            self._kill(inst, f"{inst.role} instance {inst.instance_id} stopped heartbeating "
                             f"(silent for {now - inst.last_seen:.1f}s)")
        return dead

    def _kill(self, inst: Instance, reason: str) -> None:
        log.warning("%s; failing its %d request(s) in flight", reason, len(inst.watchers))
        inst.is_alive = False
        watchers, inst.watchers = inst.watchers, {}
        inst.prefill_jobs.clear()
        inst.decode_jobs.clear()
        inst.incoming_jobs.clear()
        inst.running = inst.incoming = inst.queue = inst.batch_edits = None
        inst.shown_context = inst.context_lag = 0
        self._positions = None
        self._touch(inst)
        for notify in watchers.values():
            notify(reason)

    def alive(self, role: str | None = None) -> list[Instance]:
        return [i for i in self.instances.values() if i.is_alive and (role is None or i.role == role)]

    def get(self, instance_id: str) -> Instance | None:
        inst = self.instances.get(instance_id)
        return inst if inst is not None and inst.is_alive else None

    # ---- in-flight bookkeeping ------------------------------------------------------------
    def watch(self, instance_id: str, request_id: str, on_death: Callable[[str], None]) -> None:
        self.instances[instance_id].watchers[request_id] = on_death

    def add_prefill(self, instance_id: str, job: PrefillJob, now: float) -> None:
        """Queue ``job`` on its prefill instance and record it as incoming on its decode
        instance (``job.decode_id``) until :meth:`add_decode` says its KV arrived."""
        inst = self.instances[instance_id]
        if not inst.prefill_jobs:
            job.started_at = now
        inst.prefill_jobs[job.request_id] = job
        if inst.queue is not None:
            inst.queue = (*inst.queue, queued_record(job))
        self._touch(inst)
        decode = self.instances.get(job.decode_id)
        if decode is not None:
            decode.incoming_jobs[job.request_id] = job
            if decode.incoming is not None:
                decode.incoming = (*decode.incoming, incoming_record(job))
            self._touch(decode)

    def prefill_done(self, instance_id: str, request_id: str, now: float) -> None:
        inst = self.instances.get(instance_id)
        if inst is None or inst.prefill_jobs.pop(request_id, None) is None:
            return
        self._touch(inst)
        queue = inst.queue
        if queue is not None:
            inst.queue = queue[1:] if queue[0].request_id == request_id else \
                tuple(q for q in queue if q.request_id != request_id)
        head = next(iter(inst.prefill_jobs.values()), None)
        if head is not None and head.started_at is None:
            head.started_at = now  # FIFO: the next job starts when this one ends
            if inst.queue is not None:
                inst.queue = (queued_record(head), *inst.queue[1:])

    def add_decode(self, instance_id: str, job: DecodeJob) -> None:
        inst = self.get(instance_id)
        if inst is not None:
            self._not_incoming(inst, job.request_id)
            old = inst.decode_jobs.get(job.request_id)
            if old is not None:
                unshow(inst, old)
            inst.decode_jobs[job.request_id] = job
            if old is None and inst.running is not None:
                # Extend the shown batch here, at the event, not in the next decision's snapshot.
                shown = shown_record(job, False)
                inst.shown_context += shown.context_tokens
                inst.context_lag += job.context_tokens - shown.context_tokens
                inst.running = (*inst.running, shown)
                if inst.batch_edits is not None:
                    inst.batch_edits.append((True, shown))
            else:
                inst.running = inst.batch_edits = None   # rebuilt (and recounted) at the next snapshot
            self._touch(inst)

    def decode_progress(self, instance_id: str, request_id: str, num_new_tokens: int = 1) -> None:
        inst = self.instances.get(instance_id)
        job = inst.decode_jobs.get(request_id) if inst is not None else None
        if job is not None:
            job.context_tokens += num_new_tokens
            if job.shown is not None:   # else its record, still to be built, will show it all
                inst.context_lag += num_new_tokens
                self._check_lag(inst)

    def release(self, request_id: str, instance_ids: tuple[str, ...], now: float) -> None:
        """The request is over (any outcome): forget it everywhere."""
        for iid in instance_ids:
            inst = self.instances.get(iid)
            if inst is None:
                continue
            inst.watchers.pop(request_id, None)
            running = inst.decode_jobs.pop(request_id, None)
            incoming = self._not_incoming(inst, request_id)
            if running is not None:
                unshow(inst, running)
                self._check_lag(inst)     # a smaller batch allows less lag
                if inst.running is not None:
                    self._unlist(inst, running)
            if running is not None or incoming is not None:
                self._touch(inst)
            self.prefill_done(iid, request_id, now)

    # ---- scheduler view -------------------------------------------------------------------
    @staticmethod
    def _not_incoming(inst: Instance, request_id: str) -> PrefillJob | None:
        """Forget ``request_id`` as incoming on ``inst`` (its KV arrived, or it is over),
        editing the shown incoming tuple here rather than rebuilding it at the next snapshot."""
        job = inst.incoming_jobs.pop(request_id, None)
        if job is not None and inst.incoming is not None:
            record = job.incoming
            kept = tuple(r for r in inst.incoming if r is not record)
            inst.incoming = kept if record is not None and len(kept) == len(inst.incoming) - 1 else None
        return job

    @staticmethod
    def _unlist(inst: Instance, job: DecodeJob) -> None:
        """Take a leaving job's record out of the shown batch."""
        running = inst.running
        kept = tuple(r for r in running if r.request_id != job.request_id)
        inst.running = kept
        if inst.batch_edits is not None:
            if job.shown is not None and len(kept) == len(running) - 1:
                inst.batch_edits.append((False, job.shown))
            else:
                inst.batch_edits = None

    def _touch(self, inst: Instance) -> None:
        inst.is_stale = True
        self._changed[inst.instance_id] = inst

    def _check_lag(self, inst: Instance) -> None:
        if not inst.is_context_stale and inst.context_lag > context_lag_bound(inst.shown_context):
            inst.is_context_stale = True
            self._touch(inst)

    def snapshot(self) -> ClusterState:
        """The live instances as the scheduler sees them (dead ones left out). Unchanged
        instances keep their state objects (and the scheduler's data cached on them); only the
        entries of instances touched since the last snapshot are replaced."""
        if self._cluster is None or self._positions is None:
            return self._rebuild()
        if self._changed:
            prefills, decodes = list(self._cluster.prefills), list(self._cluster.decodes)
            for iid, inst in self._changed.items():
                if inst.is_stale and inst.is_alive:
                    (prefills if inst.reg.role == "prefill" else decodes)[self._positions[iid]] = build_state(inst)
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
        for inst in self.instances.values():
            if inst.is_alive:
                same_role = prefills if inst.reg.role == "prefill" else decodes
                self._positions[inst.instance_id] = len(same_role)
                same_role.append(build_state(inst) if inst.is_stale else inst.state)
        self._changed.clear()
        self._cluster = ClusterState(tuple(prefills), tuple(decodes))
        # Only this rebuild changes which prefills are live (and their registrations).
        self._smallest_prefill = min((self.instances[p.instance_id].reg.max_context for p in prefills), default=0)
        return self._cluster

