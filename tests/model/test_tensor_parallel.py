"""A model split across tensor-parallel ranks computes what the whole model computes: greedy
tokens equal, logits within float32 summation-order noise, the same on every rank, and equal to
``transformers``' on the same checkpoints. Ranks are real processes joined by gloo."""

from __future__ import annotations

import pytest
import torch

from mooncake_lite.model.generate import full_recompute_logits, generate
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.sampling import SamplingParams
from mooncake_lite.model.tensor_parallel import TPLayout, build_sharded_model, check_divides
from mooncake_lite.model.weights import build_model, model_args
from tests.model.hf_fixtures import hf_greedy, hf_logits, save_llama, save_qwen2, save_qwen3
from tests.model.tp_ranks import run_ranks
from tests.real_model import SMOLLM, needs_smollm

ATOL = RTOL = 1e-4   # float32; partial sums added in another order (as in test_hf_checkpoint)
BS = 8
PROMPTS = ([5, 17, 3, 99, 42, 7, 11, 60, 2, 1, 33], [9])   # one chunked over blocks, one token
MAX_TOKENS = 8


def _outputs(model, prompts=PROMPTS) -> dict:
    """Greedy tokens of each prompt (chunked paged prefill, then decode steps) and the first
    prompt's logits at every position."""
    runner = ModelRunner(model, num_blocks=16, block_size=BS)
    tokens = [generate(runner, p, SamplingParams(max_tokens=MAX_TOKENS), chunk_size=4) for p in prompts]
    return {"tokens": tokens, "logits": full_recompute_logits(model, prompts[0], BS)}


def _sharded_job(comms, specs: list[str]) -> list[dict]:
    out = []
    for spec in specs:
        layout = TPLayout(model_args(spec), comms.size, comms.rank)
        out.append(_outputs(build_sharded_model(spec, layout, comms)))
    return out


