"""YaRN's rope frequencies (``rope_type: "yarn"``, DeepSeek-V3 and Kimi-K2's long context)."""

from __future__ import annotations

import math

import torch

from mooncake_lite.model.family_args import YarnScaling


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """Frequencies that turn fewer than ``beta_slow`` times over the pretraining context are
    divided by ``factor`` (interpolated), those turning more than ``beta_fast`` times stay
    (extrapolated), and a linear ramp over the dimensions between blends the two."""
    def dim_of(rotations: float) -> float:   # the dimension whose frequency turns this often
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # a one-dimension ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep
