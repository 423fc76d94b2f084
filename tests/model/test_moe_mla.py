"""Qwen3-MoE and DeepSeek-V3 (MLA) checkpoints against ``transformers`` on the same weights, and
the parts underneath: routing rules, per-expert grouping, latent attention absorbed vs expanded."""

import dataclasses

import pytest
import torch

from mooncake_lite.model.family_args import moe_from_config
from mooncake_lite.bench.model.flops import layer_matmul_params
from mooncake_lite.model.args import PRESETS
from mooncake_lite.model.generate import full_recompute_logits, generate, reference_greedy
from mooncake_lite.model.loader import load_checkpoint, read_args
from mooncake_lite.model.moe import MoE
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.sampling import SamplingParams
from mooncake_lite.model.weights import build_model
from tests.model.hf_fixtures import (VOCAB, checkpoint_cache, hf_greedy, hf_logits, save_deepseek_v3, save_qwen3_moe,
                                     two_stage_output)

# float32 on both sides: only summation order differs (measured ≤ 1e-6 on logits of magnitude ~4).
ATOL = RTOL = 1e-4
BS = 8

CHECKPOINTS = {"qwen3_moe": (save_qwen3_moe, {"seed": 1}),
               "deepseek_v3": (save_deepseek_v3, {"seed": 2}),
               # q as one plain projection, rope in halves rather than interleaved pairs
               "deepseek_v3_plain_q": (save_deepseek_v3, {"seed": 3, "q_lora_rank": None, "rope_interleave": False})}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, CHECKPOINTS)


def prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("which", list(CHECKPOINTS))
def test_logits_match_hf_forward(which, saved):
    path, hf = saved(which)
    toks = prompt(2 * BS + 5, 3)
    ref = hf_logits(hf, toks)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(full_recompute_logits(load_checkpoint(str(path)), toks, BS), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("which", list(CHECKPOINTS))
@pytest.mark.parametrize("n, chunk", [(1, None), (2 * BS + 3, 5)])
def test_paged_greedy_matches_hf_generate(which, n, chunk, saved):
    path, hf = saved(which)
    toks = prompt(n, 10 + n)
    runner = ModelRunner(build_model(str(path)), num_blocks=16, block_size=BS)
    assert generate(runner, toks, SamplingParams(max_tokens=12), chunk) == hf_greedy(hf, toks, 12)


def test_shapes_params_and_the_latent_cache(saved):
    q_path, q_hf = saved("qwen3_moe")
    q = read_args(str(q_path))
    assert q.moe.dense_layers == (2,) and q.moe.top_k == 3 and q.moe.norm_topk_prob and q.qk_norm
    assert q.num_params() == sum(p.numel() for p in q_hf.parameters())
    d_path, d_hf = saved("deepseek_v3")
    d = read_args(str(d_path))
    hf_total = sum(p.numel() for p in d_hf.parameters()) + sum(
        b.numel() for n, b in d_hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert d.num_params() == hf_total
    # active: 3 of 8 routed experts (3 x 24 x 16 x 32 weights each) fewer on each of the 2 sparse layers
    assert d.num_params() - d.active_params() == 2 * 5 * 3 * 16 * 32
    # the cache holds the latent (24) and rope key (8) per token and layer, not 4 heads of K and V
    assert d.kv_bytes_per_token("float32") == 3 * (24 + 8) * 4
    runner = ModelRunner(load_checkpoint(str(d_path)), num_blocks=4, block_size=BS)
    assert runner.cache.kv[0].numel() // runner.cache.num_blocks * 4 == d.kv_block_bytes(BS, "float32") // 3


def test_dense_layers_follow_the_config():
    base = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    assert moe_from_config(base | {"decoder_sparse_step": 2, "mlp_only_layers": [3]}, 6).dense_layers == (0, 2, 3, 4)
    assert moe_from_config({"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 8, "first_k_dense_replace": 2}, 6).dense_layers == (0, 1)


def test_pipeline_stages_split_moe_and_mla_layers(saved):
    path, hf = saved("deepseek_v3")
    s0, s1 = load_checkpoint(str(path), layer_range=(0, 2)), load_checkpoint(str(path), layer_range=(2, 3))
    toks = prompt(2 * BS + 1, 4)
    torch.testing.assert_close(two_stage_output(s0, s1, toks, BS), hf_logits(hf, toks)[-1], atol=ATOL, rtol=RTOL)


def test_absorbed_decode_equals_the_plain_expansion(saved):
    """Decode's latent-space attention against expanding the same cached rows into keys and values."""
    model = load_checkpoint(str(saved("deepseek_v3")[0]))
    att = model.layers["1"].attention
    gen = torch.Generator().manual_seed(0)
    m, heads, ctx = att.mla, att.num_heads, 13
    rows = torch.randn(2, ctx, m.latent_width, generator=gen)
    q_nope = torch.randn(2, heads, m.qk_nope_head_dim, generator=gen)
    q_rot = torch.randn(2, heads, m.qk_rope_head_dim, generator=gen)
    got = att.attend_absorbed(q_nope, q_rot, rows, torch.tensor([ctx, 7]))
    for b, length in enumerate((ctx, 7)):   # one query at the last position sees the whole context
        want = att.attend_expanded(q_nope[b:b + 1], q_rot[b:b + 1], rows[b, :length], length - 1)[0]
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)


def test_grouped_experts_equal_a_per_token_reference(saved):
    model = load_checkpoint(str(saved("deepseek_v3")[0]))
    moe: MoE = model.layers["2"].feed_forward
    x = torch.randn(9, model.args.dim, generator=torch.Generator().manual_seed(1))
    weights, ids = moe.gate(x)
    want = torch.stack([sum(w * moe.experts[str(int(e))](x[t:t + 1])[0] for w, e in zip(weights[t], ids[t]))
                        for t in range(x.shape[0])])
    torch.testing.assert_close(moe.routed(x, weights, ids), want, atol=1e-5, rtol=1e-5)


def test_correction_bias_chooses_but_does_not_weigh_and_groups_limit(saved):
    model = load_checkpoint(str(saved("deepseek_v3")[0]))
    router = model.layers["1"].feed_forward.gate
    moe_args = model.args.moe
    x = torch.randn(64, model.args.dim, generator=torch.Generator().manual_seed(2))
    weights, ids = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    picked = scores.gather(1, ids)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True) * moe_args.routed_scaling)
    per_group = moe_args.num_experts // moe_args.num_groups
    assert all(len(set((row // per_group).tolist())) <= moe_args.topk_groups for row in ids)
    unbiased = dataclasses.replace(moe_args, num_groups=1, topk_groups=1)
    router.moe = unbiased   # without the groups, the bias still changes which experts win
    _, ids_biased = router(x)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
    _, ids_plain = router(x)
    assert not torch.equal(ids_biased.sort(-1).values, ids_plain.sort(-1).values)


def test_published_shapes_count_as_published():
    """DeepSeek-V3: 671B parameters, 37B active, 70,272 B of bf16 KV per token (61 x 576 x 2);
    Qwen3-30B-A3B: 30.5B, 3.3B active (their model cards)."""
    v3, qwen = PRESETS["deepseek-v3"], PRESETS["qwen3-30b-a3b"]
    assert 670.5e9 < v3.num_params() < 671.5e9 and 37e9 < v3.active_params() < 38e9
    assert v3.kv_bytes_per_token("bfloat16") == 61 * 576 * 2 and v3.kv_block_bytes(64, "bfloat16") == 64 * 70272
    assert 30.4e9 < qwen.num_params() < 30.6e9 and 3.3e9 < qwen.active_params() < 3.4e9
    assert qwen.kv_bytes_per_token("bfloat16") == 2 * 48 * 4 * 128 * 2
    assert layer_matmul_params(v3) + v3.dim * v3.vocab_size < v3.active_params()   # FLOPs from the active weights


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-mla"])
def test_presets_decode_as_they_recompute(name):
    model = build_model(name)
    toks = list(range(5, 30))
    runner = ModelRunner(model, num_blocks=16, block_size=BS)
    assert generate(runner, toks, SamplingParams(max_tokens=6), 7) == reference_greedy(model, toks, 6)


@pytest.mark.parametrize("which", ["qwen3_moe", "deepseek_v3"])
def test_packed_prefill_of_two_sequences_matches_hf(which, saved):
    """Several prompts in one forward (experts see both sequences' rows; MLA attends per sequence)."""
    path, hf = saved(which)
    runner = ModelRunner(load_checkpoint(str(path)), num_blocks=8, block_size=BS)
    a, b = prompt(11, 7), prompt(2 * BS + 2, 8)
    got = runner.prefill_packed([([0, 1], 0, a), ([2, 3, 4], 0, b)])
    torch.testing.assert_close(got[0], hf_logits(hf, a)[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[1], hf_logits(hf, b)[-1], atol=ATOL, rtol=RTOL)


def test_batched_decode_of_unequal_contexts_matches_hf(saved):
    path, hf = saved("deepseek_v3")
    runner = ModelRunner(load_checkpoint(str(path)), num_blocks=8, block_size=BS)
    a, b, tables = prompt(5, 9), prompt(2 * BS + 2, 10), [[0], [1, 2, 3]]
    runner.prefill(a, tables[0])
    runner.prefill(b, tables[1])
    got = runner.decode([7, 9], tables, [len(a), len(b)])
    torch.testing.assert_close(got[0], hf_logits(hf, a + [7])[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[1], hf_logits(hf, b + [9])[-1], atol=ATOL, rtol=RTOL)
