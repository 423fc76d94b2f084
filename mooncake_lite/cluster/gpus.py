"""Which GPU each instance of ``mooncake up --device cuda`` computes on, and its share of it (pure)."""

from __future__ import annotations

from collections.abc import Sequence

# Instances sharing one GPU split `--gpu-memory-fraction` of it in these proportions: decode's KV
# holds every running sequence's whole context, prefill's only the prompts in flight.
GPU_WEIGHTS = {"prefill": 1, "decode": 3}
DEFAULT_GPU_MEMORY_FRACTION = 0.9       # ModelRoleConfig.gpu_memory_fraction's default


def gpu_placement(gpus: Sequence[int], num_prefill: int, num_decode: int,
                  fraction: float = DEFAULT_GPU_MEMORY_FRACTION) -> dict[str, tuple[int, float]]:
    """Instance name → (CUDA device index, its --gpu-memory-fraction): prefills then decodes dealt
    round-robin over ``gpus`` (1P+1D on two GPUs: one each), and each GPU's ``fraction`` split
    among the instances on it by GPU_WEIGHTS."""
    names = [("prefill", f"prefill-{i}") for i in range(num_prefill)]
    names += [("decode", f"decode-{i}") for i in range(num_decode)]
    gpu_of = {name: gpus[k % len(gpus)] for k, (_, name) in enumerate(names)}
    weight_on: dict[int, int] = {}
    for role, name in names:
        weight_on[gpu_of[name]] = weight_on.get(gpu_of[name], 0) + GPU_WEIGHTS[role]
    return {name: (gpu_of[name], fraction * GPU_WEIGHTS[role] / weight_on[gpu_of[name]]) for role, name in names}
