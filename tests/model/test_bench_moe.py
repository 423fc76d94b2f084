"""``mooncake bench model`` on an MoE model counts the active weights, and ``bench moe`` prints
its KV and routing figures."""

import json

import torch

from mooncake_lite.bench.model.flops import decode_flops, layer_matmul_params, weight_bytes
from mooncake_lite.bench.model.moe import main as bench_moe
from mooncake_lite.model.moe import MoE
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model
from tests.model.test_bench_model import attention_flops, matmul_flops_counted


def test_moe_decode_flops_are_the_active_weights_torch_ran():
    """One sequence's step runs the router and its top-k experts of each sparse layer, no more."""
    runner = ModelRunner(build_model("tiny-moe"), num_blocks=4, block_size=8)
    a, pos = runner.args, 4 * 8 - 1
    got = matmul_flops_counted(lambda: runner.decode([5], [[0, 1, 2, 3]], [pos]))
    assert a.active_params() < a.num_params()
    assert got > 0 and got + attention_flops(a, 1, pos + 1) == decode_flops(a, 1, context_len=pos + 1)


def test_bench_moe_json(capsys):
    assert bench_moe(["--rounds", "1", "--batch-sizes", "1,2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    kv = res["kv"]
    assert kv["deepseek-v3 (mla)"]["bytes_per_token"] == 61 * 576 * 2
    assert kv["gqa-8"]["bytes_per_token"] == 2 * 61 * 8 * 128 * 2 and kv["gqa-8"]["over_mla"] > 3.5
    assert kv["expanded-mha"]["bytes_per_token"] == 61 * 128 * (192 + 128) * 2
    assert kv["gqa-8"]["transfer_s"] / kv["deepseek-v3 (mla)"]["transfer_s"] == kv["gqa-8"]["over_mla"]
    assert set(res["routing"]["steps"]) == {"1", "2"}
    assert all(s["moe_step_ms"] > 0 and s["dense_step_ms"] > 0 for s in res["routing"]["steps"].values())
    # one token's 8 experts over 8 ranks: split, each rank reads 1/8 of all 8 (one expert's worth);
    # placed, the busiest rank reads at least one whole, and more when two land on it
    one = res["placement"]["deepseek-v3"]["batches"]["1"]
    assert one["split_experts"] == 1.0 and one["placed_experts"] > 1.5 and one["weight_bytes"] == one["placed_experts"]


def test_mla_moe_matmul_params_are_the_2d_weights_a_token_runs_through():
    model = build_model("tiny-mla")
    a, m = model.args, model.args.moe
    layer_2d = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers."))
    idle = (m.num_experts - m.top_k) * 3 * a.dim * m.expert_ffn_dim * sum(map(m.is_sparse, range(a.num_layers)))
    assert layer_matmul_params(a) == layer_2d - idle


def test_decode_weight_bytes_count_the_union_of_experts_a_batch_touched():
    runner = ModelRunner(build_model("tiny-moe"), num_blocks=16, block_size=8)
    a, m = runner.args, runner.args.moe
    sparse = [b.feed_forward for b in runner.model.layers.values() if isinstance(b.feed_forward, MoE)]
    runner.decode([5], [[0]], [0])
    assert sum(f.num_touched for f in sparse) == m.top_k * len(sparse)     # one token: its top-k
    assert weight_bytes(a, torch.float32, m.top_k * len(sparse)) == weight_bytes(a, torch.float32)
    runner.decode(list(range(16)), [[i] for i in range(16)], [0] * 16)
    touched = sum(f.num_touched for f in sparse)
    assert m.top_k * len(sparse) < touched <= m.num_experts * len(sparse)
    extra = (touched - m.top_k * len(sparse)) * 3 * a.dim * m.expert_ffn_dim * 4
    assert weight_bytes(a, torch.float32, touched) == weight_bytes(a, torch.float32) + extra


def test_the_v3_mini_twin_differs_only_in_its_attention():
    """``bench pd``'s MLA/GQA pair: the same model but for the KV it caches (3.56x, as at V3's width)."""
    import dataclasses

    from mooncake_lite.model.args import PRESETS
    mla, gqa = PRESETS["v3-mini"], PRESETS["v3-mini-gqa"]
    assert dataclasses.replace(gqa, num_kv_heads=1, head_size=288, mla=mla.mla, name=mla.name) == mla
    assert gqa.kv_bytes_per_token("bfloat16") * 576 == mla.kv_bytes_per_token("bfloat16") * 2 * 8 * 128
