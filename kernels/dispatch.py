"""Run-time choice between a fast GPU kernel module and the torch reference.

A fast module is used only for CUDA tensors, only when it imports (Triton present), and never when
``MOONCAKE_KERNELS=ref`` is set (to rule kernels out while debugging, or to benchmark the reference).
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from types import ModuleType

import torch


@cache
def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"mooncake_kernels.{name}")
    except ImportError:  # no Triton (every CPU machine): the reference serves
        return None


def fast_module(name: str, *tensors: torch.Tensor) -> ModuleType | None:
    """``mooncake_kernels.<name>`` if every tensor is on CUDA and the module imports, else ``None``."""
    if os.environ.get("MOONCAKE_KERNELS", "") == "ref":
        return None
    if not tensors or not all(t.is_cuda for t in tensors):
        return None
    return _import(name)
