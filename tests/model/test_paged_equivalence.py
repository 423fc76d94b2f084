"""Paged, prefix-reused and chunked prefill + decode must equal a plain full recompute."""

import pytest
import torch

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.generate import full_recompute_logits, generate, reference_greedy
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.runner import LayerwisePass, ModelRunner
from mooncake_lite.model.sampling import SamplingParams
from mooncake_lite.model.weights import build_model, build_meta

BS = 8
ATOL = 1e-4  # float32 logits: paged/chunked vs full recompute differ only by summation order


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny", seed=1)


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("n", [1, BS - 1, BS, BS + 1, 3 * BS, 3 * BS + 5])
@pytest.mark.parametrize("chunk", [None, 1, 3, BS])
def test_chunked_prefill_logits_match_full(model, n, chunk):
    toks = prompt(n, n)
    runner = ModelRunner(model, num_blocks=16, block_size=BS)
    table = runner.allocator.allocate(blocks_needed(n, BS))
    logits = runner.prefill(toks, table, 0, chunk)
    ref = full_recompute_logits(model, toks)[-1]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("prefix_blocks, extra", [(1, 0), (1, 1), (2, BS - 1), (3, BS + 2)])
def test_prefix_reuse_computes_only_new_tokens(model, prefix_blocks, extra):
    """A second request sharing a cached prefix computes only its tail, in the prefix's blocks."""
    shared = prompt(prefix_blocks * BS, 7)
    first = shared + prompt(5, 8)
    second = shared + prompt(max(extra, 1), 9)
    runner = ModelRunner(model, num_blocks=32, block_size=BS)
    table1 = runner.allocator.allocate(blocks_needed(len(first), BS))
    runner.prefill(first, table1, 0)
    # Reuse the prefix blocks (all full) and append fresh blocks for the new tail.
    table2 = table1[:prefix_blocks] + runner.allocator.allocate(blocks_needed(len(second), BS) - prefix_blocks)
    logits = runner.prefill(second[len(shared):], table2, len(shared))
    torch.testing.assert_close(logits, full_recompute_logits(model, second)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", [1, BS, 2 * BS + 3])
def test_generate_greedy_matches_reference(model, n):
    toks = prompt(n, 100 + n)
    runner = ModelRunner(model, num_blocks=16, block_size=BS)
    params = SamplingParams(max_tokens=12)
    assert generate(runner, toks, params, chunk_size=3) == reference_greedy(model, toks, 12)
    assert runner.allocator.num_free == 16


def test_batched_decode_of_different_lengths_matches_single(model):
    runner = ModelRunner(model, num_blocks=64, block_size=BS)
    prompts = [prompt(n, n) for n in (3, BS, 2 * BS + 1, 5 * BS - 1)]
    tables, firsts = [], []
    for p in prompts:
        t = runner.allocator.allocate(blocks_needed(len(p) + 1, BS))
        firsts.append(int(torch.argmax(runner.prefill(p, t, 0))))
        tables.append(t)
    batch = runner.decode(firsts, tables, [len(p) for p in prompts])
    for i, p in enumerate(prompts):
        ref = full_recompute_logits(model, p + [firsts[i]])[-1]
        torch.testing.assert_close(batch[i], ref, atol=ATOL, rtol=0)


def test_pipeline_stages_equal_full_model():
    full = build_model("tiny", seed=3)
    stage0 = build_model("tiny", seed=3, layer_range=(0, 2))
    stage1 = build_model("tiny", seed=3, layer_range=(2, 4))
    toks = prompt(2 * BS + 3, 5)
    r0, r1 = (ModelRunner(m, num_blocks=8, block_size=BS) for m in (stage0, stage1))
    table = list(range(blocks_needed(len(toks), BS)))
    p0 = LayerwisePass(r0, table, 0, token_ids=toks)
    for layer in stage0.layer_ids:
        p0.run_layer(layer)
    p1 = LayerwisePass(r1, table, 0, hidden=p0.output())
    for layer in stage1.layer_ids:
        p1.run_layer(layer)
    torch.testing.assert_close(p1.output(), full_recompute_logits(full, toks)[-1], atol=ATOL, rtol=0)


def test_layers_must_run_in_order(model):
    runner = ModelRunner(model, num_blocks=4, block_size=BS)
    p = LayerwisePass(runner, [0], 0, token_ids=[1, 2])
    with pytest.raises(ValueError, match="in order"):
        p.run_layer(1)


def test_large_presets_on_meta_device():
    args = ModelArgs.from_name("llama2-70b")
    meta = build_meta(args)
    assert sum(p.numel() for p in meta.parameters()) == args.num_params()
    assert 68e9 < args.num_params() < 70e9
    assert args.kv_bytes_per_token(torch.float16) == 327_680  # docs/paper.md §5


def test_bad_model_config_is_clear():
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelArgs.from_name("gpt-5")
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelArgs(dim=64, num_layers=1, num_heads=4, num_kv_heads=3, ffn_dim=8, vocab_size=10)
    with pytest.raises(ValueError, match="must be positive"):
        ModelArgs(dim=64, num_layers=0, num_heads=4, num_kv_heads=2, ffn_dim=8, vocab_size=10)
