"""Shapes of the mixture-of-experts and multi-head-latent-attention families, read from a Hugging
Face ``config.json`` without torch: Qwen3-MoE (``qwen3_moe``) and DeepSeek-V3 (``deepseek_v3``,
which Kimi-K2 and Moonlight also use). ``args.ModelArgs`` carries them as ``moe`` and ``mla``.

Every reader raises ValueError naming the config field it cannot honour: a routing rule or rope
variant silently replaced by another would serve a different model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SCORING_FUNCTIONS = ("softmax", "sigmoid")
# DeepSeek-V3's selection: group-limited top-k over scores plus a correction bias ("no auxiliary
# loss"); V2's "greedy"/"group_limited_greedy" on softmax scores weigh experts differently.
TOPK_METHODS = ("noaux_tc",)


@dataclass(frozen=True)
class MoEArgs:
    """Routed experts (and, DeepSeek, shared ones) in place of the dense MLP on sparse layers."""
    num_experts: int
    top_k: int
    expert_ffn_dim: int
    norm_topk_prob: bool
    dense_layers: tuple[int, ...] = ()    # layers keeping the dense MLP (``ModelArgs.ffn_dim`` wide)
    num_shared_experts: int = 0           # one MLP ``num_shared_experts × expert_ffn_dim`` wide, always on
    scoring: str = "softmax"              # "sigmoid": DeepSeek-V3, with a per-expert correction bias
    num_groups: int = 1                   # experts in groups; only ``topk_groups`` best groups compete
    topk_groups: int = 1
    routed_scaling: float = 1.0           # multiplies the routed experts' weights (not the shared)
    # A tensor-parallel rank's share (model/tensor_parallel.py); the whole model's are the defaults.
    held_experts: tuple[int, int] | None = None   # the routed experts [first, end) it computes; None: all
    shared_ffn_dim: int | None = None             # its slice of the shared experts; None: all of them

    def __post_init__(self) -> None:
        for f in ("num_experts", "top_k", "expert_ffn_dim", "num_groups", "topk_groups"):
            if getattr(self, f) <= 0:
                raise ValueError(f"moe {f} must be positive, got {getattr(self, f)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} exceeds the {self.num_experts} experts")
        if self.scoring not in SCORING_FUNCTIONS:
            raise ValueError(f"scoring_func {self.scoring!r} (supported: {', '.join(SCORING_FUNCTIONS)})")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(f"n_group {self.num_groups} / topk_group {self.topk_groups} do not fit "
                             f"{self.num_experts} experts")
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError("n_group: a group's score is its best two experts', so groups need two or more")

    @property
    def shared_width(self) -> int:
        """Width of the one MLP the shared experts make (0: none)."""
        return self.shared_ffn_dim if self.shared_ffn_dim is not None else self.expert_ffn_dim * self.num_shared_experts

    @property
    def expert_ids(self) -> range:
        """The routed experts this model (or rank) computes: all, or a rank's placed share."""
        return range(*self.held_experts) if self.held_experts is not None else range(self.num_experts)

    @property
    def has_correction_bias(self) -> bool:
        return self.scoring == "sigmoid"

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class MLAArgs:
    """Multi-head latent attention: each token caches one normalised latent of ``kv_lora_rank``
    values and a ``qk_rope_head_dim`` rotated key shared by every head; keys and values per head
    are up-projections of the latent."""
    kv_lora_rank: int
    q_lora_rank: int | None        # None: the query is one plain projection
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True   # rotary pairs are adjacent (x0, x1), as DeepSeek's weights lay them out

    def __post_init__(self) -> None:
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.latent_width % 2:
            raise ValueError(f"kv_lora_rank + qk_rope_head_dim = {self.latent_width} must be even "
                             "(the cache splits the latent over its two planes)")

    @property
    def latent_width(self) -> int:
        """Values one token caches per layer: the latent and the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (``rope_type: "yarn"``): frequencies blended between the pretrained and
    the ``factor``-stretched ones by a ramp over ``beta_fast..beta_slow`` rotations, cos/sin
    scaled by :attr:`attention_factor`; DeepSeek also scales the softmax by ``mscale_all_dim``."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    explicit_attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"rope yarn factor and original_max_position_embeddings must be positive, got {self}")

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' rule)."""
        if self.explicit_attention_factor is not None:
            return self.explicit_attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """DeepSeek's factor on the softmax scale: mscale(factor, mscale_all_dim) squared."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_from_params(key: str, params: dict[str, Any], max_position_embeddings: int) -> YarnScaling:
    def number(name: str, default: float | None = None) -> float | None:
        value = params.get(name, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{key}.{name} {value!r} is not a number")
        return value
    original = number("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"{key}.original_max_position_embeddings is missing (rope_type 'yarn' needs it)")
    factor = number("factor")
    if factor is None:   # transformers' fallback: the context stretch itself
        factor = max_position_embeddings / original
    return YarnScaling(factor=float(factor), original_max_position_embeddings=int(original),
                       beta_fast=float(number("beta_fast") or 32.0), beta_slow=float(number("beta_slow") or 1.0),
                       mscale=number("mscale"), mscale_all_dim=number("mscale_all_dim"),
                       explicit_attention_factor=number("attention_factor"),
                       truncate=bool(params.get("truncate", True)))


def moe_from_config(cfg: dict[str, Any], num_layers: int) -> MoEArgs | None:
    """Qwen3-MoE's or DeepSeek-V3's experts; None for a dense config."""
    model_type = cfg.get("model_type")
    if model_type == "qwen3_moe":
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not num_experts:
            return None
        step = cfg.get("decoder_sparse_step", 1)
        only_mlp = set(cfg.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
        return MoEArgs(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                       expert_ffn_dim=cfg["moe_intermediate_size"],
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
    if not cfg.get("n_routed_experts"):
        return None
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"scoring_func {scoring!r} (supported for {model_type}: 'sigmoid')")
    method = cfg.get("topk_method", "noaux_tc")
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_method {method!r} (supported: {', '.join(TOPK_METHODS)})")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq {cfg['moe_layer_freq']!r} (supported: 1)")
    first_dense = cfg.get("first_k_dense_replace") or 0
    return MoEArgs(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                   expert_ffn_dim=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   dense_layers=tuple(range(min(first_dense, num_layers))),
                   num_shared_experts=cfg.get("n_shared_experts") or 0, scoring="sigmoid",
                   num_groups=cfg.get("n_group") or 1, topk_groups=cfg.get("topk_group") or 1,
                   routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)))


def mla_from_config(cfg: dict[str, Any]) -> MLAArgs | None:
    if cfg.get("kv_lora_rank") is None:
        return None
    return MLAArgs(kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg.get("q_lora_rank"),
                   qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                   v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)))
