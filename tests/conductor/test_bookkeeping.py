"""Membership bookkeeping as the scheduler sees it (pure: no IO, time passed in)."""

from __future__ import annotations

import random

import pytest

from mooncake_lite.common.protocol import Heartbeat, InstanceLoad, Register
from mooncake_lite.conductor.cluster.membership import DecodeJob, Membership, PrefillJob, model_id
from mooncake_lite.scheduler import (MAX_CONTEXT_LAG, CostModels, DecodeCostModel, EstimateCache, PrefillCostModel,
                                     context_lag_bound)
from mooncake_lite.scheduler.estimate import loads_at, running_load

COSTS = CostModels(PrefillCostModel(c1=1e-3), DecodeCostModel(c0=0.01, c1=1e-3), kv_bytes_per_token=64)
T_D = 30.0


def _reg(role: str, iid: str, **kw) -> Register:
    base = dict(role=role, instance_id=iid, http=f"h-{iid}:1", data="d:1" if role == "decode" else None,
                store="s:1" if role == "prefill" else None, model="tiny", block_size=16, hash_seed=0,
                kv_bytes_per_token=64, max_context=1000)
    return Register(**{**base, **kw})


def test_prefill_queue_is_fifo_and_the_head_gets_a_start_time():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "p"), now=0)
    m.add_prefill("p", PrefillJob("a", 100, 0, "d"), now=1.0)
    m.add_prefill("p", PrefillJob("b", 50, 16, "d"), now=2.0)
    q = m.snapshot().prefills[0].queue
    assert [(j.request_id, j.started_at) for j in q] == [("a", 1.0), ("b", None)]
    m.prefill_done("p", "a", now=3.5)
    q = m.snapshot().prefills[0].queue
    assert [(j.request_id, j.started_at, j.num_prefix_tokens) for j in q] == [("b", 3.5, 16)]


def test_decode_batch_grows_with_tokens_and_release_forgets_everything():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "p"), now=0)
    m.register(_reg("decode", "d"), now=0)
    m.add_prefill("p", PrefillJob("a", 100, 0, "d"), now=0)
    m.watch("p", "a", lambda reason: None)
    m.prefill_done("p", "a", now=1)
    m.add_decode("d", DecodeJob("a", 101, 1.0, 8))
    m.decode_progress("d", "a")
    m.decode_progress("d", "a")
    d = m.snapshot().decodes[0]
    assert [(r.context_tokens, r.joined_at, r.max_output_tokens) for r in d.running] == [(103, 1.0, 8)]
    assert d.max_context_tokens == 1000         # Register.max_context: the decode's KV capacity
    m.release("a", ("p", "d"), now=2)
    snap = m.snapshot()
    assert snap.decodes[0].running == () and snap.prefills[0].queue == ()
    assert not m.instances["p"].watchers


def test_a_dispatched_request_is_incoming_on_its_decode_until_its_kv_arrives():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "p"), now=0)
    m.register(_reg("decode", "d0"), now=0)
    m.register(_reg("decode", "d1"), now=0)
    m.add_prefill("p", PrefillJob("a", 100, 0, "d0", max_output_tokens=8), now=0)
    m.add_prefill("p", PrefillJob("b", 50, 0, "d1"), now=0)
    m.add_prefill("p", PrefillJob("c", 70, 0, "d0"), now=0)
    d0, d1 = m.snapshot().decodes
    assert [(r.request_id, r.context_tokens, r.max_output_tokens) for r in d0.incoming] == \
        [("a", 101, 8), ("c", 71, None)]
    assert [r.request_id for r in d1.incoming] == ["b"] and d0.running == ()
    m.prefill_done("p", "a", now=1)                 # KV arrived: running, no longer incoming
    m.add_decode("d0", DecodeJob("a", 101, 1.0, 8))
    d0 = m.snapshot().decodes[0]
    assert [r.request_id for r in d0.incoming] == ["c"] and [r.request_id for r in d0.running] == ["a"]
    m.release("c", ("p", "d0"), now=2)              # failed or aborted before its KV came
    m.release("b", ("p", "d1"), now=2)
    assert all(d.incoming == () for d in m.snapshot().decodes)


