"""``fold_steady_gaps`` (a decode engine that never stalls: slices of its step log) against
``fold_gaps`` stepping through the same log, and a batch's per-request figures from them."""

from __future__ import annotations

import random

import pytest

from mooncake_lite.sim.request import fold_gaps, fold_steady_gaps


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
