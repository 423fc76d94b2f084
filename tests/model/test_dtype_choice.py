"""``--dtype auto`` (model/args.py:dtype_choice): bfloat16 on CUDA; on a CPU that computes
bfloat16 natively (AMX/AVX512-BF16) bfloat16 for a checkpoint stored in it, float32 for the rest
(GGUF blocks kept, presets, float32 checkpoints) and on other CPUs; each with the reason an
instance states at start-up."""

from __future__ import annotations

import json

import pytest

from mooncake_kernels import quant_build
from mooncake_lite.decode.config import Config
from mooncake_lite.model.args import default_dtype, dtype_choice

NATIVE = "flags : fpu avx512f avx512_bf16 amx_bf16 amx_tile"


@pytest.mark.parametrize("flags, native", [("flags : fpu avx2 avx512f", False),
                                           (NATIVE, True)])
def test_a_cpu_serves_float32_and_says_why(monkeypatch, flags, native):
    monkeypatch.setattr(quant_build, "cpu_flags", lambda: flags)
    dtype, why = dtype_choice("cpu")
    assert dtype == default_dtype("cpu") == "float32"
    assert ("natively" in why and "amx_bf16" in why) == native
    assert ("no bfloat16 arithmetic" in why) == (not native)


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_a_bfloat16_checkpoint_is_served_in_it_where_the_cpu_computes_it(monkeypatch, tmp_path, stored):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "torch_dtype": stored, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 320,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}))
    monkeypatch.setattr(quant_build, "cpu_flags", lambda: NATIVE)
    assert dtype_choice("cpu", str(tmp_path))[0] == stored
    assert Config(model=str(tmp_path)).dtype == stored
    monkeypatch.setattr(quant_build, "cpu_flags", lambda: "flags : fpu avx2")
    assert dtype_choice("cpu", str(tmp_path))[0] == "float32"


def test_mooncake_up_sizes_the_stores_for_the_dtype_its_prefills_will_choose(monkeypatch, tmp_path):
    from mooncake_lite.cluster.plan import kv_layout
    from mooncake_lite.cluster.up import build_parser, options_from
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    monkeypatch.setattr(quant_build, "cpu_flags", lambda: NATIVE)
    assert kv_layout(options_from(build_parser().parse_args(["--model", str(tmp_path)])))[1] == "bfloat16"
    assert kv_layout(options_from(build_parser().parse_args([])))[1] == "float32"   # the default GGUF


def test_a_gguf_and_a_preset_stay_float32_on_a_native_cpu(monkeypatch):
    monkeypatch.setattr(quant_build, "cpu_flags", lambda: NATIVE)
    assert dtype_choice("cpu", "smollm2-135m")[0] == dtype_choice("cpu", "tiny")[0] == "float32"


def test_cuda_serves_bfloat16():
    assert dtype_choice("cuda:1")[0] == default_dtype("cuda") == "bfloat16"


def test_the_instance_config_keeps_the_reason_it_states():
    assert Config().dtype == "float32" and Config().dtype_reason.startswith("--dtype auto: ")
    assert Config(dtype="bfloat16").dtype_reason == "asked for"


def test_bfloat16_tokens_and_logits_stay_within_their_tolerance_of_float32():
    """The tiny preset served in bfloat16 against float32 on the same seeded weights: a prefill
    and four decode steps, logits within 0.06 (measured 0.022, logits within ±3.6; bfloat16 keeps
    8 bits of mantissa, ~0.4% a value) and the same greedy tokens."""
    import torch

    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.model.weights import build_model
    logits = []
    for dtype in (torch.float32, torch.bfloat16):
        runner = ModelRunner(build_model("tiny", dtype=dtype), num_blocks=8, block_size=16)
        with torch.inference_mode():
            steps = [runner.prefill(list(range(5, 25)), [0, 1], 0).reshape(1, -1)]
            steps += [runner.decode([30 + i], [[0, 1]], [20 + i]).reshape(1, -1) for i in range(4)]
        logits.append(torch.cat(steps).float())
    assert (logits[0] - logits[1]).abs().max() <= 0.06
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
