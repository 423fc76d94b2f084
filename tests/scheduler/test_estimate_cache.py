"""The estimators cache derived data on state objects (estimate.py); asking the same state
again, at other times, must give exactly what the definitions give from scratch."""

from dataclasses import replace

from hypothesis import example, given, settings, strategies as st

from mooncake_lite.scheduler import (CostModels, DecodeCostModel, DecodeInstanceState,
                                     DecodingRequest, IncomingRequest, PrefillCostModel,
                                     PrefillInstanceState, QueuedPrefill, carry_queue_estimates,
                                     carry_running_estimates)
from mooncake_lite.scheduler.estimate import (MAX_TBT_DRIFT, decode_load_at, decode_load_now, prefill_queue_time,
                                              prefill_views, running_load)

COSTS = CostModels(prefill=PrefillCostModel(c0=0.01, c1=1e-3, c2=1e-7),
                   decode=DecodeCostModel(c0=0.01, c1=1e-3, c2=1e-6), kv_bytes_per_token=1)
times = st.floats(-50, 50, allow_nan=False)


@st.composite
def decode_states(draw):
    running = tuple(DecodingRequest(f"r{i}", draw(st.integers(1, 5000)), draw(times),
                                    draw(st.one_of(st.none(), st.integers(1, 2000))))
                    for i in range(draw(st.integers(0, 12))))
    return DecodeInstanceState("d", running)


def current_tbt(d: DecodeInstanceState) -> float:
    return COSTS.decode.predict(len(d.running), sum(r.context_tokens for r in d.running))


def staying_by_definition(d: DecodeInstanceState, t: float, uniform: float | None,
                          tbt: float | None = None) -> tuple[int, int]:
    tbt = current_tbt(d) if tbt is None else tbt
    left = [r for r in d.running
            if (uniform is not None and r.joined_at + uniform > t)
            or (uniform is None and (r.max_output_tokens is None or r.joined_at + r.max_output_tokens * tbt > t))]
    return len(left), sum(r.context_tokens for r in left)


@settings(max_examples=150, deadline=None)
@given(decode_states(), st.lists(times, min_size=1, max_size=5), st.one_of(st.none(), st.floats(0.1, 30)))
def test_predicted_decode_load_matches_the_definition_on_every_query(d, ts, uniform):
    for t in ts:   # first query scans, the second builds the sorted profile, later ones bisect
        assert decode_load_at(d, COSTS, t, set(), uniform) == staying_by_definition(d, t, uniform)
    other = 5.0 if uniform is None else None   # another t_d setting must not reuse the cache
    assert decode_load_at(d, COSTS, ts[0], set(), other) == staying_by_definition(d, ts[0], other)


