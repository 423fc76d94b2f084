"""A checkpoint's model shape from its ``config.json``, without importing torch.

The conductor and the simulator need only the shape (context length, KV bytes per token), so
this module stays torch-free; ``loader.py`` builds on it to load weights.
"""

from __future__ import annotations

import json
import os

from mooncake_lite.model.args import MLA_ROPE_TYPES, ROPE_TYPES, ModelArgs, rope_params, rope_scaling_from_config, \
    rope_type
from mooncake_lite.model.errors import CheckpointError, CheckpointNotFoundError
from mooncake_lite.model.fp8_checkpoint import fp8_block
from mooncake_lite.model.gguf_file import args_from_meta, read_meta
from mooncake_lite.model.source import resolve

DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2")   # Kimi-K2 and Moonlight are DeepSeek-V3 underneath
SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", *DEEPSEEK_TYPES)


def read_args(ckpt_dir: str) -> ModelArgs:
    """Model shape from ``config.json``; refuses features this model does not implement."""
    path = os.path.join(ckpt_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"checkpoint directory {ckpt_dir!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    _check_supported(cfg, path)
    try:
        args = ModelArgs.from_hf_config(cfg, name=os.path.basename(os.path.normpath(ckpt_dir)) or "hf")
    except TypeError as exc:  # e.g. "hidden_size": "768"
        raise CheckpointError(f"{path}: a size has the wrong type ({exc})") from None
    except ValueError as exc:   # a value out of range, or a routing rule this code lacks: it names the field
        raise CheckpointError(f"{path}: {exc}") from None
    return args


def _check_supported(cfg: dict, path: str) -> None:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_TYPES)})")
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        problems.append(f"attention_bias ({'LLaMA' if model_type in ('llama', 'mistral') else model_type} "
                        "puts a bias on o_proj too)")
    rope_key, rope = rope_params(cfg)
    rope_types = MLA_ROPE_TYPES if model_type in DEEPSEEK_TYPES else ROPE_TYPES
    if rope_type(rope) not in rope_types:
        problems.append(f"{rope_key}.rope_type {rope_type(rope)!r} (supported: {', '.join(rope_types)})")
    if cfg.get("use_sliding_window") or (model_type == "mistral" and cfg.get("sliding_window")):
        problems.append("sliding-window attention")
    if problems:
        raise CheckpointError(f"{path}: unsupported model features: {'; '.join(problems)}")
    try:  # a supported rope type whose values are missing or malformed; a quantization we cannot load
        rope_scaling_from_config(cfg)
        fp8_block(cfg, path)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def model_args(model: str) -> ModelArgs:
    """Shape of a preset, named model, GGUF file or checkpoint directory without building weights."""
    source = resolve(model)
    if source.kind == "hf":
        return read_args(model)
    if source.kind == "gguf":
        return args_from_meta(read_meta(source.path), source.served_name)
    return ModelArgs.from_name(model)
