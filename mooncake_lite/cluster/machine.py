"""What ``mooncake up`` reads about this machine and the served model to divide them among its
roles (the division itself is pure: ``shares.core_shares`` / ``shares.memory_shares``)."""

from __future__ import annotations

import dataclasses
import os

from mooncake_lite.cluster.plan import UpOptions, kv_layout, on_gpu, role_setting
from mooncake_lite.cluster.shares import DEFAULT_MEMORY_FRACTION, MachineShare
from mooncake_lite.common.host import available_memory


def usable_cpus() -> tuple[int, ...]:
    """CPUs this process may run on (its affinity, e.g. a container's cpuset), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def packs_weights(opts: UpOptions, role: str, dtype: str) -> bool:
    """Whether ``role``'s instances may run on oneDNN-packed weights (``Transformer.pack_``: float32
    on a CPU; docs/model.md, "CPU paths"), which hold ``ModelArgs.packed_extra_bytes`` beyond the
    weights: a decode always, a prefill unless ``--pack-weights off`` (with ``auto`` it packs only
    where that measures faster, which ``mooncake up`` cannot know ahead: counted, to be safe)."""
    if role == "prefill" and str(role_setting(opts, role, "pack_weights") or "auto") == "off":
        return False
    return dtype == "float32" and not on_gpu(opts, role)


def with_machine_share(opts: UpOptions, *, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                       threads: int | None = None, pin: bool = False) -> UpOptions:
    """``opts`` with this machine's CPUs and available memory and the served model's weight and KV
    sizes, for the plan to divide. A model this process cannot read still gets its core shares
    (the memory shares then count no weights)."""
    from mooncake_lite.model.args import dtype_bytes
    from mooncake_lite.model.checkpoint_config import model_args
    facts: dict[str, int] = {}
    available = available_memory()   # read once: the plan and the prefill's weights choice see one figure
    try:
        args = model_args(opts.model)
        _, dtype = kv_layout(opts)
        weights = args.num_params() * dtype_bytes(dtype)
        extra = args.packed_extra_bytes(dtype)
        compact = _compact_weights(opts, dtype)   # issue #39: a GGUF's quantized weights kept compact
        dense = 0
        if compact is not None:
            weights, extra = compact[0], 0 if compact[1] else extra
            dense = _prefill_dense_bytes(opts, args.num_params() * 4, available)
        # weights on a GPU take none of the host's memory (the KV there is sized by the instance)
        facts = {"weight_bytes": 0 if on_gpu(opts, "prefill") and on_gpu(opts, "decode") else weights,
                 "decode_pack_bytes": extra if packs_weights(opts, "decode", dtype) else 0,
                 "prefill_pack_bytes": dense + (extra if packs_weights(opts, "prefill", dtype) else 0),
                 "kv_token_bytes": args.kv_bytes_per_token(dtype), "max_seq_len": args.max_seq_len,
                 # every TP rank's whole copy: the embedding (the norms are noise beside it)
                 "replicated_weight_bytes": min(weights, args.vocab_size * args.dim * dtype_bytes(dtype))}
    except (ValueError, OSError, KeyError):
        pass
    share = MachineShare(cpus=usable_cpus(), available_memory=available, memory_fraction=memory_fraction,
                         threads=threads, pin=pin, **facts)
    return dataclasses.replace(opts, share=share)


def _compact_weights(opts: UpOptions, dtype: str) -> tuple[int, bool] | None:
    """``gguf_file.compact_weight_bytes`` where every instance keeps a GGUF's quantized weights
    compact (a CPU in float32, ``--weights`` not ``dequantize``), else None (weights in the dtype)."""
    from mooncake_lite.model.gguf_file import compact_weight_bytes, read_meta
    from mooncake_lite.model.source import resolve
    source = resolve(opts.model)
    roles = ("prefill", "decode")
    if (source.kind != "gguf" or dtype != "float32"
            or any(str(role_setting(opts, r, "weights") or "auto") == "dequantize" for r in roles)
            or any(str(role_setting(opts, r, "device") or "cpu") != "cpu" for r in roles)):
        return None
    return compact_weight_bytes(read_meta(source.path), 4)


def _prefill_dense_bytes(opts: UpOptions, dense: int, available: int) -> int:
    """The float copy a prefill keeping its blocks holds beside them (``--weights hybrid``, or
    ``auto`` where it fits: ``instance.config.weights_choice``, the rule the instance applies)."""
    from mooncake_lite.instance.config import weights_choice
    from mooncake_lite.prefill.config import Config
    mode = str(role_setting(opts, "prefill", "weights") or "auto")
    chosen, _ = weights_choice(mode, Config.AUTO_WEIGHTS, dense, available)
    return dense if chosen == "hybrid" else 0
