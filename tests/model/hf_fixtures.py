"""Tiny random Hugging Face checkpoints written with ``save_pretrained``, for loader tests."""

from __future__ import annotations

import json
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
            else:   # fan-in is the last dimension (2-D [out, in], and 3-D stacked experts [e, out, in])
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # DeepSeek's: non-zero, so picking != weighing
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


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


def save_qwen3_moe(path: Path, *, seed: int = 0, **overrides):
    """A ``Qwen3MoeForCausalLM``: 8 experts, top 3, normalised top-k weights, layer 2 dense
    (``mlp_only_layers``); Qwen3 attention."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(hidden_size=32, intermediate_size=56, moe_intermediate_size=24, num_experts=8,
                 num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[2], decoder_sparse_step=1,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=VOCAB, max_position_embeddings=256, rope_theta=30000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = Qwen3MoeConfig(**(shape | overrides))
    return _save(Qwen3MoeForCausalLM(cfg), path, seed)


def save_deepseek_v3(path: Path, *, seed: int = 0, **overrides):
    """A ``DeepseekV3ForCausalLM`` with the hard parts: MLA with a q low-rank projection (``q_lora_rank``
    null: one plain projection), interleaved rope, YaRN with mscale != mscale_all_dim; 8 experts in
    4 groups of which 2 compete, top 3, a non-zero correction bias, sigmoid scores, a shared expert,
    routed_scaling_factor, one first dense layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    shape = dict(hidden_size=32, intermediate_size=56, moe_intermediate_size=16, n_routed_experts=8,
                 num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                 norm_topk_prob=True, first_k_dense_replace=1, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8,
                 v_head_dim=10, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                                  "mscale": 0.9, "mscale_all_dim": 0.7},
                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = DeepseekV3Config(**(shape | overrides))
    return _save(DeepseekV3ForCausalLM(cfg), path, seed)


def _save(model, path: Path, seed: int):
    torch.manual_seed(seed)
    model = model.eval()
    _decisive_init(model, seed)
    model.save_pretrained(path)
    return model


CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_chat_tokenizer(path: Path, corpus: list[str], vocab_size: int, specials: list[str] = CHAT_SPECIALS,
                        template: str = CHAT_TEMPLATE) -> int:
    """A byte-level BPE tokenizer trained on ``corpus`` with a ChatML-style template, beside a
    checkpoint, as ``mooncake up --model DIR`` reads it; returns the end-of-turn token's id."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 4, trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    return tok.token_to_id("<|im_end|>")


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation from the Hugging Face model's own ``generate``."""
    with torch.no_grad():
        # An explicit mask: else generate() masks every prompt token equal to pad_token_id (0 is a
        # chat tokenizer's first special token, e.g. <|im_start|>) and answers another prompt.
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def edit_config(path: Path, **changes) -> None:
    """Change keys of a saved checkpoint's config.json (the bad-input tests)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    """Let ``fn`` change a saved checkpoint's tensors in place (a dict name -> tensor)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


def two_stage_output(first, second, token_ids: list[int], block_size: int) -> torch.Tensor:
    """The last hidden output of a prompt run layer-wise through two pipeline stages' models."""
    from mooncake_lite.model.kv_cache import blocks_needed
    from mooncake_lite.model.runner import LayerwisePass, ModelRunner
    table = list(range(blocks_needed(len(token_ids), block_size)))
    p0 = LayerwisePass(ModelRunner(first, num_blocks=len(table), block_size=block_size), table, 0,
                       token_ids=token_ids)
    for layer in first.layer_ids:
        p0.run_layer(layer)
    p1 = LayerwisePass(ModelRunner(second, num_blocks=len(table), block_size=block_size), table, 0,
                       hidden=p0.output())
    for layer in second.layer_ids:
        p1.run_layer(layer)
    return p1.output()


def checkpoint_cache(tmp_path_factory, checkpoints: dict):
    """``get(name)``: checkpoint ``name`` of ``checkpoints`` (name -> (save function, its keywords))
    written once into a temporary directory: (its directory, the transformers model it came from)."""
    cache = {}

    def get(name):
        if name not in cache:
            save, kw = checkpoints[name]
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, save(path, **kw))
        return cache[name]
    return get
