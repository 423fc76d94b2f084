"""A GGUF file's metadata: the model shape, the tokenizer's vocabulary, the chat template, and
where each tensor lies (read by ``gguf_read``, torch-free, once per process)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.errors import CheckpointError
from mooncake_lite.model.gguf_read import TensorInfo, read_header

# Architectures whose GGUF tensors map onto our LLaMA-family decoder.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class GGUFMeta:
    path: str
    fields: dict[str, Any]      # every key but the tokenizer arrays, as plain Python values
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    tensors: dict[str, TensorInfo]   # by name

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @property
    def arch(self) -> str:
        return self.fields["general.architecture"]


_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


def read_meta(path: str) -> GGUFMeta:
    st = os.stat(path)
    return _read_meta(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _read_meta(path: str, _mtime_ns: int, _size: int) -> GGUFMeta:
    fields, tensors = read_header(path)
    arrays = {k: tuple(fields.pop(k, ())) for k in _ARRAYS}
    return GGUFMeta(path, fields, arrays["tokenizer.ggml.tokens"],
                    arrays["tokenizer.ggml.token_type"], arrays["tokenizer.ggml.merges"], tensors)


def args_from_meta(meta: GGUFMeta, name: str) -> ModelArgs:
    """The model shape from ``<arch>.*`` keys; refuses what our decoder does not implement."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{meta.path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def key(k: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{k}", default)
        if value is None:
            raise CheckpointError(f"{meta.path}: GGUF metadata lacks {arch}.{k}")
        return value
    dim, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    usual = dim // num_heads if num_heads else 0
    # heads wider than embedding_length / head_count: every small Qwen3, Mistral-NeMo
    head_dim = int(meta.get(f"{arch}.attention.key_length") or usual)
    _check_gguf_features(meta, arch, head_dim)
    try:
        return ModelArgs(dim=dim, num_layers=int(key("block_count")), num_heads=num_heads,
                         num_kv_heads=int(key("attention.head_count_kv", num_heads)),
                         ffn_dim=int(key("feed_forward_length")),
                         vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta.tokens)),
                         max_seq_len=int(key("context_length", 4096)),
                         rope_theta=float(key("rope.freq_base", 10000.0)),
                         norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
                         tie_embeddings="output.weight" not in meta.tensors,
                         qkv_bias="blk.0.attn_q.bias" in meta.tensors, name=name,
                         head_size=None if head_dim == usual else head_dim,
                         qk_norm="blk.0.attn_q_norm.weight" in meta.tensors)
    except ValueError as exc:
        raise CheckpointError(f"{meta.path}: {exc}") from None


def _check_gguf_features(meta: GGUFMeta, arch: str, head_dim: int) -> None:
    problems = []
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        problems.append(f"{arch}.rope.dimension_count {rope_dims} (partial rotary; head_dim is {head_dim})")
    value = meta.get(f"{arch}.attention.value_length")
    if value is not None and int(value) != head_dim:
        problems.append(f"{arch}.attention.value_length {value} (must equal the key length, {head_dim})")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        problems.append(f"{arch}.rope.scaling.type {scaling!r}")
    if "rope_freqs.weight" in meta.tensors:
        problems.append("tensor rope_freqs.weight (Llama-3.1 rope factors in GGUF form)")
    if meta.get(f"{arch}.expert_count"):
        problems.append(f"{arch}.expert_count (mixture of experts)")
    if problems:
        raise CheckpointError(f"{meta.path}: unsupported model features: {'; '.join(problems)}")


# GGML types (Q4_0, Q4_1, Q8_0) a CPU float32 model keeps as the file's blocks: model/quantized.py.
COMPACT_TYPES = (2, 3, 8)


def compact_weight_bytes(meta: GGUFMeta, dtype_bytes: int) -> tuple[int, bool]:
    """(bytes the weights hold in memory when the compact types stay compact and the rest is
    dequantized to ``dtype_bytes`` a value, whether the embedding is compact): what the memory
    plan counts for ``--weights quantized``. A tied head then reads the embedding's blocks and
    holds no packed copy. Upper bound on the compact share: a fused product whose parts differ
    in type is dequantized whole (``gguf_loader.compact_names``)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    total = 0
    for info in meta.tensors.values():
        count = 1
        for d in info.dims:
            count *= d
        if info.qtype in COMPACT_TYPES:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
            total += count // block * block_bytes
        else:
            total += count * dtype_bytes
    embedding = meta.tensors.get("token_embd.weight")
    return total, embedding is not None and embedding.qtype in COMPACT_TYPES
