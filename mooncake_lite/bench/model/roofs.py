"""This machine's roofs, measured in the run: the matmul rate prefill approaches and the memory
bandwidth small-batch decode hits (``bench pd`` reads the same two)."""

from __future__ import annotations

import torch

from mooncake_kernels.timing import best_seconds
from mooncake_lite.model.linear import linear, pack_weight


def matmul_gflops(n: int = 2048, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """The faster of the two float32 kernels the model runs on, on one large product: torch's
    ``mm`` (MKL's sgemm on x86) and oneDNN's on a packed weight where there is one. On an AVX-512
    EPYC oneDNN ran twice MKL's rate, so a roof of ``mm`` alone was passed by the model itself."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = best_seconds(lambda: torch.mm(a, b), device, repeats, warmup=1)
    packed = pack_weight(b.t().contiguous())    # a @ b == linear(a, b.T)
    if packed is not None:
        best = min(best, best_seconds(lambda: linear(a, b, packed=packed), device, repeats, warmup=1))
    return 2 * n**3 / best / 1e9


def copy_gbps(num_bytes: int = 256 << 20, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Read + write bandwidth of one large copy (bytes moved counted both ways)."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_seconds(lambda: dst.copy_(src), device, repeats, warmup=1) / 1e9


def read_gbps(num_bytes: int = 256 << 20, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bandwidth of one large read (a sum): what a decode step's weight reads could reach, since
    they write almost nothing. Shown beside the copy roof, which the goals are stated against."""
    src = torch.ones(num_bytes // 4, device=device)
    return num_bytes / best_seconds(lambda: src.sum(), device, repeats, warmup=1) / 1e9
