"""The model runner (model + paged KV cache) an inference instance's flags describe."""

from __future__ import annotations

import torch

from mooncake_lite.common.config import require
from mooncake_lite.instance.config import ModelRoleConfig
from mooncake_lite.model.args import dtype_bytes
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model


def blocks_for(cfg: ModelRoleConfig, num_layers: int, kv_heads: int, head_dim: int) -> int:
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    block_bytes = 2 * num_layers * kv_heads * head_dim * dtype_bytes(cfg.torch_dtype) * cfg.block_size
    num = cfg.kv_memory // block_bytes
    require(num > 0, f"--kv-memory {cfg.kv_memory} B holds no {cfg.block_size}-token block "
                     f"({block_bytes} B each); raise it or lower --block-size")
    return int(num)


def build_runner(cfg: ModelRoleConfig, layer_range: tuple[int, int] | None = None) -> ModelRunner:
    """The model (or a layer slice of it) and its paged cache, as the flags say."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model = build_model(cfg.model, device=cfg.device, dtype=cfg.torch_dtype, layer_range=layer_range, seed=cfg.seed)
    args = model.args
    num_layers = model.end_layer - model.first_layer
    return ModelRunner(model, num_blocks=blocks_for(cfg, num_layers, args.num_kv_heads, args.head_dim),
                       block_size=cfg.block_size)
