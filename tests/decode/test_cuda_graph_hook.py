"""The decode engine computes its steps through the decode step it is given (on CUDA the graphs'
replay, model/cuda_graphs.py) and samples the tokens from its logits, outside it."""

from concurrent.futures import ThreadPoolExecutor

from mooncake_lite.decode.batcher import DecodeBatcher, StepPlan
from mooncake_lite.decode.engine import DecodeEngine
from mooncake_lite.model.cuda_graphs import DecodeGraphs
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model


def test_the_engine_steps_through_the_bucketed_decode():
    runner = ModelRunner(build_model("tiny", seed=2), num_blocks=16, block_size=16)
    graphs = DecodeGraphs(runner, (1, 2, 4), capture=False)   # takes its pad block first, as build_engine does
    batcher = DecodeBatcher(runner.allocator, runner.block_size)
    tables = [tuple(runner.allocator.allocate(1)) for _ in range(3)]
    for table in tables:
        runner.prefill([5, 6, 7], list(table))
    plan = StepPlan(("a", "b", "c"), ("a", "b", "c"), (0, 0, 0), (1, 2, 3), (3, 3, 3), tuple(tables))
    with ThreadPoolExecutor(1) as pool:
        engine = DecodeEngine(runner, batcher, pool, decode_step=graphs.decode)
        tokens = [token for token, _ in engine._compute(plan, [None, None, None])]
    assert (graphs.num_bucketed, graphs.num_eager) == (1, 0)
    assert tokens == runner.decode([1, 2, 3], [list(t) for t in tables], [3, 3, 3]).argmax(-1).tolist()
    assert graphs.pad_block not in {b for t in tables for b in t}
