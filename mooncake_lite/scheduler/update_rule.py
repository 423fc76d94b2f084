"""The bounded update rule every correction moves by (``correction.py``'s module doc: a moving
average of ``log(ratio)`` with a bounded step, within bounded factors), its constants, and the
refusal of a broken observation. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

TOO_SHORT = "too short to time"   # not a refusal: a sub-timer-resolution observation is skipped


@dataclass(frozen=True)
class CorrectionConfig:
    """The update rule's constants (module doc)."""
    alpha: float = 0.25          # weight of one observation in the moving average of log(ratio)
    max_step: float = 0.15       # largest change of a log factor per observation (x1.16)
    max_factor: float = 16.0     # factors stay within [1/16, 16]
    max_ratio: float = 1000.0    # a measured/predicted beyond this is a broken report, not a slowdown
    min_seconds: float = 1e-4    # predictions or measurements shorter than this are timer noise
    spread_quantile: float = 0.5  # the spread shown: this quantile of the recent ratios (the bias left)
    bound_quantile: float | None = None   # admission's bound on the queue: None, the central prediction (queue_bound)
    spread_window: int = 64      # the ratios it is taken over, per instance and metric
    spread_min: int = 8          # fewer observed: no spread (1), the prediction alone
    line_window: int = 24        # a prefill state's line is fitted to its last this many requests
    line_min: int = 8            # ... once it has this many (forward_fit.py)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"CorrectionConfig.alpha must be in (0, 1], got {self.alpha}")
        if not self.max_step > 0.0:
            raise ValueError(f"CorrectionConfig.max_step must be > 0, got {self.max_step}")
        if not 1.0 < self.max_factor <= self.max_ratio:
            raise ValueError("CorrectionConfig: need 1 < max_factor <= max_ratio, got "
                             f"{self.max_factor} and {self.max_ratio}")
        for name in ("spread_quantile", "bound_quantile"):
            q = getattr(self, name)
            if q is not None and not 0.5 <= q < 1.0:
                raise ValueError(f"CorrectionConfig.{name} must be in [0.5, 1), got {q}")
        if not 1 <= self.spread_min <= self.spread_window:
            raise ValueError(f"CorrectionConfig: need 1 <= spread_min <= spread_window, got {self.spread_min} "
                             f"and {self.spread_window}")
        if not 2 <= self.line_min <= self.line_window:
            raise ValueError("CorrectionConfig: need 2 <= line_min <= line_window, got "
                             f"{self.line_min} and {self.line_window}")


@dataclass(frozen=True)
class Factor:
    """One term's correction: ``log`` of the factor, and how many observations moved it."""

    log: float = 0.0
    num_observed: int = 0

    @property
    def value(self) -> float:
        return math.exp(self.log)


def ratio_refusal(predicted_s: float, measured_s: float, cfg: CorrectionConfig) -> str | None:
    """Why an observation is refused (None: it may be used). A NaN, an infinity, a negative or a
    ratio beyond ``max_ratio`` says the report is broken, and a broken report must not move a model."""
    for name, v in (("predicted", predicted_s), ("measured", measured_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            return f"{name} seconds must be a finite number >= 0, got {v!r}"
    if predicted_s < cfg.min_seconds or measured_s < cfg.min_seconds:
        return TOO_SHORT    # (a queue a packing prefill skipped, a fully cached prefix: nothing to time)
    if not 1.0 / cfg.max_ratio <= measured_s / predicted_s <= cfg.max_ratio:
        return f"ratio {measured_s / predicted_s:.3g} outside [1/{cfg.max_ratio:g}, {cfg.max_ratio:g}]"
    return None


def step(f: Factor, ratio: float, cfg: CorrectionConfig, weight: float = 1.0) -> Factor:
    """``f`` moved toward ``ratio`` by the bounded moving average (module doc); ``ratio`` must have
    passed :func:`ratio_refusal`. ``weight`` (in (0, 1]): the share of one observation this is
    (a pack's jobs share one wait), its step and its bound scaled alike."""
    bound = math.log(cfg.max_factor)
    target = min(bound, max(-bound, math.log(ratio)))
    delta = weight * cfg.alpha * (target - f.log)
    delta = min(weight * cfg.max_step, max(-weight * cfg.max_step, delta))
    return Factor(min(bound, max(-bound, f.log + delta)), f.num_observed + 1)
