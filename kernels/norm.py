"""RMSNorm on the CPU in one C call (``rms_norm.c``, built with the quantized-matmul kernels),
where torch dispatches six operators; ``F.rms_norm`` elsewhere (another device or dtype, a
gradient to track, no compiler, ``MOONCAKE_KERNELS=ref``)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from mooncake_kernels.quant_build import library


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dimension, float32."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or torch.is_grad_enabled()
            or os.environ.get("MOONCAKE_KERNELS") == "ref" or (lib := library()) is None):
        return F.rms_norm(x, weight.shape, weight, eps)
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return out
