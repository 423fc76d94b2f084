"""Instance views (scheduler/view.py): what a state shows against the events told."""

from __future__ import annotations

import random

import pytest

from mooncake_lite.scheduler import (MAX_CONTEXT_LAG, MAX_TBT_DRIFT, DecodeCostModel, DecodeView, PrefillView,
                                     context_lag_bound)

COST = DecodeCostModel(c0=0.05, c1=1e-3, c2=1e-7)


def test_a_prefill_view_shows_its_fifo_and_when_the_head_started():
    v = PrefillView("p", "s", 1e9)
    v.add("a", 100, 0, started_at=1.0)
    v.add("b", 50, 16)
    first = v.state()
    assert v.state() is first                                # nothing changed: the same state
    assert [(q.request_id, q.started_at) for q in first.queue] == [("a", 1.0), ("b", None)]
    assert (first.store_id, first.bandwidth_bytes_per_s) == ("s", 1e9)
    v.remove("a")
    v.start("b", 3.5)
    assert [(q.request_id, q.num_prefix_tokens, q.started_at) for q in v.state().queue] == [("b", 16, 3.5)]
    assert not v.remove("a")
    v.set_instance("s2", None, None)
    assert v.state().store_id == "s2"


def test_a_decode_view_moves_a_request_from_incoming_to_running_and_forgets_it():
    v = DecodeView("d", COST, max_batch_size=8)
    v.commit("a", 101, 16)
    assert [(r.request_id, r.context_tokens) for r in v.state().incoming] == [("a", 101)]
    v.join("a", 101, 2.0, 16)
    s = v.state()
    assert s.incoming == () and [(r.request_id, r.context_tokens, r.joined_at) for r in s.running] == [("a", 101, 2.0)]
    assert (s.max_batch_size, s.cost) == (8, COST)
    assert v.leave("a") and v.state().running == () and not v.leave("a")


def test_contexts_trail_by_at_most_the_lag_bound_and_tokens_alone_keep_the_state():
    v = DecodeView("d", COST)
    v.state()
    v.join("a", 100, 0.0, 64)
    before = v.state()
    assert not any(v.progress("a") for _ in range(MAX_CONTEXT_LAG))   # within the bound
    assert v.state() is before
    assert v.progress("a")                                             # one more: shown afresh
    assert v.state().running[0].context_tokens == 100 + MAX_CONTEXT_LAG + 1


def _current_tbt(v: DecodeView) -> float:
    s = v.state()
    return COST.predict(len(s.running), sum(r.context_tokens for r in s.running))


@pytest.mark.parametrize("seed", range(8))
def test_tbt_is_kept_across_joins_and_leaves_within_the_drift_and_reread_past_it(seed):
    """The TBT the running requests' t_d are sized with stays within MAX_TBT_DRIFT of the shown
    batch's predicted TBT, is kept while joins and leaves move that less, and is re-read
    whenever the batch is shown afresh (contexts refreshed) or moved more."""
    rng = random.Random(seed)
    v = DecodeView("d", COST)
    true_context: dict[str, int] = {}
    n, kept, reread = 0, 0, 0
    for _ in range(400):
        before = v.state().tbt_s
        if rng.random() < 0.5 or not true_context:
            n += 1
            true_context[f"r{n}"] = rng.randint(100, 20000)
            v.join(f"r{n}", true_context[f"r{n}"], 0.0, 64)
        elif rng.random() < 0.7:
            rid = rng.choice(sorted(true_context))
            del true_context[rid]
            v.leave(rid)
        else:
            for rid in true_context:
                tokens = rng.randint(0, 60)
                true_context[rid] += tokens
                v.progress(rid, tokens)
        s, current = v.state(), _current_tbt(v)
        assert abs(s.tbt_s - current) <= s.tbt_s * MAX_TBT_DRIFT
        if s.tbt_s == before:
            kept += 1
        else:
            assert s.tbt_s == current
            reread += 1
        assert [r.request_id for r in s.running] == list(true_context)
        lags = [true_context[r.request_id] - r.context_tokens for r in s.running]
        assert min(lags, default=0) >= 0
        assert sum(lags) <= context_lag_bound(sum(r.context_tokens for r in s.running))
    assert kept > 50 and reread > 10


def test_a_new_cost_model_rereads_the_tbt_and_no_model_leaves_it_to_the_scheduler():
    v = DecodeView("d", COST)
    v.join("a", 1000, 0.0, 64)
    assert v.state().tbt_s == COST.predict(1, 1000)
    other = DecodeCostModel(c0=0.2)
    v.set_cost(other)
    assert v.state().tbt_s == 0.2 and v.state().cost is other
    v.set_cost(None)
    assert v.state().tbt_s is None


def test_progress_of_a_whole_batch_is_progress_of_each():
    each, whole = DecodeView("d", COST), DecodeView("d", COST)
    for v in (each, whole):
        v.state()
        for i in range(3):
            v.join(f"r{i}", 100 * (i + 1), 0.0, 64)
        v.state()
    rids = ["r0", "r1", "r2"]
    for steps in (5, 5, 20):
        assert whole.progress_each(rids, steps) == any([each.progress(r, steps) for r in rids])
        assert whole.state() == each.state()


