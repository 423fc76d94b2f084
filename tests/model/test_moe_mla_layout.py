"""``--moe-layout split|placed``: how a tensor-parallel instance divides a mixture of experts. The
flag is checked against the model at start, and a TP=2 instance built from it as an instance
builds its ranks (``instance/runner.py``, rank 1 a spawned process) holds whole experts on each
rank and generates the whole model's greedy tokens. Needs no cluster: the ranks alone."""

import pytest
import torch

from mooncake_lite.common.config import ConfigError
from mooncake_lite.instance.runner import build_runner
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.config import Config

pytestmark = pytest.mark.timeout(300)


def test_the_layout_is_checked_against_the_model_at_start():
    assert Config(model="tiny-moe", tensor_parallel=2).expert_parallel is False
    assert Config(model="tiny-moe", tensor_parallel=2, moe_layout="placed").expert_parallel is True
    with pytest.raises(ConfigError, match=r"--tensor-parallel: .*num_experts 8 \(placed whole per rank\)"):
        Config(model="tiny-moe", tensor_parallel=3, moe_layout="placed")
    with pytest.raises(ConfigError, match="--moe-layout must be split or placed, got 'scattered'"):
        Config(model="tiny-moe", moe_layout="scattered")


def _greedy(runner, ids: list[int], n: int) -> list[int]:
    table = runner.allocator.allocate(4)
    tokens = [int(torch.argmax(runner.prefill(ids, table, 0)))]
    while len(tokens) < n:
        tokens.append(int(torch.argmax(runner.decode([tokens[-1]], [table], [len(ids) + len(tokens) - 1])[0])))
    return tokens


def test_a_placed_tp2_instance_holds_whole_experts_and_decodes_the_whole_models_tokens():
    cfg = Config(model="tiny-moe", tensor_parallel=2, moe_layout="placed", threads=1, num_blocks=8, block_size=8)
    runner = build_runner(cfg)
    try:
        sparse = [b.feed_forward for b in runner.model.layers.values() if hasattr(b.feed_forward, "experts")]
        assert sparse and all(list(f.experts) == ["0", "1", "2", "3"] for f in sparse)   # rank 0: experts 0-3 whole
        ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(5)).tolist()
        assert _greedy(runner, ids, 6) == reference_greedy(build_model("tiny-moe"), ids, 6)
    finally:
        runner.tp_group.stop()
