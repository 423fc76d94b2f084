"""How far the output lengths that sized t_d (``predict.OutputPredictor``) were from the real
ones: the live conductor's ``OutputHistory`` and the simulator keep one each, so both report
the same figures."""

from __future__ import annotations


class PredictionAccuracy:
    """Over the finished requests: mean absolute error, and how often the prediction was under."""

    __slots__ = ("num", "abs_error", "num_under")

    def __init__(self) -> None:
        self.num, self.abs_error, self.num_under = 0, 0, 0

    def add(self, expected: int, true_output: int) -> None:
        self.num += 1
        self.abs_error += abs(expected - true_output)
        self.num_under += expected < true_output

    def to_dict(self, count: str = "requests") -> dict[str, float]:
        """The figures, the number of requests under the name ``count``."""
        n = max(self.num, 1)
        return {count: self.num, "mae_tokens": self.abs_error / n, "underestimated": self.num_under / n}
