"""``fold_steady_gaps`` (a decode engine that never stalls: slices of its step log) against
``fold_gaps`` stepping through the same log, and a batch's per-request figures from them:
``slowest_share_mean`` (sorting by gap alone) against the definition, ``common.tbt``."""

from __future__ import annotations

import random

import pytest

from mooncake_lite.common.tbt import paper_tbt_of_runs
from mooncake_lite.sim.request import fold_gaps, fold_steady_gaps, slowest_share_mean


@pytest.mark.parametrize("seed", range(5))
def test_steady_folding_equals_folding_step_by_step_on_a_log_without_stalls(seed):
    rng = random.Random(seed)
    log = [(rng.choice([0.05, 0.0625, rng.uniform(0.01, 0.2)]), rng.choice([1, 1, 2, rng.randint(1, 90)]))
           for _ in range(200)]
    for _ in range(300):
        start = rng.randrange(len(log) + 1)
        end = rng.randint(start, len(log))
        wait = rng.choice([0.0, 0.0, rng.uniform(0, 2)])
        assert fold_steady_gaps(log, start, end, wait) == fold_gaps(log, start, end, wait)


@pytest.mark.parametrize("seed", range(4))
def test_the_tbt_sorted_by_gap_alone_is_the_definitions_float_ties_included(seed):
    rng = random.Random(seed)
    for _ in range(400):
        # few distinct gaps (ties, where the definition's order by count matters) or many
        gaps = [0.05, 0.1 / 3, 0.07] if rng.random() < 0.5 else [rng.uniform(0.01, 0.2) for _ in range(50)]
        segments = [(rng.choice(gaps), rng.choice([1, 2, rng.randint(1, 60)])) for _ in range(rng.randint(0, 40))]
        total = sum(count for _, count in segments)
        assert slowest_share_mean(segments) == paper_tbt_of_runs(segments, total)    # ==: the same float
