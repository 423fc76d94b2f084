"""The TP head split and the prefill-rank → decode-rank transfer plan (transfer/tp_heads.py)."""

from __future__ import annotations

import itertools

import pytest

from mooncake_lite.transfer.kv_layout import HeadRange, LayoutError
from mooncake_lite.transfer.tp_heads import HeadTransfer, plan_head_transfers, rank_heads, writes_heads


def plan(h, p, d, **kw):
    return [(t.src_rank, t.dst_rank, t.heads.start, t.heads.stop) for t in plan_head_transfers(h, p, d, **kw)]


def test_the_documented_topologies_of_six_heads():
    assert plan(6, 2, 1) == [(0, 0, 0, 3), (1, 0, 3, 6)]
    assert plan(6, 1, 3) == [(0, 0, 0, 2), (0, 1, 2, 4), (0, 2, 4, 6)]
    assert plan(6, 2, 3) == [(0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4), (1, 2, 4, 6)]
    assert plan(6, 3, 3) == [(0, 0, 0, 2), (1, 1, 2, 4), (2, 2, 4, 6)]


def test_replicated_heads_are_held_by_consecutive_ranks_and_written_once():
    assert [rank_heads(2, 4, r) for r in range(4)] == [HeadRange(0, 1), HeadRange(0, 1), HeadRange(1, 2),
                                                       HeadRange(1, 2)]
    assert [writes_heads(2, 4, r) for r in range(4)] == [True, False, True, False]
    assert [writes_heads(4, 2, r) for r in range(2)] == [True, True]
    # SmolLM2's 3 KV heads at TP=3: one each, no replication.
    assert [rank_heads(3, 3, r) for r in range(3)] == [HeadRange(r, r + 1) for r in range(3)]
    # Decode ranks that want the same head are spread over the prefill ranks holding it.
    assert plan(2, 4, 4) == [(0, 0, 0, 1), (1, 1, 0, 1), (2, 2, 1, 2), (3, 3, 1, 2)]
    assert plan(1, 2, 1) == [(0, 0, 0, 1)]


def test_a_replicated_layout_is_one_head_every_rank_holds_and_rank_0_writes():
    assert all(rank_heads(8, 4, r, is_replicated=True) == HeadRange(0, 1) for r in range(4))
    assert [writes_heads(8, 4, r, is_replicated=True) for r in range(4)] == [True, False, False, False]
    assert plan(8, 2, 3, is_replicated=True) == [(0, 0, 0, 1), (1, 1, 0, 1), (0, 2, 0, 1)]


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8, 12])
def test_every_decode_rank_gets_each_of_its_heads_once_from_a_rank_holding_it(heads):
    tps = [n for n in range(1, 13) if heads % n == 0 or n % heads == 0]
    for p, d in itertools.product(tps, tps):
        for dst in range(d):
            got = sorted(h for t in plan_head_transfers(heads, p, d) if t.dst_rank == dst
                         for h in range(t.heads.start, t.heads.stop))
            want = rank_heads(heads, d, dst)
            assert got == list(range(want.start, want.stop)), (heads, p, d, dst)
        for t in plan_head_transfers(heads, p, d):
            held = rank_heads(heads, p, t.src_rank)
            assert held.start <= t.heads.start and t.heads.stop <= held.stop


def test_splits_that_do_not_divide_are_refused_naming_the_shapes():
    with pytest.raises(LayoutError, match="3 KV heads cannot be split over 2"):
        rank_heads(3, 2, 0)
    with pytest.raises(LayoutError, match="5 KV heads cannot be split over 3"):
        plan_head_transfers(5, 1, 3)
    with pytest.raises(LayoutError, match="rank 4 outside"):
        rank_heads(4, 4, 4)
    assert isinstance(plan_head_transfers(4, 2, 2)[0], HeadTransfer)
