"""Tiny random Hugging Face checkpoints written with ``save_pretrained``, for loader tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch

VOCAB = 211  # odd sizes catch transposed or mis-split matrices


def _decisive_init(model: torch.nn.Module, seed: int) -> None:
    """Weights scaled so logits have clear argmaxes (HF's 0.02-std init gives near ties, which
    would make greedy comparisons flaky), with non-trivial norm weights and biases so a swapped
    or missing tensor changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def save_llama(path: Path, *, seed: int = 0, num_layers: int = 3, **overrides):
    """A ``LlamaForCausalLM`` (GQA, non-default rope theta) saved as one safetensors file;
    ``overrides`` may replace any config value."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=48, intermediate_size=100, num_hidden_layers=num_layers, num_attention_heads=6,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rope_theta=5000.0,
                 rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = LlamaConfig(**(shape | overrides))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    _decisive_init(model, seed)
    model.save_pretrained(path)
    return model


def save_qwen2(path: Path, *, seed: int = 0, max_shard_size: str = "40KB"):
    """A ``Qwen2ForCausalLM`` (q/k/v biases, tied embeddings) saved as several shards + index."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=256,
                      rope_theta=20000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    _decisive_init(model, seed)
    model.tie_weights()
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model


def save_qwen3(path: Path, *, seed: int = 0, head_dim: int = 16, **overrides):
    """A ``Qwen3ForCausalLM``: q/k RMS-normalised per head, no biases, tied embeddings; by default
    heads wider than hidden_size / num_attention_heads (as Qwen3-0.6B's 16 x 128 on a 1024-wide
    model; 8B's and 14B's are the usual width: ``head_dim=8`` here); ``overrides`` may replace any
    config value."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=head_dim, vocab_size=VOCAB, max_position_embeddings=256,
                 rope_theta=30000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = Qwen3Config(**(shape | overrides))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    _decisive_init(model, seed)
    model.tie_weights()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation from the Hugging Face model's own ``generate``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