def test_reap_marks_silent_instances_dead_and_tells_their_requests():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "p"), now=0)
    m.register(_reg("decode", "d"), now=0)
    told = []
    m.watch("d", "r1", told.append)
    m.heartbeat(Heartbeat("p"), now=4)
    assert m.reap(now=5.5) == [m.instances["d"]]
    assert len(told) == 1 and "stopped heartbeating" in told[0]
    assert [d.instance_id for d in m.snapshot().decodes] == [] and len(m.snapshot().prefills) == 1
    m.heartbeat(Heartbeat("d"), now=6)         # back again
    assert [d.instance_id for d in m.snapshot().decodes] == ["d"]


def test_model_ids_compare_checkpoint_directories_by_name():
    assert model_id("tiny") == "tiny"
    assert model_id("/models/Qwen2-0.5B/") == "Qwen2-0.5B" == model_id("/mnt/other/Qwen2-0.5B")


# ---- cached scheduler states ---------------------------------------------------------------
class Tables:
    """The jobs as this test dispatched them (FIFO queues, true decode contexts), kept apart
    from Membership — whose jobs are its instances' views — to check what it shows against."""

    def __init__(self, m: Membership) -> None:
        self.m = m
        self.queues: dict[str, dict[str, list]] = {}     # prefill -> request -> [tokens, prefix, started_at, decode]
        self.running: dict[str, dict[str, list]] = {}    # decode -> request -> [context, joined_at, max_output]
        self.incoming: dict[str, dict[str, int]] = {}    # decode -> request -> context its KV brings

    def add_prefill(self, pid: str, job: PrefillJob, now: float) -> None:
        self.m.add_prefill(pid, job, now)
        queue = self.queues.setdefault(pid, {})
        queue[job.request_id] = [job.num_tokens, job.num_prefix_tokens, None if queue else now, job.decode_id]
        self.incoming.setdefault(job.decode_id, {})[job.request_id] = job.num_tokens + 1

    def prefill_done(self, pid: str, rid: str, now: float) -> None:
        self.m.prefill_done(pid, rid, now)
        self._dequeue(pid, rid, now)

    def _dequeue(self, pid: str, rid: str, now: float) -> None:
        queue = self.queues.get(pid, {})
        if queue.pop(rid, None) is not None and queue:
            head = next(iter(queue.values()))
            head[2] = now if head[2] is None else head[2]     # the next starts as this one ends

    def add_decode(self, did: str, job: DecodeJob) -> None:
        self.m.add_decode(did, job)
        if self.m.get(did):
            self.incoming.get(did, {}).pop(job.request_id, None)
            self.running.setdefault(did, {})[job.request_id] = [job.context_tokens, job.joined_at,
                                                                 job.max_output_tokens]

    def progress(self, did: str, rid: str) -> None:
        self.m.decode_progress(did, rid)
        if rid in self.running.get(did, {}):
            self.running[did][rid][0] += 1

    def release(self, rid: str, ids: tuple[str, ...], now: float) -> None:
        self.m.release(rid, ids, now)
        for iid in ids:
            self.running.get(iid, {}).pop(rid, None)
            self.incoming.get(iid, {}).pop(rid, None)
            self._dequeue(iid, rid, now)

    def reap(self, now: float) -> None:
        for inst in self.m.reap(now):       # a dead instance's jobs are gone
            for table in (self.queues, self.running, self.incoming):
                table.pop(inst.instance_id, None)


def _exact(t: Tables):
    """The snapshot as the test's own tables say it must be."""
    prefills, decodes = [], []
    for inst in t.m.instances.values():
        if not inst.is_alive:
            continue
        iid = inst.instance_id
        if inst.role == "prefill":
            prefills.append((iid, [(rid, n, prefix, started) for rid, (n, prefix, started, _)
                                   in t.queues.get(iid, {}).items()]))
        else:
            decodes.append((iid, inst.load.max_batch_size,
                            [(rid, *job) for rid, job in t.running.get(iid, {}).items()],
                            list(t.incoming.get(iid, {}).items())))
    return prefills, decodes