edits = st.lists(st.tuples(st.sampled_from(["join", "leave", "reorder"]), st.integers(1, 5000), times,
                           st.one_of(st.none(), st.integers(1, 2000)), st.integers(0, 100)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(decode_states(), edits, st.lists(times, min_size=1, max_size=3), st.one_of(st.none(), st.floats(0.1, 30)))
def test_a_chain_of_rebuilt_batches_predicts_like_the_definition(d, changes, ts, uniform):
    """The conductor rebuilds a decode state at every join and leave and carries the previous
    one's estimates: an edited profile must answer like the definition with the TBT it keeps,
    and that TBT must stay within MAX_TBT_DRIFT of the batch's current one."""
    decode_load_at(d, COSTS, ts[0], set(), uniform)
    for n, (kind, context, joined, max_output, pick) in enumerate(changes):
        running = d.running
        if kind == "join":
            running += (DecodingRequest(f"j{n}", context, joined, max_output),)
        elif kind == "leave" and running:
            i = pick % len(running)
            running = running[:i] + running[i + 1:]
        else:
            running = tuple(reversed(running))      # not one join or leave: built afresh
        new = DecodeInstanceState("d", running)
        carry_running_estimates(d, new)
        _check_edited(new, ts, uniform)
        d = new


def _check_edited(new: DecodeInstanceState, ts: list[float], uniform: float | None) -> None:
    decode_load_at(new, COSTS, ts[0], set(), uniform)
    kept = new._leave.tbt
    if uniform is None:
        assert abs(kept - current_tbt(new)) <= kept * MAX_TBT_DRIFT + 1e-12
    for t in ts:
        assert decode_load_at(new, COSTS, t, set(), uniform) == staying_by_definition(new, t, uniform, kept)


# Found by CI: a rebuild for TBT drift leaves ``d`` its own edited profile, whose kept TBT puts
# the request that joined at 20.0 just on the other side of t = 38.
_DRIFT_CASE = (DecodeInstanceState("d", tuple(DecodingRequest(f"r{i}", c, 0.0, None)
                                              for i, c in enumerate([1] * 9 + [4022, 5000]))),
               [("join", 1, 0.0, None, 0)] * 6 + [("join", 1, 20.0, 486, 0), ("join", 1, 0.0, None, 0)],
               [38.0], None, 1)


@settings(max_examples=150, deadline=None)
@given(decode_states(), edits, st.lists(times, min_size=1, max_size=3), st.one_of(st.none(), st.floats(0.1, 30)),
       st.integers(1, 3))
@example(*_DRIFT_CASE)
def test_stated_edits_carry_the_profile_like_the_definition(d, changes, ts, uniform, per_rebuild):
    """The live conductor states how the batch changed (several joins and leaves between two
    rebuilds): the profile edited by exactly those answers like the definition."""
    decode_load_at(d, COSTS, ts[0], set(), uniform)
    running, stated = d.running, []
    for n, (kind, context, joined, max_output, pick) in enumerate(changes):
        if kind == "join":
            r = DecodingRequest(f"j{n}", context, joined, max_output)
            running, stated = running + (r,), [*stated, (True, r)]
        elif kind == "leave" and running:
            i = pick % len(running)
            running, stated = running[:i] + running[i + 1:], [*stated, (False, running[i])]
        if stated and (len(stated) >= per_rebuild or n == len(changes) - 1):
            new = DecodeInstanceState("d", running)
            carry_running_estimates(d, new, stated)
            _check_edited(new, ts, uniform)
            # If the profile moved to ``new`` (edited in place), ``d`` builds a new one and answers
            # with its current TBT; if ``new`` rebuilt instead, ``d`` kept its own (and its TBT).
            kept = d._leave.tbt if d._leave is not None else None
            assert decode_load_at(d, COSTS, ts[-1], set(), uniform) == staying_by_definition(d, ts[-1], uniform, kept)
            d, stated = new, []


def test_stated_edits_that_do_not_describe_the_batch_rebuild_the_profile():
    a, b, c = (DecodingRequest(x, 100 * (i + 1), float(i), 10) for i, x in enumerate("abc"))
    old = DecodeInstanceState("d", (a, b))
    decode_load_at(old, COSTS, 0.0, set(), 5.0)
    for stated in ([(False, c)], [(True, c), (True, c)]):   # c was never there / joined once
        new = DecodeInstanceState("d", (a, b, c) if len(stated) == 2 else (a,))
        carry_running_estimates(old, new, stated)
        for t in (0.0, 5.5, 6.5, 7.5):
            assert decode_load_at(new, COSTS, t, set(), 5.0) == staying_by_definition(new, t, 5.0)
        # nothing derived from the refused edits stays behind (the batch's total, say)
        assert running_load(new) == decode_load_now(new) == (len(new.running), sum(r.context_tokens for r in new.running))
        old = DecodeInstanceState("d", (a, b))
        decode_load_at(old, COSTS, 0.0, set(), 5.0)


@st.composite
def prefill_states(draw):
    n = draw(st.integers(0, 6))
    started = draw(st.integers(0, n))
    queue = tuple(QueuedPrefill(f"q{i}", draw(st.integers(1, 4000)), draw(st.integers(0, 3000)),
                                draw(times) if i < started else None) for i in range(n))
    return PrefillInstanceState("p", "s", queue)


@settings(max_examples=150, deadline=None)
@given(prefill_states(), st.lists(times, min_size=1, max_size=5))
def test_queue_time_matches_the_definition_at_every_now(p, nows):
    for now in nows:
        total, done = 0.0, 0.0
        for i, job in enumerate(p.queue):
            cost = COSTS.prefill.predict(job.num_tokens, job.num_prefix_tokens)
            total += cost
            if job.started_at is not None and all(j.started_at is not None for j in p.queue[:i]):
                done += min(cost, max(0.0, now - job.started_at))
        assert abs(prefill_queue_time(p, COSTS, now) - (total - done)) < 1e-9


queue_edits = st.lists(st.tuples(st.sampled_from(["queue", "finish", "drop", "reorder"]), st.integers(1, 4000),
                                 st.integers(0, 3000), times, st.integers(0, 100)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(prefill_states(), queue_edits, st.lists(times, min_size=1, max_size=3))
def test_a_chain_of_rebuilt_queues_gives_exactly_the_fresh_backlog(p, changes, nows):
    """The conductor rebuilds a prefill state at every dispatch and prefill end and carries the
    previous one's estimates: the edited backlog must equal one computed from scratch."""
    prefill_views((p,), COSTS, nows[0])
    for n, (kind, tokens, prefix, now, pick) in enumerate(changes):
        queue = p.queue
        if kind == "queue":
            queue += (QueuedPrefill(f"n{n}", tokens, prefix, now if not queue else None),)
        elif kind == "finish" and queue:
            queue = queue[1:]
            if queue and queue[0].started_at is None:   # the next job starts, shown anew
                queue = (replace(queue[0], started_at=now), *queue[1:])
        elif kind == "drop" and queue:
            queue = queue[:pick % len(queue)] + queue[pick % len(queue) + 1:]
        else:
            queue = tuple(reversed(queue))
        new = PrefillInstanceState("p", "s", queue)
        carry_queue_estimates(p, new)
        fresh = PrefillInstanceState("p", "s", queue)
        for t in nows:
            assert prefill_views((new,), COSTS, t) == prefill_views((fresh,), COSTS, t)
        p = new


def test_a_rebuilt_state_reuses_running_estimates_only_for_the_same_batch():
    running = tuple(DecodingRequest(f"r{i}", 1000 * (i + 1), float(i), 100) for i in range(5))
    old = DecodeInstanceState("d", running)
    for t in (1.0, 2.0, 3.0):     # scan, profile, bisect: all cached on ``old``
        decode_load_at(old, COSTS, t, set(), None)
    same = DecodeInstanceState("d", running, incoming=(IncomingRequest("x", 10),))
    profile = old._leave
    carry_running_estimates(old, same)
    assert same._leave is profile and old._leave is None     # moved, not shared
    assert decode_load_at(old, COSTS, 2.0, set(), None) == staying_by_definition(old, 2.0, None)
    assert decode_load_at(same, COSTS, 2.0, set(), None) == (lambda b, c: (b + 1, c + 10))(
        *staying_by_definition(same, 2.0, None))
    other = DecodeInstanceState("d", running[:4])          # another batch: only a link to ``same`` is carried
    carry_running_estimates(same, other)
    assert decode_load_at(other, COSTS, 2.0, set(), None) == staying_by_definition(other, 2.0, None, other._leave.tbt)
