"""A mixture-of-experts or MLA checkpoint this code cannot serve as written is refused at load,
naming the config field or the tensor; never a crash deep in a forward pass."""

import json
import shutil

import pytest

from mooncake_lite.model.errors import CheckpointError
from mooncake_lite.model.gguf_file import GGUFMeta, args_from_meta
from mooncake_lite.model.loader import load_checkpoint, read_args
from tests.model.hf_fixtures import edit_config, edit_tensors, save_deepseek_v3, save_qwen3_moe

SAVERS = {"deepseek_v3": save_deepseek_v3, "qwen3_moe": save_qwen3_moe}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    paths = {}
    for name, save in SAVERS.items():
        paths[name] = tmp_path_factory.mktemp(name)
        save(paths[name], num_hidden_layers=2)
    return paths


@pytest.fixture
def copy(pristine, tmp_path):
    def get(name):
        dst = tmp_path / name
        shutil.copytree(pristine[name], dst)
        return dst
    return get


@pytest.mark.parametrize("changes, message", [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
    ({"n_group": 3}, "n_group 3"),
    ({"kv_lora_rank": 23}, "kv_lora_rank \\+ qk_rope_head_dim = 31 must be even"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type 'linear' \\(supported: default, yarn\\)"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.original_max_position_embeddings is missing"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},   # fp8 loads (model/fp8_checkpoint.py)
     "quantization_config.quant_method 'awq' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_deepseek_config_refused_naming_the_field(copy, changes, message):
    path = copy("deepseek_v3")
    edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        read_args(str(path))


def test_qwen3_moe_config_refused_naming_the_field(copy):
    path = copy("qwen3_moe")
    edit_config(path, num_experts_per_tok=9)
    with pytest.raises(CheckpointError, match="num_experts_per_tok 9 exceeds the 8 experts"):
        read_args(str(path))
    cfg = json.loads((path / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks required key 'moe_intermediate_size'"):
        read_args(str(path))
    edit_config(path, moe_intermediate_size=24, num_experts_per_tok=2, rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match="rope_type 'yarn' \\(supported: default, llama3\\)"):
        read_args(str(path))


@pytest.mark.parametrize("which, tensor", [("qwen3_moe", "model.layers.1.mlp.experts.5.up_proj.weight"),
                                           ("deepseek_v3", "model.layers.1.mlp.gate.e_score_correction_bias"),
                                           ("deepseek_v3", "model.layers.1.mlp.shared_experts.down_proj.weight"),
                                           ("deepseek_v3", "model.layers.0.self_attn.kv_b_proj.weight")])
def test_missing_tensor_is_named(copy, which, tensor):
    path = copy(which)
    edit_tensors(path, lambda t: t.pop(tensor))
    with pytest.raises(CheckpointError, match=f"lacks tensor '{tensor}'"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("which, tensor", [("qwen3_moe", "model.layers.0.mlp.experts.2.down_proj.weight"),
                                           ("deepseek_v3", "model.layers.1.mlp.experts.7.gate_proj.weight"),
                                           ("deepseek_v3", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight")])
def test_misshaped_tensor_is_named(copy, which, tensor):
    path = copy(which)
    edit_tensors(path, lambda t: t.update({tensor: t[tensor][:-1]}))
    with pytest.raises(CheckpointError, match=f"tensor '{tensor}' has shape"):
        load_checkpoint(str(path))


def test_an_expert_beyond_the_config_is_named(copy):
    path = copy("qwen3_moe")
    extra = "model.layers.0.mlp.experts.8.up_proj.weight"
    edit_tensors(path, lambda t: t.update({extra: t["model.layers.0.mlp.experts.7.up_proj.weight"].clone()}))
    with pytest.raises(CheckpointError, match=f"'{extra}' has no counterpart"):
        load_checkpoint(str(path))


def test_multi_token_prediction_layer_is_skipped(copy):
    """DeepSeek-V3 ships its MTP module as layer ``num_hidden_layers``; serving does not run it."""
    path = copy("deepseek_v3")
    edit_tensors(path, lambda t: t.update({
        "model.layers.2.eh_proj.weight": t["model.layers.1.self_attn.o_proj.weight"].clone(),
        "model.layers.2.mlp.experts.0.up_proj.weight": t["model.layers.1.mlp.experts.0.up_proj.weight"].clone()}))
    model = load_checkpoint(str(path))
    assert list(model.layers) == ["0", "1"]


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_gguf_of_these_architectures_is_refused_naming_it(arch):
    meta = GGUFMeta("x.gguf", {"general.architecture": arch, f"{arch}.expert_count": 8}, ("a",) * 10, (), (), {})
    with pytest.raises(CheckpointError, match=f"GGUF architecture '{arch}' is not supported"):
        args_from_meta(meta, "x")


def test_kv_compression_of_an_mla_cache_whose_rope_key_fills_a_plane_is_refused_naming_the_flag(copy):
    """The codec scales the rope key as the V plane's tail (test_moe_mla_codec.py); a rope key
    as wide as a plane (kv_lora_rank < qk_rope_head_dim) is refused at start, naming the flag."""
    from mooncake_lite.common.config import ConfigError
    from mooncake_lite.prefill.config import Config
    path = copy("deepseek_v3")
    edit_config(path, kv_lora_rank=6, qk_rope_head_dim=10)
    with pytest.raises(ConfigError, match=r"--kv-compression int8 for .*: the MLA rope key \(10 values\)"):
        Config(model=str(path), kv_compression="int8")
    assert Config(model=str(path)).kv_compression == "none"
