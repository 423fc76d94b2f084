"""What the conductor has learnt of output lengths: finished requests feed the output-length
predictor (``scheduler/predict.py``), and each new request is sized with its prediction.

Predictive admission forecasts a decode's load at a request's first token from when each
running request will leave (t_d = output tokens × TBT). The client's ``max_tokens`` is only a
bound — often a fixed cap far above the real answer — so each request's membership record (and
so the scheduler's decode views) carries the predicted output instead; ``max_tokens`` still sizes
KV room. The prediction is only an estimate: nothing stops at it."""

from __future__ import annotations

from collections.abc import Sequence

from mooncake_lite.scheduler.predict import OutputPredictor, PredictorConfig
from mooncake_lite.scheduler.prediction_accuracy import PredictionAccuracy


class OutputHistory:
    """One per conductor: predictions at arrival, real lengths fed back at the end, and how
    far off the predictions were (``stats``)."""

    def __init__(self, cfg: PredictorConfig | None = None) -> None:
        self.predictor = OutputPredictor(cfg)
        self.accuracy = PredictionAccuracy()

    def expected(self, block_keys: Sequence[bytes], prompt_len: int, max_tokens: int) -> int:
        """The output length to size this request's decode time with, in [1, max_tokens]."""
        return self.predictor.predict(block_keys, prompt_len, max_tokens)

    def finished(self, block_keys: Sequence[bytes], prompt_len: int, num_tokens: int, expected: int) -> None:
        """A request ended (stop id, max_tokens or stop string) after ``num_tokens`` tokens."""
        if num_tokens < 1:
            return
        self.predictor.observe(block_keys, prompt_len, num_tokens)
        self.accuracy.add(expected, num_tokens)

    def stats(self) -> dict[str, float]:
        return self.accuracy.to_dict("finished")
