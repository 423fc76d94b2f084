"""The hot-block tracker: heat over a sliding window, and the replication plans it makes
(threshold, budget, prefix order, no copy to a store that holds the block, cold blocks ignored)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from mooncake_lite.scheduler.block_index import BlockIndex
from mooncake_lite.scheduler.hot import HotConfig, HotTracker, Replication
from mooncake_lite.scheduler.links import LinkSpeeds

BLOCK = 1000                   # bytes per block
PRIOR = 1e6                    # bytes/s: with share 0.1 and period 1 s, a budget of 100 blocks


def _chain(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def _tracker(**kw) -> HotTracker:
    return HotTracker(HotConfig(**{"threshold": 3, "window_s": 10.0, "share": 0.1, "period_s": 1.0, **kw}))


def _plan(tracker: HotTracker, index: BlockIndex, now: float = 0.0, targets=("B",), **kw):
    return tracker.plan(now, index, targets, block_bytes=BLOCK, prior_bytes_per_s=PRIOR, **kw)


def _index(**held) -> BlockIndex:
    index = BlockIndex()
    for store, keys in held.items():
        index.add(store, keys)
    return index


def test_blocks_reused_by_threshold_requests_are_copied_in_prefix_order():
    keys = _chain("a", 4)
    tracker, index = _tracker(), _index(A=keys)
    for t in range(2):
        tracker.note(t, keys)
    assert _plan(tracker, index, now=2).replications == ()     # used twice: not hot yet
    tracker.note(2, keys)
    plan = _plan(tracker, index, now=2)
    assert plan.num_hot == 4
    assert plan.replications == (Replication("A", "B", tuple(keys), 0, 4 * BLOCK),)


def test_cold_blocks_are_ignored_and_only_the_hot_leading_run_goes():
    shared, tails = _chain("s", 2), [_chain(f"t{i}-", 2) for i in range(3)]
    tracker = _tracker()
    index = _index(A=shared + [k for t in tails for k in t])
    for i, tail in enumerate(tails):                 # one shared prefix, three different suffixes
        tracker.note(i, shared + tail)
    plan = _plan(tracker, index, now=3)
    assert [r.keys for r in plan.replications] == [tuple(shared)]
    assert tracker.heat("s0") == 3 and tracker.heat("t0-0") == 1


def test_uses_older_than_the_window_are_forgotten():
    keys = _chain("a", 2)
    tracker, index = _tracker(window_s=10.0), _index(A=keys)
    for t in (0, 1, 2):
        tracker.note(t, keys)
    assert _plan(tracker, index, now=9.5).num_hot == 2
    assert _plan(tracker, index, now=10.5, targets=("C",)).num_hot == 0     # the use at 0 expired
    assert tracker.heat("a0") == 2


def test_no_copy_to_a_store_that_holds_the_block_and_the_copy_starts_after_what_it_has():
    keys = _chain("a", 5)
    tracker, index = _tracker(), _index(A=keys, B=keys[:2])
    for t in range(3):
        tracker.note(t, keys)
    plan = _plan(tracker, index, now=3, targets=("A", "B"))
    assert plan.replications == (Replication("A", "B", tuple(keys[2:]), 2, 3 * BLOCK),)


def test_the_byte_budget_is_share_times_link_speed_times_period():
    keys = _chain("a", 10)
    tracker, index = _tracker(share=0.1), _index(A=keys)
    for t in range(3):
        tracker.note(t, keys)
    links = LinkSpeeds(min_bytes=1)
    links.observe("A", "B", 4 * BLOCK * 10, 1.0)     # 40 kB/s measured: 0.1 s of it moves 4 blocks
    plan = _plan(tracker, index, now=3, links=links)
    assert [len(r.keys) for r in plan.replications] == [4]
    # the rest follows in later plans; what was planned is not planned again meanwhile
    later = _plan(tracker, index, now=4, links=links)
    assert later.replications == (Replication("A", "B", tuple(keys[4:8]), 4, 4 * BLOCK),)


def test_a_source_sends_within_its_own_budget_over_all_targets_and_another_holder_takes_over():
    keys = _chain("a", 3)                        # budget: 100 blocks a link a plan (PRIOR, share 0.1)
    many = [f"t{i}" for i in range(40)]          # 40 targets x 3 blocks = 120 blocks wanted
    tracker, index = _tracker(), _index(A=keys)
    for t in range(3):
        tracker.note(t, keys)
    plan = _plan(tracker, index, now=3, targets=many)
    assert 99 <= sum(len(r.keys) for r in plan.replications) <= 100   # A's own share; the rest wait
    tracker, index = _tracker(), _index(A=keys, E=keys)           # a second holder: both send
    for t in range(3):
        tracker.note(t, keys)
    plan = _plan(tracker, index, now=3, targets=many)
    sent = {s: sum(len(r.keys) for r in plan.replications if r.source == s) for s in "AE"}
    assert sum(sent.values()) == 120 and max(sent.values()) <= 100


def test_a_budget_below_one_block_copies_nothing_and_share_zero_is_off():
    keys = _chain("a", 3)
    for kw in ({"share": 0.0}, {"share": 0.1, "period_s": 0.001}):    # 0.1 ms of a 1 MB/s link: 100 bytes
        tracker, index = _tracker(**kw), _index(A=keys)
        for t in range(3):
            tracker.note(t, keys)
        assert _plan(tracker, index, now=3).replications == ()


def test_the_fastest_source_is_used_and_busy_or_recently_planned_targets_are_skipped():
    keys = _chain("a", 2)
    tracker, index = _tracker(recheck_s=5.0), _index(A=keys, C=keys)
    for t in range(3):
        tracker.note(t, keys)
    links = LinkSpeeds(min_bytes=1)
    links.observe("C", "B", 1e7, 1.0)                # C → B measured faster than the 1 MB/s prior
    assert _plan(tracker, index, now=3, busy=("B",), links=links).replications == ()
    plan = _plan(tracker, index, now=3, links=links)
    assert [(r.source, r.target) for r in plan.replications] == [("C", "B")]
    assert _plan(tracker, index, now=4, links=links).replications == ()      # planned 1 s ago
    assert _plan(tracker, index, now=8.5, links=links).replications != ()    # the index never heard: again


def test_a_block_whose_predecessor_the_target_will_not_hold_is_skipped():
    keys = _chain("a", 3)
    tracker, index = _tracker(), _index(A=keys[1:])          # the first block is gone everywhere
    for t in range(3):
        tracker.note(t, keys)
    assert _plan(tracker, index, now=3).replications == ()


def test_the_hottest_prefix_goes_first_within_the_budget():
    warm, hot = _chain("w", 2), _chain("h", 2)
    tracker, index = _tracker(period_s=0.02), _index(A=warm + hot)    # 2 ms of a 1 MB/s link: 2 blocks
    for t in range(3):
        tracker.note(t, warm)
    for t in range(5):
        tracker.note(t, hot)
    plan = _plan(tracker, index, now=5)
    assert [r.keys for r in plan.replications] == [tuple(hot)]


def test_bad_configs_are_refused():
    for kw in ({"threshold": 0}, {"share": 1.5}, {"window_s": 0}, {"period_s": -1}, {"max_requests": 0},
               {"max_hot": 0}):
        with pytest.raises(ValueError):
            HotConfig(**kw)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=30),
       st.integers(1, 4), st.integers(1, 12), st.sets(st.sampled_from("ABC"), max_size=3))
def test_every_plan_is_hot_sourced_budgeted_new_and_reusable(uses, threshold, budget_blocks, targets):
    """Whatever the uses: each planned block is hot, held by its source, absent at its target,
    in prefix order after blocks the target holds or gets; each target and each source within
    its budget."""
    chains = {c: _chain(f"c{c}-", 6) for c in range(4)}
    index = _index(A=[k for ch in chains.values() for k in ch], B=chains[0][:3])
    tracker = _tracker(threshold=threshold, period_s=budget_blocks * BLOCK / PRIOR / 0.1)
    for t, (c, n) in enumerate(uses):
        tracker.note(t * 0.1, chains[c][:n])
    plan = _plan(tracker, index, now=len(uses) * 0.1, targets=targets)
    for source in "ABC":
        assert sum(len(r.keys) for r in plan.replications if r.source == source) <= budget_blocks
    for target in targets:
        reps = [r for r in plan.replications if r.target == target]
        assert sum(len(r.keys) for r in reps) <= budget_blocks
        held = set(k for ch in chains.values() for k in ch if target in index.holders(k))
        for r in reps:
            for i, key in enumerate(r.keys):
                assert tracker.heat(key) >= threshold and r.source in index.holders(key)
                assert key not in held and int(key.split("-")[1]) == r.first_pos + i
                pos = r.first_pos + i
                assert pos == 0 or f"{key.split('-')[0]}-{pos - 1}" in held
                held.add(key)


def test_a_plan_considers_only_the_hottest_max_hot_blocks_but_counts_them_all():
    warm, hot = _chain("w", 3), _chain("h", 2)
    tracker, index = _tracker(max_hot=2), _index(A=warm + hot)
    for t in range(3):
        tracker.note(t, warm)
    for t in range(4):
        tracker.note(t, hot)
    plan = _plan(tracker, index, now=4)
    assert plan.num_hot == 5 and [r.keys for r in plan.replications] == [tuple(hot)]
