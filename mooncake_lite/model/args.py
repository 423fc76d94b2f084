"""Model shapes: presets with seeded dummy weights, or read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mooncake_lite.model.family_args import MLAArgs, MoEArgs, YarnScaling, mla_from_config, moe_from_config, \
    yarn_from_params

if TYPE_CHECKING:
    import torch

# Element sizes by dtype name, so shape arithmetic (the conductor, the simulator) needs no torch.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


ROPE_TYPES = ("default", "llama3")
MLA_ROPE_TYPES = ("default", "yarn")   # what the DeepSeek family's checkpoints use


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
    rope_scaling: RopeScaling | YarnScaling | None = None  # None: plain RoPE
    # A head width other than dim / num_heads (Qwen3: 128-wide heads on a 1024-wide model); None: that.
    # num_kv_heads x head_dim is also what each token caches per layer in each of the K and V planes:
    # an MLA model has one such "head" half its latent wide (``from_hf_config``).
    head_size: int | None = None
    qk_norm: bool = False   # Qwen3: q and k RMS-normalised per head before RoPE
    moe: MoEArgs | None = None   # routed experts on the sparse layers
    mla: MLAArgs | None = None   # multi-head latent attention (DeepSeek-V3)

    def __post_init__(self) -> None:
        for f in ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {f} must be positive, got {getattr(self, f)}")
        if self.head_size is None and self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_size is not None and (self.head_size <= 0 or (self.head_size % 2 and self.mla is None)):
            raise ValueError(f"head_dim must be positive and even (RoPE rotates pairs), got {self.head_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.mla is not None and (self.num_kv_heads, 2 * self.head_dim) != (1, self.mla.latent_width):
            raise ValueError(f"an MLA model caches one row of {self.mla.latent_width} values: num_kv_heads must be 1 "
                             f"and head_size {self.mla.latent_width // 2}, got {self.num_kv_heads}, {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.dim // self.num_heads

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention output): ``dim``, but wider in a Qwen3; MLA's
        queries are ``qk_nope_head_dim + qk_rope_head_dim`` wide per head."""
        return self.num_heads * (self.mla.qk_head_dim if self.mla is not None else self.head_dim)

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates: the head, or MLA's decoupled rope part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def kv_replicated(self) -> bool:
        """Whether the cached KV cannot be split by head (MLA's latent): every tensor-parallel rank
        holds all of it and one writes it, the "replicated" layout of ``transfer/kv_layout.py``."""
        return self.mla is not None

    def kv_bytes_per_token(self, dtype: "torch.dtype | str") -> int:
        """K and V for every layer: 2 × layers × kv_heads × head_dim × dtype bytes; for MLA the
        latent and rope key, layers × (kv_lora_rank + qk_rope_head_dim) × dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def kv_block_bytes(self, block_size: int, dtype: "torch.dtype | str") -> int:
        return block_size * self.kv_bytes_per_token(dtype)

    def num_params(self) -> int:
        """Every weight (what memory holds)."""
        return self._params(active=False)

    def active_params(self) -> int:
        """Weights one token runs through (what its FLOPs scale with): with experts, only its
        ``top_k`` routed ones and the shared; equal to :meth:`num_params` for a dense model."""
        return self._params(active=True)

    def _params(self, active: bool) -> int:
        if self.mla is None:
            attn = self.dim * self.q_width * 2 + self.dim * self.num_kv_heads * self.head_dim * 2
            attn += 2 * self.head_dim if self.qk_norm else 0
        else:
            attn = mla_params(self.mla, self.dim, self.num_heads)
        mlps = [3 * self.dim * self.ffn_dim] * self.num_layers
        if self.moe is not None:
            m = self.moe
            experts = m.top_k if active else m.num_experts
            sparse = (3 * self.dim * (m.expert_ffn_dim * experts + m.shared_width)
                      + self.dim * m.num_experts + (m.num_experts if m.has_correction_bias else 0))
            mlps = [sparse if m.is_sparse(i) else mlp for i, mlp in enumerate(mlps)]
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + 2 * self.dim) + sum(mlps) + emb + self.dim

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
        """Read a LLaMA/Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3-style ``config.json``."""
        try:
            num_heads = cfg["num_attention_heads"]
            head_dim, kv_heads = cfg.get("head_dim"), cfg.get("num_key_value_heads") or num_heads
            mla = mla_from_config(cfg)
            if mla is not None:   # the cache row: the latent over the K and V planes of one "head"
                head_dim, kv_heads = mla.latent_width // 2, 1
            elif head_dim is not None and head_dim * num_heads == cfg["hidden_size"]:
                head_dim = None   # the usual width, written out
            return cls(dim=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], num_heads=num_heads,
                       num_kv_heads=kv_heads,
                       ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                       max_seq_len=cfg.get("max_position_embeddings", 4096),
                       rope_theta=_rope_theta(cfg),
                       norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                       tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")), name=name,
                       rope_scaling=rope_scaling_from_config(cfg), head_size=head_dim,
                       qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe"),
                       moe=moe_from_config(cfg, cfg["num_hidden_layers"]), mla=mla)
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
    if kind == "yarn":
        return yarn_from_params(key, params, cfg.get("max_position_embeddings", 4096))
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


def mla_params(m: MLAArgs, dim: int, num_heads: int) -> int:
    q_out = num_heads * m.qk_head_dim
    q = dim * q_out if m.q_lora_rank is None else dim * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * q_out
    kv = dim * m.latent_width + m.kv_lora_rank + m.kv_lora_rank * num_heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + num_heads * m.v_head_dim * dim


def default_dtype(device: str, model: str | None = None) -> str:
    """The serving dtype of ``model`` where none is asked for (:func:`dtype_choice`). Here,
    torch-free, because `mooncake up` plans the cluster with it and must not import torch."""
    return dtype_choice(device, model)[0]


def dtype_choice(device: str, model: str | None = None) -> tuple[str, str]:
    """(the serving dtype where none is asked for, why: an instance says it at start-up).
    bfloat16 on CUDA. On a CPU that computes bfloat16 natively (AMX, AVX512-BF16), bfloat16 for a
    checkpoint stored in it (nothing lost against the file), measured faster there; float32 for
    the rest: a GGUF's blocks kept compute in float32 (2.7x faster than bfloat16 dequantized),
    presets and float32 checkpoints keep their values (docs/results/2026-11-29-decode-layers.md)."""
    if str(device).startswith("cuda"):
        return "bfloat16", "CUDA: tensor cores, half the bytes a step"
    from mooncake_kernels.quant_build import cpu_flags
    native = sorted(set(cpu_flags().split()) & {"amx_bf16", "avx512_bf16"})
    if not native:
        return "float32", "no bfloat16 arithmetic on this CPU (every bfloat16 product would convert)"
    if model is not None and _stored_dtype(model) == "bfloat16":
        return "bfloat16", (f"a bfloat16 checkpoint on a CPU that computes it natively ({', '.join(native)}): "
                            "measured 2.5x float32's prefill and 1.1x (batch 1) to 2.6x (batch 16) its decode")
    return "float32", (f"this CPU computes bfloat16 natively ({', '.join(native)}), but the model is not stored "
                       "in it (a GGUF's blocks kept compute in float32, measured 2.7x a bfloat16 decode step)")


def _stored_dtype(model: str) -> str | None:
    """A Hugging Face checkpoint directory's own dtype (config.json), None for anything else."""
    import json
    import os
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config.get("torch_dtype") or config.get("dtype")


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
    # "tiny" with 8 routed experts (top 2) on layers 1-3, layer 0 dense: Qwen3-MoE's routing in miniature.
    "tiny-moe": ModelArgs(dim=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=172, vocab_size=320,
                          max_seq_len=4096, name="tiny-moe", qk_norm=True,
                          moe=MoEArgs(num_experts=8, top_k=2, expert_ffn_dim=64, norm_topk_prob=True,
                                      dense_layers=(0,))),
    # DeepSeek-V3's parts in miniature: MLA (q low-rank, 32 + 16 latent) and grouped sigmoid routing.
    "tiny-mla": ModelArgs(dim=64, num_layers=4, num_heads=4, num_kv_heads=1, ffn_dim=172, vocab_size=320,
                          max_seq_len=4096, name="tiny-mla", head_size=24,
                          moe=MoEArgs(num_experts=8, top_k=2, expert_ffn_dim=32, norm_topk_prob=True, dense_layers=(0,),
                                      num_shared_experts=1, scoring="sigmoid", num_groups=4, topk_groups=2,
                                      routed_scaling=2.5),
                          mla=MLAArgs(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                      v_head_dim=16)),
    # DeepSeek-V3's per-token KV at 1024 wide and 4 deep, for ``bench pd`` on a CPU: its latent (512 +
    # 64), heads (128 + 64 keys, 128 values), q low-rank; 16 experts in 4 groups. Its twin below is
    # the same model with GQA-8 attention of 128-wide heads (bench moe's ``dense_peers``): 3.56x the KV.
    "v3-mini": ModelArgs(dim=1024, num_layers=4, num_heads=8, num_kv_heads=1, ffn_dim=2816, vocab_size=320,
                         max_seq_len=4096, norm_eps=1e-6, name="v3-mini", head_size=288,
                         moe=MoEArgs(num_experts=16, top_k=2, expert_ffn_dim=256, norm_topk_prob=True,
                                     dense_layers=(0,), num_shared_experts=1, scoring="sigmoid", num_groups=4,
                                     topk_groups=2, routed_scaling=2.5),
                         mla=MLAArgs(kv_lora_rank=512, q_lora_rank=384, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                     v_head_dim=128)),
    # Published shapes (config.json of Qwen/Qwen3-30B-A3B and deepseek-ai/DeepSeek-V3), for sizing.
    "qwen3-30b-a3b": ModelArgs(dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, ffn_dim=6144, vocab_size=151936,
                               max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, name="qwen3-30b-a3b", head_size=128,
                               qk_norm=True, moe=MoEArgs(num_experts=128, top_k=8, expert_ffn_dim=768,
                                                         norm_topk_prob=True)),
    "deepseek-v3": ModelArgs(dim=7168, num_layers=61, num_heads=128, num_kv_heads=1, ffn_dim=18432, vocab_size=129280,
                             max_seq_len=163840, norm_eps=1e-6, name="deepseek-v3", head_size=288,
                             rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                                                      mscale_all_dim=1.0),
                             moe=MoEArgs(num_experts=256, top_k=8, expert_ffn_dim=2048, norm_topk_prob=True,
                                         dense_layers=(0, 1, 2), num_shared_experts=1, scoring="sigmoid",
                                         num_groups=8, topk_groups=4, routed_scaling=2.5),
                             mla=MLAArgs(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                                         qk_rope_head_dim=64, v_head_dim=128)),
}


PRESETS["v3-mini-gqa"] = dataclasses.replace(PRESETS["v3-mini"], num_kv_heads=8, head_size=128, mla=None,
                                             name="v3-mini-gqa")


def with_overrides(args: ModelArgs, **changes: Any) -> ModelArgs:
    return dataclasses.replace(args, **changes)
