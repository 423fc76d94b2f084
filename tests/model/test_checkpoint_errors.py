"""A broken or unsupported checkpoint, or a bad model name, fails with a message naming the problem."""

import json
import shutil

import pytest

from mooncake_lite.model.generate import main as generate_main
from mooncake_lite.model.loader import CheckpointError, load_checkpoint, read_args
from mooncake_lite.model.weights import build_model, model_args
from tests.model.hf_fixtures import edit_config, edit_tensors, save_llama, save_qwen2


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine")
    save_llama(path, num_layers=2)
    return path


@pytest.fixture
def ckpt(pristine, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_checkpoint(str(ckpt))


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_args(str(ckpt))


def test_config_missing_key(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks required key 'hidden_size'"):
        read_args(str(ckpt))


def test_no_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_checkpoint(str(ckpt))


def test_missing_tensor_is_named(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_checkpoint(str(ckpt))
    # A stage that does not own layer 1 does not need it.
    assert load_checkpoint(str(ckpt), layer_range=(0, 1)).layer_ids == range(0, 1)


def test_untied_checkpoint_without_lm_head(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lacks tensor 'lm_head.weight'"):
        load_checkpoint(str(ckpt))


def test_shape_mismatch(ckpt):
    edit_config(ckpt, intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"has shape \(100, 48\).*implies \(64, 48\)"):
        load_checkpoint(str(ckpt))


def test_unexpected_tensor_is_not_silently_dropped(ckpt):
    edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias", t["model.norm.weight"].clone()))
    with pytest.raises(CheckpointError, match="o_proj.bias' has no counterpart"):
        load_checkpoint(str(ckpt))


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling.rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"head_dim": 15}, "head_dim must be positive and even"),
    ({"num_key_value_heads": 4}, "not divisible by num_kv_heads"),
    ({"num_hidden_layers": -1}, "num_layers must be positive"),
    ({"hidden_size": "48"}, "wrong type"),
])
def test_unsupported_or_invalid_config(ckpt, changes, message):
    edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=message):
        read_args(str(ckpt))


def test_a_head_dim_the_weights_do_not_have_fails_at_load_naming_the_tensor(ckpt):
    edit_config(ckpt, head_dim=16)          # a valid shape on its own: wider heads than the weights'
    assert read_args(str(ckpt)).head_dim == 16
    with pytest.raises(CheckpointError, match=r"q_proj.weight' has shape \(48, 48\), config.json implies \(96, 48\)"):
        load_checkpoint(str(ckpt))


def test_sharded_checkpoint_missing_shard(tmp_path):
    save_qwen2(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard '{shard}', which is missing"):
        load_checkpoint(str(tmp_path))


def test_bad_model_names(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'llama9'"):
        build_model("llama9")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model_args(str(tmp_path / "no-such-dir"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        build_model(str(tmp_path))  # an existing but empty directory


def test_generate_cli_reports_bad_checkpoint(tmp_path, capsys):
    assert generate_main(["--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_bad_runtime_sizes_are_clear():
    import torch

    from mooncake_lite.model.args import ModelArgs
    from mooncake_lite.model.kv_cache import PagedKVCache
    from mooncake_lite.model.runner import ModelRunner
    from mooncake_lite.model.sampling import SamplingParams

    args = ModelArgs.from_name("tiny")
    with pytest.raises(ValueError, match="num_blocks and block_size must be positive"):
        PagedKVCache(args, num_blocks=-4, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        ModelArgs(dim=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=8, vocab_size=-1)
    with pytest.raises(ValueError, match="bad layer range"):
        build_model("tiny", layer_range=(3, 9))
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        SamplingParams(max_tokens=0)
    runner = ModelRunner(build_model("tiny"), num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        runner.prefill(list(range(9)), [0, 1])
    with pytest.raises(MemoryError, match="KV cache full"):
        runner.allocator.allocate(3)
