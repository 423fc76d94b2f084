"""The model runner (model + paged KV cache) an inference instance's flags describe."""

from __future__ import annotations

import logging
import os

import torch

from mooncake_lite.common.config import require
from mooncake_lite.instance.config import ModelRoleConfig
from mooncake_lite.model.args import dtype_bytes
from mooncake_lite.model.grammar import Grammars
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model

log = logging.getLogger(__name__)


def blocks_for(cfg: ModelRoleConfig, num_layers: int, kv_heads: int, head_dim: int) -> int:
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    block_bytes = 2 * num_layers * kv_heads * head_dim * dtype_bytes(cfg.torch_dtype) * cfg.block_size
    num = cfg.kv_memory // block_bytes
    require(num > 0, f"--kv-memory {cfg.kv_memory} B holds no {cfg.block_size}-token block "
                     f"({block_bytes} B each); raise it or lower --block-size")
    return int(num)


def apply_cpu_share(cfg: ModelRoleConfig) -> tuple[int, tuple[int, ...] | None]:
    """Pin this process to ``--cpus`` (where the OS can) and set torch's intra-op threads to
    ``--threads``, else to the number of pinned CPUs. Returns (threads, CPUs now allowed)."""
    if cfg.cpus is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cfg.cpus)
        except OSError as exc:   # CPUs outside this container's set: keep running, say so
            log.warning("--cpus %s not applied: %s", ",".join(map(str, cfg.cpus)), exc)
    threads = cfg.threads if cfg.threads is not None else (len(cfg.cpus) if cfg.cpus is not None else None)
    if threads is not None:
        torch.set_num_threads(threads)
    allowed = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else None
    return torch.get_num_threads(), allowed


def build_runner(cfg: ModelRoleConfig, layer_range: tuple[int, int] | None = None) -> ModelRunner:
    """The model (or a layer slice of it) and its paged cache, as the flags say."""
    threads, allowed = apply_cpu_share(cfg)
    model = build_model(cfg.model, device=cfg.device, dtype=cfg.torch_dtype, layer_range=layer_range, seed=cfg.seed)
    args = model.args
    num_layers = model.end_layer - model.first_layer
    num_blocks = blocks_for(cfg, num_layers, args.num_kv_heads, args.head_dim)
    # One line tests and operators can read: what this process actually got.
    log.info("model %s: torch threads %d on cpus %s; KV cache %d blocks of %d tokens", cfg.model, threads,
             ",".join(map(str, allowed)) if allowed else "any", num_blocks, cfg.block_size)
    return ModelRunner(model, num_blocks=num_blocks, block_size=cfg.block_size,
                       grammars=Grammars(cfg.model, args.vocab_size))
