"""Qwen3-MoE and DeepSeek-V3 (MLA) split across two tensor-parallel ranks compute what the whole
model computes and what ``transformers`` computes on the same checkpoints: experts split by width
and placed whole per rank (expert parallelism), MLA's heads split with its latent replicated.
Ranks are real processes joined by gloo (``tests/model/tp_ranks.py``)."""

from __future__ import annotations

import pytest
import torch

from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.tensor_parallel import TPLayout, build_sharded_model, check_divides
from mooncake_lite.model.weights import build_model, model_args
from mooncake_lite.transfer.tp_heads import rank_heads, writes_heads
from tests.model.test_moe_mla import CHECKPOINTS, saved  # noqa: F401 (the checkpoints and their fixture)
from tests.model.test_tensor_parallel import _check, _hf_refs, _outputs
from tests.model.test_tp_step import BS as STEP_BS, _job as step_job, _same, _script
from tests.model.tp_ranks import run_ranks



def _job(comms, runs: list[tuple[str, bool]]) -> list[dict]:
    out = []
    for spec, placed in runs:
        layout = TPLayout(model_args(spec), comms.size, comms.rank, expert_parallel=placed)
        model = build_sharded_model(spec, layout, comms)
        sparse = next(b.feed_forward for b in model.layers.values() if hasattr(b.feed_forward, "experts"))
        out.append(_outputs(model) | {"kv_width": model.args.num_kv_heads * model.args.head_dim,
                                      "writes_kv": layout.owns_kv, "experts": list(sparse.experts)})
    return out


def test_tp2_experts_split_or_placed_and_mla_match_tp1_and_transformers(saved, tmp_path):
    """Greedy tokens equal, logits within 1e-4 (float32, partial sums added in another order), on
    both ranks; both ranks cache the whole latent, only rank 0 writes it."""
    names = [(n, placed) for n in CHECKPOINTS for placed in (False, True) if n != "deepseek_v3_plain_q" or not placed]
    runs = [(str(saved(n)[0]), placed) for n, placed in names]
    refs = {n: _hf_refs(saved(n)[1]) for n in CHECKPOINTS}
    ranks = run_ranks(2, _job, runs, tmp_path, timeout_s=120.0)
    _check(ranks, [refs[n] for n, _ in names])
    for i, (spec, placed) in enumerate(runs):
        held = [r[i]["experts"] for r in ranks]
        assert held == ([[str(e) for e in range(4)], [str(e) for e in range(4, 8)]] if placed
                        else [[str(e) for e in range(8)]] * 2)
        a = model_args(spec)
        if a.mla is not None:
            assert [r[i]["kv_width"] for r in ranks] == [a.mla.latent_width // 2] * 2   # each plane: half the row
            assert [r[i]["writes_kv"] for r in ranks] == [True, False]


def test_layout_splits_experts_by_width_or_places_them_whole(saved):
    a = model_args(str(saved("deepseek_v3")[0]))   # 8 experts of 16, one shared expert, 4 heads
    split = [TPLayout(a, 2, r).local_args().moe for r in range(2)]
    assert [(m.expert_ids, m.expert_ffn_dim, m.shared_width) for m in split] == [(range(8), 8, 8)] * 2
    placed = [TPLayout(a, 2, r, expert_parallel=True).local_args().moe for r in range(2)]
    assert [(m.expert_ids, m.expert_ffn_dim, m.shared_width) for m in placed] == [(range(0, 4), 16, 8),
                                                                                   (range(4, 8), 16, 8)]
    local = TPLayout(a, 2, 1).local_args()
    assert (local.num_heads, local.num_kv_heads, local.head_dim) == (2, 1, a.head_dim)   # the latent whole
    with pytest.raises(ValueError, match=r"num_experts 8 \(placed whole per rank\)"):
        check_divides(a, 3, expert_parallel=True)
    with pytest.raises(ValueError, match=r"expert_ffn_dim 16 \(each expert split by width\)"):
        check_divides(a, 32)


def test_the_latent_is_the_replicated_layout_in_the_transfer_terms():
    """MLA's one KV "head" is held whole by every rank and written by rank 0 alone, in the model's
    layout and in ``transfer/tp_heads.py``'s replicated terms alike."""
    a = model_args("tiny-mla")
    assert a.kv_replicated and not model_args("tiny-moe").kv_replicated
    for tp in (2, 4):
        for rank in range(tp):
            layout = TPLayout(a, tp, rank)
            heads = rank_heads(a.num_kv_heads, tp, rank, is_replicated=True)
            assert (heads.start, heads.stop) == (layout.kv_heads.start, layout.kv_heads.stop) == (0, 1)
            assert writes_heads(a.num_kv_heads, tp, rank, is_replicated=True) == layout.owns_kv == (rank == 0)


def test_leader_and_follower_move_the_latent_once_as_tp1_does(tmp_path):
    """An instance's script (layer-wise prefill streaming each layer's KV, block write-back, decode,
    a prefix and a frame brought in) on tiny-mla (MLA and sigmoid-routed experts with a shared one)
    at TP=2, rank 0 leading: the latent rows and blocks that leave are TP=1's (taken from rank 0
    only), the tokens equal."""
    ref = _script(ModelRunner(build_model("tiny-mla"), num_blocks=16, block_size=STEP_BS))
    _same(run_ranks(2, step_job, "tiny-mla", tmp_path, timeout_s=120.0)[0], ref)
