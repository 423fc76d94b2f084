"""What the compute device is: a timing barrier, and the peak figures benchmarks compare against.

CUDA runs kernels asynchronously: a host clock read right after a launch measures the launch,
not the work. Every timer (self-profiling, refinement, benchmarks) calls :func:`sync` before
reading the clock; on the CPU it does nothing.

:func:`gpu_peaks` names a GPU's memory bandwidth, host link and dense matmul peaks from a small
table of known parts (vendor datasheet figures), so a benchmark can print the roof beside what
it measured; for a GPU not in the table every figure is ``None`` ("unknown"), never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sync(device: torch.device | str | None) -> None:
    """Wait until the work this thread queued on ``device`` (its current stream) has finished;
    a no-op off CUDA. Only the current stream: a timer measures compute, and KV copies running
    on their own stream (``kernels/copies.py``) must not be waited for on the way."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.current_stream(device).synchronize()


@dataclass(frozen=True)
class GPUPeaks:
    """A GPU's datasheet roofs; ``None`` where unknown."""
    name: str
    hbm_gbps: float | None = None          # device memory bandwidth, GB/s
    host_link_gbps: float | None = None    # one direction of its host link (PCIe/NVLink-C2C), GB/s
    dense_tflops: dict[str, float] | None = None   # dense (no sparsity) matmul peak by dtype name

    def tflops(self, dtype: str) -> float | None:
        return (self.dense_tflops or {}).get(dtype)


# Datasheet figures (dense tensor-core throughput; float32 runs as TF32 only when allowed, so
# float32 lists the plain FP32 peak). Link: PCIe 4.0 x16 ~ 25 GB/s, 5.0 x16 ~ 50 GB/s usable
# one way; what pinned copies reach in practice is a little lower.
KNOWN_GPUS: tuple[tuple[str, GPUPeaks], ...] = (
    ("H200", GPUPeaks("H200", 4800.0, 50.0, {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0})),
    ("H100 PCIe", GPUPeaks("H100 PCIe", 2000.0, 50.0, {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0})),
    ("H100 NVL", GPUPeaks("H100 NVL", 3900.0, 50.0, {"bfloat16": 835.0, "float16": 835.0, "float32": 60.0})),
    ("H100", GPUPeaks("H100 SXM", 3350.0, 50.0, {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0})),
    ("A100-SXM4-80GB", GPUPeaks("A100 SXM 80GB", 2039.0, 25.0, {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5})),
    ("A100", GPUPeaks("A100", 1555.0, 25.0, {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5})),
    ("L40S", GPUPeaks("L40S", 864.0, 25.0, {"bfloat16": 362.0, "float16": 362.0, "float32": 91.6})),
    ("L4", GPUPeaks("L4", 300.0, 25.0, {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3})),
    ("A10", GPUPeaks("A10", 600.0, 25.0, {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2})),
    ("RTX 4090", GPUPeaks("RTX 4090", 1008.0, 25.0, {"bfloat16": 165.0, "float16": 165.0, "float32": 82.6})),
    ("T4", GPUPeaks("T4", 320.0, 12.5, {"float16": 65.0, "float32": 8.1})),
)


def peaks_for_name(name: str) -> GPUPeaks:
    """The table's entry whose key appears in ``name`` (first match: specific keys come first)."""
    for key, peaks in KNOWN_GPUS:
        if key.lower() in name.lower():
            return peaks
    return GPUPeaks(name)


def gpu_peaks(device: torch.device | str) -> GPUPeaks:
    """Peaks of the CUDA device ``device`` by its reported name (``torch.cuda.get_device_properties``)."""
    return peaks_for_name(torch.cuda.get_device_properties(torch.device(device)).name)


def traced(name: str, fn, *args):
    """``fn(*args)``, named ``name`` in a torch profile when one records: a C kernel called through
    ctypes is otherwise no operator, and ``bench model --profile`` could not tell it apart."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)
