"""Our loader + model must match an independent implementation: Hugging Face transformers itself."""

import json

import pytest
import torch

from mooncake_lite.model.generate import full_recompute_logits, generate
from mooncake_lite.model.loader import load_checkpoint, read_args
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.sampling import SamplingParams
from mooncake_lite.model.weights import build_model, model_args
from tests.model.hf_fixtures import (VOCAB, checkpoint_cache, hf_greedy, hf_logits, save_llama, save_qwen2, save_qwen3,
                                     two_stage_output)

# float32 on both sides; the only differences are summation order in matmuls/attention, and the
# logits are O(1-10), so 1e-4 absolute (plus 1e-4 relative) is ~1000x below a real mapping error.
ATOL = RTOL = 1e-4
BS = 8


# Each checkpoint written once per module: (its directory, the transformers model it came from).
CHECKPOINTS = {"llama": (save_llama, {"seed": 1}), "qwen2": (save_qwen2, {"seed": 2}),
               "qwen3": (save_qwen3, {"seed": 3}), "qwen3_usual_width": (save_qwen3, {"seed": 4, "head_dim": 8})}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, CHECKPOINTS)


@pytest.fixture(scope="module")
def llama(saved):
    return saved("llama")


@pytest.fixture(scope="module")
def qwen2(saved):
    return saved("qwen2")


@pytest.fixture(scope="module")
def qwen3(saved):
    return saved("qwen3")


def prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("which", ["llama", "qwen2", "qwen3", "qwen3_usual_width"])
def test_logits_match_hf_forward(which, saved):
    path, hf = saved(which)
    ours = load_checkpoint(str(path))
    toks = prompt(2 * BS + 5, 3)
    ref = hf_logits(hf, toks)
    assert ref.abs().max() > 1.0  # decisive logits, so the tolerance below is meaningful
    torch.testing.assert_close(full_recompute_logits(ours, toks, BS), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("which", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("n, chunk", [(1, None), (BS, 3), (2 * BS + 3, BS)])
def test_paged_greedy_matches_hf_generate(which, n, chunk, saved):
    path, hf = saved(which)
    ours = build_model(str(path))  # the path every role takes for a directory
    toks = prompt(n, 10 + n)
    runner = ModelRunner(ours, num_blocks=16, block_size=BS)
    assert generate(runner, toks, SamplingParams(max_tokens=10), chunk) == hf_greedy(hf, toks, 10)


def test_read_args_from_config(llama, qwen2):
    a = read_args(str(llama[0]))
    assert (a.dim, a.num_layers, a.num_heads, a.num_kv_heads, a.ffn_dim, a.vocab_size) == (48, 3, 6, 2, 100, VOCAB)
    assert a.rope_theta == 5000.0 and not a.qkv_bias and not a.tie_embeddings
    q = model_args(str(qwen2[0]))
    assert q.qkv_bias and q.tie_embeddings and q.rope_theta == 20000.0 and q.norm_eps == 1e-6


def test_qwen3_shape_wide_heads_and_qk_norm(qwen3):
    path, hf = qwen3
    a = read_args(str(path))
    assert (a.dim, a.num_heads, a.head_dim, a.num_kv_heads) == (32, 4, 16, 2) and a.qk_norm and not a.qkv_bias
    assert a.num_params() == sum(p.numel() for p in hf.parameters())     # tied: the embedding counted once
    assert a.kv_bytes_per_token("float32") == 2 * 2 * 2 * 16 * 4          # layers x kv heads x the wide head
    ours = load_checkpoint(str(path))
    hf_norm = dict(hf.named_parameters())["model.layers.1.self_attn.k_norm.weight"]
    torch.testing.assert_close(ours.layers["1"].attention.k_norm.weight, hf_norm, atol=0, rtol=0)


def test_qwen2_checkpoint_is_sharded_and_tied(qwen2):
    path, _ = qwen2
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]
    model = load_checkpoint(str(path))
    torch.testing.assert_close(model.output.weight, model.tok_embeddings.weight, atol=0, rtol=0)
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()  # read once, shared


@pytest.mark.parametrize("which", ["llama", "qwen2", "qwen3"])
def test_pipeline_stages_load_only_their_layers(which, saved):
    path, hf = saved(which)
    num_layers = read_args(str(path)).num_layers
    cut = (num_layers + 1) // 2
    s0 = load_checkpoint(str(path), layer_range=(0, cut))
    s1 = load_checkpoint(str(path), layer_range=(cut, num_layers))
    assert s0.tok_embeddings is not None and not hasattr(s0, "output")
    assert s1.tok_embeddings is None and hasattr(s1, "output")
    assert {n.split(".")[1] for n in s1.state_dict() if n.startswith("layers.")} == {
        str(i) for i in range(cut, num_layers)}
    hf_q = dict(hf.named_parameters())[f"model.layers.{cut}.self_attn.q_proj.weight"]
    torch.testing.assert_close(s1.layers[str(cut)].attention.wq.weight, hf_q, atol=0, rtol=0)

    toks = prompt(2 * BS + 1, 4)
    torch.testing.assert_close(two_stage_output(s0, s1, toks, BS), hf_logits(hf, toks)[-1], atol=ATOL, rtol=RTOL)


def test_bfloat16_load_keeps_argmax(llama):
    path, hf = llama
    ours = load_checkpoint(str(path), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    toks = prompt(BS, 5)
    got = full_recompute_logits(ours, toks, BS)
    ref = hf_logits(hf, toks)
    # bf16 keeps ~3 significant digits; the loose bound still catches any wrong mapping.
    torch.testing.assert_close(got, ref, atol=0.25, rtol=0.05)
