"""The ranks of a tensor-parallel instance refuse to start when they do not hold the same model."""

import pytest

from mooncake_lite.instance.tp_ranks import check_same
from mooncake_lite.model.tensor_parallel import TPLayout
from mooncake_lite.model.tp_step import build_rank_runner
from mooncake_lite.model.weights import model_args
from tests.model.tp_ranks import run_ranks


def _seeded_by_rank(comms, spec: str) -> None:
    layout = TPLayout(model_args(spec), comms.size, comms.rank)
    runner = build_rank_runner(spec, comms, layout, num_blocks=4, block_size=8, seed=comms.rank)
    check_same(comms, runner, layout)


def test_ranks_with_different_weights_refuse_to_start(tmp_path):
    with pytest.raises(Exception, match=r"tensor-parallel rank 1 holds checksum \S+, rank 0 holds \S+: "
                                        r"the ranks must load the same model"):
        run_ranks(2, _seeded_by_rank, "tiny", tmp_path)
