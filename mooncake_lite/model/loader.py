"""Loading a local Hugging Face LLaMA/Qwen2/Qwen3-style checkpoint directory.

The directory holds ``config.json`` and ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``). The model is built on the ``meta`` device and the tensors are
attached with ``load_state_dict(assign=True)``, so nothing is allocated twice; a pipeline stage
reads only the tensors of its own layers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

import torch

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.checkpoint_config import read_args
from mooncake_lite.model.errors import CheckpointError, CheckpointNotFoundError
from mooncake_lite.model.family import build_transformer
from mooncake_lite.model.fp8_checkpoint import Fp8Weights, fp8_weights
from mooncake_lite.model.llama import Transformer


# Parts of our parameter names (after ``layers.{i}.``) that Hugging Face names otherwise (after
# ``model.layers.{i}.``); the rest are spelled alike (q_norm, experts.{e}, gate, shared_experts,
# and MLA's projections, which mla.py names as the checkpoints do).
_LAYER_PARTS = {
    "attention": "self_attn", "feed_forward": "mlp",
    "wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
    "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"tok_embeddings.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
# Buffers some older checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_checkpoint(ckpt_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    layer_range: tuple[int, int] | None = None) -> Transformer:
    """The model (or the pipeline stage ``layer_range`` of it) with the checkpoint's weights."""
    args = read_args(ckpt_dir)
    with torch.device("meta"):
        model = build_transformer(args, layer_range)
    index = _tensor_index(ckpt_dir)
    prefix = "model." if any(k.startswith("model.") for k in index) else ""
    wanted = {name: _hf_name(name, args, index, prefix) for name in model.state_dict()}
    fp8 = fp8_weights(ckpt_dir, index)   # issue #39: fp8 weights dequantized at load (fp8_checkpoint.py)
    _check_no_unexpected(index, prefix, [*wanted.values(), *(fp8.scale_names if fp8 else ())], model)
    state = _read_tensors(ckpt_dir, index, wanted, model.state_dict(), device, dtype, fp8)
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def _hf_name(name: str, args: ModelArgs, index: dict[str, str], prefix: str) -> str:
    if name == "output.weight":
        if "lm_head.weight" in index or not args.tie_embeddings:
            return "lm_head.weight"
        return prefix + "embed_tokens.weight"  # tied: the head reuses the embedding matrix
    if name in _TOP_NAMES:
        return prefix + _TOP_NAMES[name]
    m = _LAYER_RE.match(name)
    if m is None:
        raise CheckpointError(f"no checkpoint name known for parameter {name!r}")
    parts = [_LAYER_PARTS.get(part, part) for part in m.group(2).split(".")]
    return f"{prefix}layers.{m.group(1)}.{'.'.join(parts)}"


def _tensor_index(ckpt_dir: str) -> dict[str, str]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    index_path = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        for file in set(weight_map.values()):
            if not os.path.isfile(os.path.join(ckpt_dir, file)):
                raise CheckpointNotFoundError(f"{index_path} lists shard {file!r}, which is missing")
        return dict(weight_map)
    files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"checkpoint directory {ckpt_dir!r} has no *.safetensors files "
                                "(only safetensors checkpoints are supported)")
    index: dict[str, str] = {}
    for file in files:
        with safe_open(os.path.join(ckpt_dir, file), framework="pt") as f:
            index.update(dict.fromkeys(f.keys(), file))
    return index


def _check_no_unexpected(index: dict[str, str], prefix: str, wanted: Iterable[str], model: Transformer) -> None:
    """A checkpoint tensor of this stage that maps to nothing is a feature we would silently drop."""
    wanted = set(wanted)
    for key in index:
        if key in wanted or key.endswith(_IGNORED_SUFFIXES):
            continue
        local = key[len(prefix):] if key.startswith(prefix) else key
        m = _HF_LAYER_RE.match(local)
        if m is not None and int(m.group(1)) not in model.layer_ids:
            continue  # another pipeline stage's layer
        if m is None and local in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            continue  # another stage's embedding or head
        raise CheckpointError(f"checkpoint tensor {key!r} has no counterpart in the model "
                              "(an unsupported architecture variant?)")


def _read_tensors(ckpt_dir: str, index: dict[str, str], wanted: dict[str, str], expected: dict[str, torch.Tensor],
                  device: str | torch.device, dtype: torch.dtype, fp8: Fp8Weights | None = None) -> dict[str, torch.Tensor]:
    """Our name -> tensor on ``device`` in ``dtype``; a checkpoint tensor used twice (tied
    embeddings) is read and converted once, so both parameters share its memory."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, hf in wanted.items():
        if hf not in index:
            raise CheckpointError(f"checkpoint {ckpt_dir!r} lacks tensor {hf!r} (for {name})")
        by_file.setdefault(index[hf], []).append(name)
    state: dict[str, torch.Tensor] = {}
    loaded: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(os.path.join(ckpt_dir, file), framework="pt") as f:
            for name in names:
                hf = wanted[name]
                if hf in loaded:
                    state[name] = loaded[hf]
                    continue
                try:
                    tensor = f.get_tensor(hf)
                    tensor = fp8.convert(hf, tensor) if fp8 is not None else tensor
                except Exception as exc:  # safetensors raises its own error types
                    raise CheckpointError(f"{file}: cannot read tensor {hf!r}: {exc}") from None
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise CheckpointError(f"tensor {hf!r} has shape {tuple(tensor.shape)}, config.json "
                                          f"implies {tuple(expected[name].shape)}")
                state[name] = loaded[hf] = tensor.to(device=device, dtype=dtype)
    return state
