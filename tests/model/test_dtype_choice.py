"""``--dtype auto`` (model/args.py:dtype_choice): bfloat16 on CUDA; on a CPU that computes
bfloat16 natively (AMX/AVX512-BF16) bfloat16 for a checkpoint stored in it, float32 for the rest
(GGUF blocks kept, presets, float32 checkpoints) and on other CPUs; each with the reason an
instance states at start-up."""

from __future__ import annotations

import json

import pytest

from kernels import quant_build
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


def test_a_gguf_and_a_preset_stay_float32_on_a_native_cpu(monkeypatch):
    monkeypatch.setattr(quant_build, "cpu_flags", lambda: NATIVE)
    assert dtype_choice("cpu", "smollm2-135m")[0] == dtype_choice("cpu", "tiny")[0] == "float32"


def test_cuda_serves_bfloat16():
    assert dtype_choice("cuda:1")[0] == default_dtype("cuda") == "bfloat16"


def test_the_instance_config_keeps_the_reason_it_states():
    assert Config().dtype == "float32" and Config().dtype_reason.startswith("--dtype auto: ")
    assert Config(dtype="bfloat16").dtype_reason == "asked for"
