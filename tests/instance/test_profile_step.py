"""A decode's start-up profile times the step it will serve with: on CUDA its graph replay, not the
runner's eager step (on an H200 the eager step was 4.7x the graph's)."""

import time

from mooncake_lite.instance.profile import profile_decode
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model

EXTRA_S = 0.01


def test_the_decode_profile_times_the_step_it_is_given():
    runner = ModelRunner(build_model("tiny", seed=2), num_blocks=300, block_size=16)
    calls = []

    def served_step(tokens, tables, positions):   # a step costlier than the eager one by EXTRA_S
        calls.append(len(tokens))
        time.sleep(EXTRA_S)
        return runner.decode(tokens, tables, positions)
    eager, _ = profile_decode(runner, repeats=1)
    served, samples = profile_decode(runner, repeats=1, step=served_step)
    assert calls and sorted(set(calls)) == sorted({b for b, _, _ in samples})
    assert served.c0 >= 0.8 * EXTRA_S > eager.c0
    assert runner.allocator.num_free == runner.cache.num_blocks
