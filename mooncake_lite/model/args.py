"""Model shapes: presets with seeded dummy weights, or read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Element sizes by dtype name, so shape arithmetic (the conductor, the simulator) needs no torch.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency adjustment (``rope_type: "llama3"``): long wavelengths are
    stretched by ``factor`` so the model reaches past the context it was pretrained on."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"rope scaling values must be positive, got {self}")
        # The interpolation band divides by their difference.
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope scaling high_freq_factor {self.high_freq_factor} must exceed "
                             f"low_freq_factor {self.low_freq_factor}")


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2-style checkpoints have biases on q/k/v
    name: str = "custom"
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    # A head width other than dim / num_heads (Qwen3: 128-wide heads on a 1024-wide model); None: that.
    head_size: int | None = None
    qk_norm: bool = False   # Qwen3: q and k RMS-normalised per head before RoPE

    def __post_init__(self) -> None:
        for f in ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {f} must be positive, got {getattr(self, f)}")
        if self.head_size is None and self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_size is not None and (self.head_size <= 0 or self.head_size % 2):
            raise ValueError(f"head_dim must be positive and even (RoPE rotates pairs), got {self.head_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.dim // self.num_heads

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention output): ``dim``, but wider in a Qwen3."""
        return self.num_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: "torch.dtype | str") -> int:
        """K and V for every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def kv_block_bytes(self, block_size: int, dtype: "torch.dtype | str") -> int:
        return block_size * self.kv_bytes_per_token(dtype)

    def num_params(self) -> int:
        attn = self.dim * self.q_width * 2 + self.dim * self.num_kv_heads * self.head_dim * 2
        attn += 2 * self.head_dim if self.qk_norm else 0
        per_layer = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + emb + self.dim

    def packed_extra_bytes(self, dtype: "torch.dtype | str") -> int:
        """What a packed model (``Transformer.pack_``: a CPU decode in float32) holds beyond its
        weights: each packed copy replaces its plain weight, except a head tied to the embedding,
        whose matrix stays for the embedding beside the head's packed copy."""
        return self.vocab_size * self.dim * dtype_bytes(dtype) if self.tie_embeddings else 0

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "hf") -> "ModelArgs":
        """Read a LLaMA/Qwen2/Qwen3-style ``config.json``."""
        try:
            num_heads = cfg["num_attention_heads"]
            head_dim = cfg.get("head_dim")
            if head_dim is not None and head_dim * num_heads == cfg["hidden_size"]:
                head_dim = None   # the usual width, written out
            return cls(dim=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], num_heads=num_heads,
                       num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                       ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                       max_seq_len=cfg.get("max_position_embeddings", 4096),
                       rope_theta=_rope_theta(cfg),
                       norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                       tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")), name=name,
                       rope_scaling=rope_scaling_from_config(cfg), head_size=head_dim,
                       qk_norm=cfg.get("model_type") == "qwen3")
        except KeyError as exc:
            raise ValueError(f"config.json lacks required key {exc.args[0]!r}") from None


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers >= 5 writes it inside "rope_parameters"; older configs have it at top level.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def rope_params(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The config key holding the rope settings, and its dict: older configs write
    ``rope_scaling``, transformers >= 5 writes ``rope_parameters``."""
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), dict) and cfg[key]:
            return key, cfg[key]
    return "rope_scaling", {}


def rope_type(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))  # "type" is the pre-4.45 spelling


def rope_scaling_from_config(cfg: dict[str, Any]) -> RopeScaling | None:
    """Raises ValueError naming the field for an unsupported rope type or a missing or
    non-numeric llama3 value: scaling silently ignored would run a different model."""
    key, params = rope_params(cfg)
    kind = rope_type(params)
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{key}.rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    values = {}
    for f in dataclasses.fields(RopeScaling):
        value = params.get(f.name)
        if value is None:
            raise ValueError(f"{key}.{f.name} is missing (rope_type 'llama3' needs it)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key}.{f.name} {value!r} is not a number")
        values[f.name] = value
    return RopeScaling(**values)


def dtype_bytes(dtype: "torch.dtype | str") -> int:
    return DTYPE_BYTES[dtype] if isinstance(dtype, str) else dtype.itemsize


def __getattr__(name: str) -> Any:
    # DTYPES (name -> torch.dtype) imports torch lazily: importing ModelArgs must stay torch-free.
    if name == "DTYPES":
        import torch
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

PRESETS: dict[str, ModelArgs] = {
    # Fast enough for CPU tests: ~0.2M parameters, byte-level vocab.
    "tiny": ModelArgs(dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=172, vocab_size=320,
                      max_seq_len=4096, name="tiny"),
    # A mid-size shape for CPU benchmarks (~110M parameters).
    "small": ModelArgs(dim=768, num_layers=12, num_heads=12, num_kv_heads=4, ffn_dim=2048, vocab_size=32000,
                       max_seq_len=8192, name="small"),
    "llama2-7b": ModelArgs(dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_dim=11008,
                           vocab_size=32000, max_seq_len=4096, name="llama2-7b"),
    "llama2-70b": ModelArgs(dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                            vocab_size=32000, max_seq_len=4096, name="llama2-70b"),
    "llama3-8b": ModelArgs(dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                           vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, name="llama3-8b"),
}


def with_overrides(args: ModelArgs, **changes: Any) -> ModelArgs:
    return dataclasses.replace(args, **changes)