def _check_against_exact(t: Tables, cache: EstimateCache | None = None) -> None:
    snap = t.m.snapshot()
    prefills, decodes = _exact(t)
    assert [(p.instance_id, [(q.request_id, q.num_tokens, q.num_prefix_tokens, q.started_at) for q in p.queue])
            for p in snap.prefills] == prefills
    assert [d.instance_id for d in snap.decodes] == [d[0] for d in decodes]
    for d, (_, max_batch, running, incoming) in zip(snap.decodes, decodes):
        assert d.max_batch_size == (int(max_batch) if max_batch else None)
        assert [(r.request_id, r.context_tokens) for r in d.incoming] == incoming
        assert [(r.request_id, r.joined_at, r.max_output_tokens) for r in d.running] == \
            [(rid, joined, out) for rid, _, joined, out in running]
        lags = [true_context - shown.context_tokens for shown, (_, true_context, _, _) in zip(d.running, running)]
        assert min(lags, default=0) >= 0
        assert sum(lags) <= context_lag_bound(sum(r.context_tokens for r in d.running))
        # The scheduler's leave profile — through its estimate cache, edited by the joins and
        # leaves since the last snapshot — predicts exactly as the shown batch does (uniform t_d:
        # no TBT drift; nothing queued, so every incoming request joins at the time asked).
        assert running_load(d) == (len(d.running), sum(r.context_tokens for r in d.running))
        profiles = (cache or EstimateCache()).leave_profiles((d,), COSTS, T_D)
        for t in (0.0, 20.0, 40.0, 80.0):
            staying = [r.context_tokens for r in d.running if r.joined_at + T_D > t]
            staying += [r.context_tokens for r in d.incoming]
            assert loads_at((d,), profiles, t, t, None, T_D, COSTS.decode) == [(len(staying), sum(staying))]


@pytest.mark.parametrize("seed", range(12))
def test_cached_states_always_match_the_tables_within_the_context_lag(seed):
    """Random dispatches, prefill ends, tokens, releases, heartbeats, deaths and revivals, with
    snapshots taken at random points: the cached view never shows anything but the truth (decode
    contexts behind by at most context_lag_bound in total)."""
    rng = random.Random(seed)
    m, cache = Membership("tiny", 16, 0, dead_after_s=5), EstimateCache()
    t = Tables(m)
    ids = {"prefill": ["p0", "p1", "p2"], "decode": ["d0", "d1", "d2"]}
    for role, names in ids.items():
        for iid in names:
            m.register(_reg(role, iid), now=0)
    now, n = 0.0, 0
    for _ in range(400):
        now += rng.uniform(0, 0.5)
        op = rng.random()
        live = {r: [i for i in names if m.get(i)] for r, names in ids.items()}
        queued = [(i.instance_id, rid, job[0], job[3]) for i in m.alive("prefill")
                  for rid, job in t.queues.get(i.instance_id, {}).items()]
        running = [(i.instance_id, rid, None, i.instance_id) for i in m.alive("decode")
                   for rid in t.running.get(i.instance_id, {})]
        if op < 0.25 and live["prefill"] and live["decode"]:
            n += 1
            # prompts short and long: the lag bound is absolute for some, relative for others
            prompt = rng.choice([1, 9, 90]) * rng.randint(1, 500)
            t.add_prefill(rng.choice(live["prefill"]), PrefillJob(f"r{n}", prompt, 0, rng.choice(live["decode"])), now)
        elif op < 0.4 and queued:
            pid, rid, num_tokens, did = rng.choice(queued)
            t.prefill_done(pid, rid, now)
            t.add_decode(did, DecodeJob(rid, num_tokens + 1, now, 64))
        elif op < 0.7 and running:
            did, rid, _, _ = rng.choice(running)
            for _ in range(rng.randint(1, 120)):
                t.progress(did, rid)
        elif op < 0.8 and (queued or running):
            iid, rid, _, did = rng.choice(queued + running)
            t.release(rid, (iid, did), now)
        elif op < 0.9:
            iid = rng.choice(ids["prefill"] + ids["decode"])
            m.heartbeat(Heartbeat(iid, InstanceLoad(max_batch_size=float(rng.choice([8, 16])))), now)
        else:
            for iid in ids["prefill"] + ids["decode"]:
                if rng.random() < 0.8:
                    m.heartbeat(Heartbeat(iid, m.instances[iid].load), now)
            t.reap(now + 5.01 if rng.random() < 0.3 else now)
        if rng.random() < 0.5:
            _check_against_exact(t, cache)
    _check_against_exact(t, cache)


