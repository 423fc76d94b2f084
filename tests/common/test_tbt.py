"""One TBT definition: the live figure (a list of gaps) and the simulator's (runs of equal gaps)
average the same gaps."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_lite.common.tbt import paper_tbt, paper_tbt_of_runs, slowest_count
from mooncake_lite.sim.request import slowest_share_mean


@pytest.mark.parametrize("num_gaps, count", [(1, 1), (9, 1), (10, 1), (19, 1), (20, 2), (31, 3), (70, 7), (100, 10)])
def test_a_tenth_of_the_gaps_at_least_one(num_gaps, count):
    assert slowest_count(num_gaps) == count


def test_no_gaps_no_tbt():
    assert paper_tbt([]) is None
    assert paper_tbt_of_runs([], 0) is None


runs = st.lists(st.tuples(st.floats(0.001, 5.0, allow_nan=False), st.integers(1, 40)), min_size=1, max_size=12)


@given(runs)
def test_runs_and_their_expanded_gaps_give_the_same_tbt(rs):
    gaps = [gap for gap, count in rs for _ in range(count)]
    assert paper_tbt_of_runs(rs, len(gaps)) == pytest.approx(paper_tbt(gaps))
    assert slowest_share_mean(rs) == pytest.approx(paper_tbt(gaps))