def _check(ranks: list[list[dict]], refs: list[dict]) -> None:
    for rank_out in ranks:
        for got, ref in zip(rank_out, refs, strict=True):
            assert got["tokens"] == ref["tokens"]
            torch.testing.assert_close(got["logits"], ref["logits"], atol=ATOL, rtol=RTOL)
    for other in ranks[1:]:   # every rank holds the same full-vocab logits, bit for bit
        for a, b in zip(ranks[0], other):
            assert torch.equal(a["logits"], b["logits"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """HF checkpoints and the transformers models they came from: llama (6 heads, 2 KV heads,
    vocab 211, which 2 does not divide: a replicated head), qwen2 (q/k/v biases, tied, one KV
    head: replicated at TP 2), qwen3 (q/k norms, 2 KV heads: replicated at TP 4)."""
    out = {}
    for name, save, kw in (("llama", save_llama, {"seed": 1}), ("qwen2", save_qwen2, {"seed": 2}),
                           ("qwen3", save_qwen3, {"seed": 3})):
        path = tmp_path_factory.mktemp(name)
        out[name] = (str(path), save(path, **kw))
    return out


def _hf_refs(hf) -> dict:
    return {"tokens": [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS], "logits": hf_logits(hf, PROMPTS[0])}


def test_tp2_matches_tp1_and_transformers(checkpoints, tmp_path):
    specs = ["tiny", checkpoints["llama"][0], checkpoints["qwen2"][0]]
    refs = [_outputs(build_model("tiny")), _hf_refs(checkpoints["llama"][1]), _hf_refs(checkpoints["qwen2"][1])]
    _check(run_ranks(2, _sharded_job, specs, tmp_path), refs)


def test_tp4_replicated_kv_heads_match_tp1_and_transformers(checkpoints, tmp_path):
    assert TPLayout(model_args("tiny"), 4, 3).kv_replicas == 2   # tiny: 4 heads, 2 KV heads
    specs = ["tiny", checkpoints["qwen3"][0]]
    refs = [_outputs(build_model("tiny")), _hf_refs(checkpoints["qwen3"][1])]
    _check(run_ranks(4, _sharded_job, specs, tmp_path), refs)


@needs_smollm
def test_tp3_smollm2_matches_tp1(tmp_path):
    """SmolLM2-135M (9 heads, 3 KV heads, ffn 1536, vocab 49152) split three ways; our TP=1 is
    tied to transformers on this file by tests/model/test_gguf.py."""
    prompts = (PROMPTS[0],)
    # the ranks hold dequantized slices: TP=1 on the same float weights (the compact model's
    # decode products round activations to integers, docs/model.md "Quantized weights")
    ref = _outputs(build_model(SMOLLM, weights="dequantize"), prompts)
    ranks = run_ranks(3, _smollm_job, prompts, tmp_path, timeout_s=120.0)
    _check(ranks, [ref])


def _smollm_job(comms, prompts) -> list[dict]:
    layout = TPLayout(model_args(SMOLLM), comms.size, comms.rank)
    return [_outputs(build_sharded_model(SMOLLM, layout, comms), prompts)]


def test_layouts_split_heads_kv_heads_and_the_mlp():
    tiny = model_args("tiny")   # 4 heads, 2 KV heads, ffn 172, vocab 320
    two = [TPLayout(tiny, 2, r) for r in range(2)]
    assert [(list(t.heads), list(t.kv_heads), t.owns_kv) for t in two] == [([0, 1], [0], True), ([2, 3], [1], True)]
    four = [TPLayout(tiny, 4, r) for r in range(4)]
    assert [(list(t.kv_heads), t.owns_kv) for t in four] == [([0], True), ([0], False), ([1], True), ([1], False)]
    assert four[1].ffn == range(43, 86) and four[1].vocab == range(80, 160)
    assert TPLayout(with_vocab(tiny, 321), 2, 1).vocab == range(321)   # 2 does not divide: replicated head


def with_vocab(args, vocab):
    import dataclasses
    return dataclasses.replace(args, vocab_size=vocab)


def test_a_degree_that_does_not_divide_the_model_is_refused_naming_the_shapes():
    with pytest.raises(ValueError, match=r"degree 3 does not divide model 'tiny': num_heads 4, "
                                         r"num_kv_heads 2 .*ffn_dim 172"):
        check_divides(model_args("tiny"), 3)
    with pytest.raises(ValueError, match="rank 2 outside 0..1"):
        TPLayout(model_args("tiny"), 2, 2)


def _cuda_job(comms, spec: str) -> list[dict]:
    layout = TPLayout(model_args(spec), comms.size, comms.rank)
    return [_outputs(build_sharded_model(spec, layout, comms, device=comms.device))]


@pytest.mark.gpu
def test_tp2_on_cuda_matches_tp1(tmp_path):
    """One device per rank over NCCL where there are two GPUs; where there is one, the two ranks
    share it through gloo (NCCL refuses two ranks on one device): the functional check."""
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cuda:0", "cuda:0"]
    ref = _outputs(build_model("tiny", device="cuda"))
    ref["logits"] = ref["logits"].cpu()
    _check(run_ranks(2, _cuda_job, "tiny", tmp_path, devices=devices), [ref])


def test_a_preset_for_cuda_is_drawn_where_a_one_gpu_instance_draws_it():
    """Ranks cut from the weights a one-GPU instance of the preset holds (drawn on the device),
    where the full model fits in half the free memory; checkpoints and the CPU read on the CPU."""
    from mooncake_lite.model.tensor_parallel import dummy_draw_device
    tiny_bytes = sum(p.numel() for p in build_model("tiny").parameters()) * 2
    assert dummy_draw_device("tiny", "cuda:1", torch.bfloat16, free_bytes=2 * tiny_bytes) == "cuda:1"
    assert dummy_draw_device("tiny", "cuda:1", torch.bfloat16, free_bytes=2 * tiny_bytes - 2) == "cpu"
    assert dummy_draw_device("tiny", "cpu", torch.float32, free_bytes=10**12) == "cpu"
