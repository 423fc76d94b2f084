"""What the kit runs on a device: models, sizes, and each stage's time limit (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

STAGES = ("tests", "bench-model", "decode-graphs", "copies", "bench-pd", "up")
BIG_MODEL = "llama3-8b"          # dummy weights: the yardstick for the HBM roof and MFU
# Limits of the full run on a GPU: together under the 5 minutes the kit must fit in, beside
# the stand-in checkpoint's few seconds.
CUDA_LIMITS = {"tests": 60, "bench-model": 65, "decode-graphs": 35, "copies": 10, "bench-pd": 40, "up": 75}
# The CPU dry run: the same stages, small sizes, limits for a busy 2-core machine.
CPU_LIMITS = {"tests": 180, "bench-model": 300, "decode-graphs": 180, "copies": 90, "bench-pd": 300, "up": 300}
SHORT_LIMITS = dict.fromkeys(STAGES, 180)   # roomy: CI machines are shared
README_QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class KitPlan:
    device: str                          # "cuda" or "cpu"
    models: tuple[str, ...]              # the served model first (default or stand-in), then the large one
    dtype: str
    batch_sizes: tuple[int, ...]
    prompt_len: int
    context_len: int
    num_requests: int                    # replayed through `mooncake up`
    request_len: int                     # prompt tokens per replayed request
    output_len: int
    limits: Mapping[str, float] = field(default_factory=dict)
    short: bool = False
    repeats: int = 2                     # timed runs per figure where the kit times steps itself

    @property
    def served(self) -> str:
        return self.models[0]

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def plan_for(device: str, served: str, *, short: bool = False) -> KitPlan:
    """The sizes the issue names on a GPU; the same stages scaled down on a CPU and in ``short``."""
    if short:
        return KitPlan(device, ("tiny",), "bfloat16" if device == "cuda" else "float32", (1, 2), 32, 32,
                       num_requests=4, request_len=64, output_len=4, limits=SHORT_LIMITS, short=True)
    if device == "cuda":
        return KitPlan(device, (served, BIG_MODEL), "bfloat16", (1, 16, 64), 2048, 512, num_requests=100,
                       request_len=1024, output_len=64, limits=CUDA_LIMITS, repeats=10)
    return KitPlan(device, (served, "tiny"), "float32", (1, 4), 128, 128, num_requests=20, request_len=128,
                   output_len=16, limits=CPU_LIMITS)
