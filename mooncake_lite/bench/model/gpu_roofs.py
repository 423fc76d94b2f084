"""The roofs ``mooncake bench model --device cuda`` prints beside its figures.

Datasheet peaks by GPU name (``kernels/device.py``: HBM bandwidth, host link, dense matmul
TFLOP/s per dtype; ``None``, printed "unknown", for a GPU not in its table), and the host link
as measured here: one large pinned copy each way, what KV copies between the device and host
memory (``kernels/copies.py``) can reach. A model's figures then read as fractions: prefill's
achieved FLOP/s over the dtype's dense peak (MFU), and a decode step's weight reads over the
HBM bandwidth.
"""

from __future__ import annotations

import torch

from mooncake_kernels.device import GPUPeaks, gpu_peaks
from mooncake_kernels.timing import best_seconds


def link_gbps(device: torch.device, num_bytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """Pinned host → device and device → host copy bandwidth (GB/s, one direction each)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    h2d = best_seconds(lambda: dev.copy_(host, non_blocking=True), device, repeats, warmup=1)
    d2h = best_seconds(lambda: host.copy_(dev, non_blocking=True), device, repeats, warmup=1)
    return {"h2d_pinned_gbps": num_bytes / h2d / 1e9, "d2h_pinned_gbps": num_bytes / d2h / 1e9}


def gpu_machine(device: torch.device) -> dict:
    """What the GPU is, its datasheet roofs, and its host link as measured now."""
    props = torch.cuda.get_device_properties(device)
    peaks = gpu_peaks(device)
    return {"name": props.name, "memory_gib": props.total_memory / (1 << 30),
            "multiprocessors": props.multi_processor_count, "hbm_gbps": peaks.hbm_gbps,
            "host_link_gbps": peaks.host_link_gbps, "dense_tflops": peaks.dense_tflops, **link_gbps(device)}


def fractions(gpu: dict, dtype: str, flops_per_s: float, weight_bytes_per_s: float | None = None) -> dict:
    """MFU (achieved FLOP/s over the dtype's dense peak) and, for decode, weight reads over HBM
    bandwidth; ``None`` where the datasheet figure is unknown."""
    peaks = GPUPeaks(gpu["name"], gpu["hbm_gbps"], gpu["host_link_gbps"], gpu["dense_tflops"])
    tflops = peaks.tflops(dtype)
    out = {"mfu": flops_per_s / (tflops * 1e12) if tflops else None}
    if weight_bytes_per_s is not None:
        out["fraction_of_hbm"] = weight_bytes_per_s / (peaks.hbm_gbps * 1e9) if peaks.hbm_gbps else None
    return out


def _pct(x: float | None) -> str:
    return "unknown" if x is None else f"{100 * x:.1f}%"


def _gbps(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.0f} GB/s"


def render_machine(gpu: dict) -> str:
    tflops = gpu["dense_tflops"] or {}
    peaks = ", ".join(f"{k} {v:g}" for k, v in tflops.items()) or "unknown"
    return (f"gpu: {gpu['name']} ({gpu['memory_gib']:.0f} GiB, {gpu['multiprocessors']} SMs); datasheet: "
            f"HBM {_gbps(gpu['hbm_gbps'])}, host link {_gbps(gpu['host_link_gbps'])} each way, dense TFLOP/s "
            f"{peaks}; measured pinned copies: host->device {gpu['h2d_pinned_gbps']:.1f} GB/s "
            f"({_pct(_share(gpu['h2d_pinned_gbps'], gpu['host_link_gbps']))} of link), device->host "
            f"{gpu['d2h_pinned_gbps']:.1f} GB/s ({_pct(_share(gpu['d2h_pinned_gbps'], gpu['host_link_gbps']))})")


def _share(measured: float, roof: float | None) -> float | None:
    return measured / roof if roof else None


def render_prefill(p: dict) -> str:
    return f"  prefill MFU {_pct(p.get('mfu'))} of the datasheet dense peak"


def render_decode(d: dict) -> str:
    return f"    MFU {_pct(d.get('mfu'))}, weights at {_pct(d.get('fraction_of_hbm'))} of HBM bandwidth"