def test_only_changed_instances_get_new_states():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    for role, iid in (("prefill", "p0"), ("prefill", "p1"), ("decode", "d0"), ("decode", "d1")):
        m.register(_reg(role, iid), now=0)
    m.add_prefill("p0", PrefillJob("a", 100, 0, "d0"), now=0)
    m.prefill_done("p0", "a", now=1)
    m.add_decode("d0", DecodeJob("a", 101, 1.0, 64))
    before = m.snapshot()
    for _ in range(MAX_CONTEXT_LAG):                     # within the lag: the same snapshot
        m.decode_progress("d0", "a")
    assert m.snapshot() is before
    m.decode_progress("d0", "a")                          # one more: d0 is rebuilt, alone
    after = m.snapshot()
    assert after.decodes[0] is not before.decodes[0] and after.decodes[0].running[0].context_tokens == 134
    assert after.decodes[1] is before.decodes[1] and after.prefills == before.prefills
    assert all(a is b for a, b in zip(after.prefills, before.prefills))
    m.add_prefill("p1", PrefillJob("b", 50, 0, "d1"), now=2)   # a dispatch touches its two instances
    third = m.snapshot()
    assert third.prefills[0] is after.prefills[0] and third.decodes[0] is after.decodes[0]
    assert third.prefills[1] is not after.prefills[1] and third.decodes[1] is not after.decodes[1]
    m.heartbeat(Heartbeat("d0", InstanceLoad(queued_s=1.0)), now=3)    # a load field no state shows
    assert m.snapshot() is third
    m.heartbeat(Heartbeat("d0", InstanceLoad(max_batch_size=4.0)), now=3)
    assert m.snapshot().decodes[0].max_batch_size == 4


def test_a_re_registered_decode_keeps_its_batch_within_the_lag_bound():
    """Re-registering at the same address keeps the jobs (and their shown records) but starts a
    new Instance: its lag is recounted at the next snapshot and must still be bounded."""
    m = Membership("tiny", 16, 0, dead_after_s=5)
    t = Tables(m)
    m.register(_reg("decode", "d"), now=0)
    t.add_decode("d", DecodeJob("a", 100, 0.0, 64))
    m.snapshot()
    for _ in range(30):                              # within the bound of 32
        t.progress("d", "a")
    m.register(_reg("decode", "d"), now=1)
    for _ in range(30):                              # 60 behind the shown record in all
        t.progress("d", "a")
    _check_against_exact(t)
    assert m.snapshot().decodes[0].running[0].context_tokens == 160


def test_fitting_leaves_out_prefills_too_small_for_the_prompt_as_registrations_change():
    m = Membership("tiny", 16, 0, dead_after_s=5)
    m.register(_reg("prefill", "small", max_context=100), now=0)
    m.register(_reg("prefill", "large", max_context=500), now=0)
    m.register(_reg("decode", "d"), now=0)
    ids = lambda snap: [p.instance_id for p in snap.prefills]  # noqa: E731
    snap = m.snapshot()
    assert m.fitting(snap, 100) is snap
    assert ids(m.fitting(snap, 101)) == ["large"] and ids(m.fitting(snap, 501)) == []
    m.register(_reg("prefill", "large", max_context=50), now=1)    # restarted with less memory
    snap = m.snapshot()
    assert ids(m.fitting(snap, 60)) == ["small"] and ids(m.fitting(snap, 50)) == ["small", "large"]
    m.reap(now=10)                                                  # all silent: nothing fits
    m.heartbeat(Heartbeat("small", InstanceLoad()), now=10)                     # ... until one comes back
    assert ids(m.fitting(m.snapshot(), 100)) == ["small"]