@pytest.mark.parametrize("seed", range(6))
def test_a_decode_views_load_kept_at_its_events_is_its_states_load_now(seed):
    """What the wide decode table reads from a snapshot's view instead of the estimate cache:
    the load now of the very state last built, kept from running totals through every event."""
    rng, v = random.Random(seed), DecodeView("d", COST, 8, 10**6)
    ids = [f"r{i}" for i in range(12)]
    members: list[str] = []
    for step in range(800):
        op = rng.choice(["commit", "commit", "uncommit", "join", "join", "progress", "step", "enter", "leave",
                         "leave", "limits", "cost"] + (["clear"] if step % 211 == 210 else []))
        rid, n = rng.choice(ids), rng.randint(1, 3000)
        if op == "commit":            # a new one, or the same id again (replaced where it stands)
            v.commit(rid, n, rng.choice([None, 40]))
        elif op == "uncommit":
            v.uncommit(rid)
        elif op == "join":            # committed or not, running already or not
            v.join(rid, n, float(step), 40)
            members = [m for m in members if m != rid]
        elif op == "progress":
            v.progress(rid, rng.randint(1, 50))
        elif op == "enter" and rid in v._jobs and rid not in members:
            v.enter_group(rid)
            members.append(rid)
        elif op == "step":
            v.progress_group(rng.randint(1, 30))
        elif op == "leave":
            v.leave(rid)
            members = [m for m in members if m != rid]
        elif op == "limits":
            v.set_limits(rng.choice([None, 8]), 10**6)
        elif op == "cost":
            v.set_cost(rng.choice([None, COST]))
        elif op == "clear":
            v.clear()
            members = []
        if rng.random() < 0.5:
            s = v.state()
            assert v.load == (s, len(s.running) + len(s.incoming),
                              sum(r.context_tokens for r in s.running) + sum(r.context_tokens for r in s.incoming))


@pytest.mark.parametrize("seed", range(6))
def test_a_prefill_views_priced_row_is_its_states_backlog(seed):
    """What the wide prefill table writes from a snapshot's view instead of deriving the
    backlog: the total predicted work and started head of the very state last built, priced
    with the instance's own model or the reader's default as jobs came and went."""
    from mooncake_lite.scheduler import PrefillCostModel
    from mooncake_lite.scheduler.estimate import backlog_of
    from mooncake_lite.scheduler.queue_order import enqueue
    rng = random.Random(seed)
    models = [None, PrefillCostModel(c0=0.02, c1=2e-3), PrefillCostModel(c1=5e-4, c2=1e-6, c3=1e-5)]
    default = PrefillCostModel(c0=0.01, c1=1e-3, c2=1e-7)
    v = PrefillView("p", "s", None, rng.choice(models))
    ids, now, priced, reports = [f"r{i}" for i in range(10)], 0.0, False, 0
    for step in range(600):
        now += rng.uniform(0, 1)
        op = rng.choice(["add", "add", "add", "start", "start", "remove", "remove", "ordered", "instance",
                         "default", "report"] + (["clear"] if step % 97 == 96 else []))
        jobs = list(v._jobs)
        if op == "add":                # a new id, or one queued already (replaced where it stands)
            v.add(rng.choice(ids), rng.randint(1, 4000), rng.randint(0, 3000), rng.choice([None, None, now]))
        elif op == "ordered":          # shortest-first order: the jobs it passes removed and added again
            rid = rng.choice(ids)
            if rid not in v._jobs:
                enqueue(v, rid, rng.randint(1, 4000), rng.randint(0, 3000), 2)
        elif op == "start" and jobs:   # mostly the head; sometimes two have started (a pack)
            v.start(jobs[0] if rng.random() < 0.8 else rng.choice(jobs), now)
        elif op == "remove" and jobs:  # mostly the head; an abort anywhere
            v.remove(jobs[0] if rng.random() < 0.7 else rng.choice(jobs))
        elif op == "report" and jobs:  # its instance's heartbeat: the running job's end (the head's only)
            rid = jobs[0] if rng.random() < 0.8 else rng.choice(jobs)
            was = v._jobs[rid]
            follow = rng.random() < 0.3     # the live conductor's: the view follows the instance's job
            ends = now + rng.uniform(-1.0, 5.0)
            shown = v.report_end(rid, ends, now if follow else None)
            assert shown == (follow or rid == jobs[0] and was.started_at is not None)
            assert shown or v._jobs[rid] is was
            if follow and not (rid == jobs[0] and was.started_at is not None):   # the view followed:
                # the instance's job first, started, the rest waiting in their order
                queue = v.state().queue
                assert queue[0].request_id == rid and queue[0].ends_at == ends and queue[0].started_at is not None
                assert [j.request_id for j in queue[1:]] == [j for j in jobs if j != rid]
                assert all(j.started_at is None for j in queue[1:])
            reports += shown
        elif op == "instance":
            v.set_instance("s", None, rng.choice(models), rng.choice([0, 0, 0, 512]), rng.choice([0, 0, 2]))
        elif op == "default":
            v.price_with(default)
            priced = True
        elif op == "clear":
            v.clear()
        if rng.random() < 0.5:
            s = v.state()
            model = s.cost or default
            if s.pack_tokens or s.cost is None and not priced:   # packed, or no model named yet
                assert v.row is None
                continue
            b = backlog_of(s, model)
            if len(b.started) > 1:
                assert v.row is None
            else:
                assert v.row == (s, model, b.cumulative_s[-1] if b.cumulative_s else 0.0,
                                 b.started[0] if b.started else None)
                assert v.row[0] is s and v.row[1] is model
    assert reports        # the reported ends were priced, not only refused
