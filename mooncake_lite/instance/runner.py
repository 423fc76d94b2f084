"""The model runner (model + paged KV cache) an inference instance's flags describe."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import torch

from mooncake_lite.common.config import require
from mooncake_lite.common.host import available_memory
from mooncake_lite.instance.config import ModelRoleConfig, weights_choice
from mooncake_lite.instance.device_memory import MAX_DEVICE_SEQUENCES, kv_bytes_on_device, read_device_memory
from mooncake_lite.model.args import dtype_bytes
from mooncake_lite.model.grammar import Grammars
from mooncake_lite.model.llama import Transformer
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model

log = logging.getLogger(__name__)


def blocks_for(cfg: ModelRoleConfig, num_layers: int, kv_heads: int, head_dim: int,
               kv_memory: int | None = None) -> int:
    """KV blocks: ``--num-blocks``, else as many as ``kv_memory`` holds (default ``--kv-memory``;
    on CUDA the device's share after the weights, :func:`device_kv_memory`)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    block_bytes = 2 * num_layers * kv_heads * head_dim * dtype_bytes(cfg.torch_dtype) * cfg.block_size
    memory = cfg.kv_memory if kv_memory is None else kv_memory
    source = "--kv-memory" if kv_memory is None else f"{cfg.device}'s share (--gpu-memory-fraction)"
    num = memory // block_bytes
    require(num > 0, f"{source}: {memory} B holds no {cfg.block_size}-token block "
                     f"({block_bytes} B each); raise it or lower --block-size")
    return int(num)


def device_kv_memory(cfg: ModelRoleConfig, model: Transformer) -> int | None:
    """On CUDA, the KV bytes this instance's ``--gpu-memory-fraction`` leaves after its weights
    (read now, once they are loaded); None on other devices (``--kv-memory`` applies)."""
    if not str(cfg.device).startswith("cuda") or cfg.num_blocks is not None:
        return None
    args = model.args
    layers = model.end_layer - model.first_layer
    per_seq = args.max_seq_len * args.kv_bytes_per_token(cfg.torch_dtype) * layers // args.num_layers
    return kv_bytes_on_device(read_device_memory(cfg.device), cfg.gpu_memory_fraction,
                              max_bytes=MAX_DEVICE_SEQUENCES * per_seq)


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


def _tp_runner(cfg: ModelRoleConfig, layer_range: tuple[int, int] | None, threads: int,
               rank_store: Callable | None) -> ModelRunner:
    """Rank 0's runner of a tensor-parallel instance, its followers started (instance/tp_ranks.py).
    Each rank's cache holds its KV heads in 1/N of --kv-memory (a block's tokens on every rank)."""
    from mooncake_lite.instance.tp_ranks import start_group
    from mooncake_lite.model.tensor_parallel import TPLayout
    from mooncake_lite.model.weights import model_args
    local = TPLayout(model_args(cfg.model), cfg.tensor_parallel, 0, expert_parallel=cfg.expert_parallel).local_args()
    # The ranks share this process's CPUs: --threads each, else an equal share of them.
    threads = cfg.threads or max(1, threads // cfg.tensor_parallel)
    torch.set_num_threads(threads)
    first, end = layer_range or (0, local.num_layers)
    per_rank = dataclasses.replace(cfg, kv_memory=max(1, cfg.kv_memory // cfg.tensor_parallel))
    num_blocks = blocks_for(per_rank, end - first, local.num_kv_heads, local.head_dim)
    log.info("model %s at tensor-parallel %d: torch threads %d per rank; KV cache %d blocks of %d tokens per rank",
             cfg.model, cfg.tensor_parallel, threads, num_blocks, cfg.block_size)
    runner = start_group(cfg, layer_range, num_blocks, threads, rank_store).runner
    runner.grammars = Grammars(cfg.model, model_args(cfg.model).vocab_size)   # the leader samples
    return runner


def served_weights(cfg: ModelRoleConfig) -> str:
    """--weights as this instance serves a GGUF's (``instance.config.weights_choice``), said in the log."""
    from mooncake_lite.model.source import resolve
    from mooncake_lite.model.weights import model_args
    from mooncake_lite.model.gguf_loader import keeps_compact
    if resolve(cfg.model).kind != "gguf":
        return "dequantize"   # nothing quantized to keep
    if not keeps_compact(cfg.device, cfg.torch_dtype):
        log.info("weights dequantize (a GGUF's blocks compute only on a CPU in float32, with the block kernel)")
        return "dequantize"
    dense = model_args(cfg.model).num_params() * 4 if cfg.weights == "auto" else 0
    mode, why = weights_choice(cfg.weights, cfg.AUTO_WEIGHTS, dense, available_memory() if dense else 0)
    log.info("weights %s (%s)", mode, why)
    return mode


def build_runner(cfg: ModelRoleConfig, layer_range: tuple[int, int] | None = None,
                 rank_store: Callable | None = None) -> ModelRunner:
    """The model (or a layer slice of it) and its paged cache, as the flags say. ``rank_store``:
    how a TP instance's followers open stores of their own (``instance/tp_ranks.RankPlan``)."""
    threads, allowed = apply_cpu_share(cfg)
    if cfg.tensor_parallel > 1:
        return _tp_runner(cfg, layer_range, threads, rank_store)
    model = build_model(cfg.model, device=cfg.device, dtype=cfg.torch_dtype, layer_range=layer_range, seed=cfg.seed,
                        weights=served_weights(cfg))
    args = model.args
    num_layers = model.end_layer - model.first_layer
    num_blocks = blocks_for(cfg, num_layers, args.num_kv_heads, args.head_dim, device_kv_memory(cfg, model))
    # One line tests and operators can read: what this process actually got.
    log.info("model %s: torch threads %d on cpus %s; KV cache %d blocks of %d tokens", cfg.model, threads,
             ",".join(map(str, allowed)) if allowed else "any", num_blocks, cfg.block_size)
    log.info("dtype %s (%s)", cfg.dtype, cfg.dtype_reason)
    return ModelRunner(model, num_blocks=num_blocks, block_size=cfg.block_size,
                       grammars=Grammars(cfg.model, args.vocab_size))
