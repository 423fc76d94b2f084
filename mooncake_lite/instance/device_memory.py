"""How much KV cache an instance on a CUDA device gets: its share of the device, less what it
already holds (the weights), less a reserve for activations.

On a CPU the KV cache is ``--kv-memory`` (``mooncake up`` sizes it from the host's available
memory, ``cluster/plan.py``). On CUDA the device's own memory is the budget: the instance may hold
``--gpu-memory-fraction`` of it in all, so instances sharing one GPU (``mooncake up --gpus``
gives each its fraction) cannot take each other's, and the cache is sized after the weights are
loaded, from what is really there, never more than the device has free at that moment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Kept out of the KV cache for activations (a 2,048-token prefill chunk of an 8B model holds a few
# hundred MB), CUDA graphs' pools and the allocator's slack.
ACTIVATION_RESERVE = 2 << 30
# A KV cache past this many full-length sequences is memory no batch uses; the cap keeps a small
# model (tests' `tiny`) from a free list of millions of blocks on a large GPU.
MAX_DEVICE_SEQUENCES = 256


@dataclass(frozen=True)
class DeviceMemory:
    total: int      # the device's memory
    free: int       # free on the device now (other processes' allocations are not)
    held: int       # what this process's allocator holds already (its weights)


def kv_bytes_on_device(mem: DeviceMemory, fraction: float, *, reserve: int = ACTIVATION_RESERVE,
                       max_bytes: int | None = None) -> int:
    """KV bytes for an instance allowed ``fraction`` of the device: that share less what it holds
    and the reserve, within what is free less the reserve, and at most ``max_bytes``. 0 when
    nothing is left (the caller says so)."""
    budget = min(int(mem.total * fraction) - mem.held - reserve, mem.free - reserve)
    if max_bytes is not None:
        budget = min(budget, max_bytes)
    return max(budget, 0)


def read_device_memory(device: torch.device | str) -> DeviceMemory:
    """This moment's figures for a CUDA ``device`` (call after the weights are loaded)."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return DeviceMemory(total=total, free=free, held=torch.cuda.memory_reserved(torch.device(device)))
