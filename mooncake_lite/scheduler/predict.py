"""Output-length prediction from what is known when a request arrives (pure: no IO, no clock).

Predictive admission sizes each decoding request's remaining time t_d as its output length ×
TBT. The client's ``max_tokens`` is only an upper bound — often a fixed cap far above the real
output — so t_d sized with it keeps finished-soon requests in the forecast for minutes. This
module guesses the output length instead, from:

- **earlier requests that shared its prefix.** A multi-turn conversation resends the whole
  previous turn as the prefix of the next, so the chained block keys of a new prompt contain
  the keys of the turns before it; requests of one application share its system prompt. Each
  finished request adds its output length to the statistics of every key of its chain, and a new
  request reads the *deepest* key of its own chain that has any (its own conversation first,
  then its application);
- **recent history**: the median output of the last ``history`` finished requests of a similar
  prompt length (log2 buckets), for prompts no earlier request shared;
- **max_tokens**: the prediction never exceeds it (the request cannot generate more).

The caller feeds back each finished request's real output length (:meth:`OutputPredictor.observe`):
the live conductor when a stream ends, the simulator when a request's last token is out.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PredictorConfig:
    """history: finished requests per prompt-length bucket the fallback median is taken over;
    max_prefixes: prefix keys remembered (the oldest are forgotten first), bounding memory;
    prior_weight: how many observations' worth the recent-history median counts for when a
    prefix has only a few (a key seen once is a weak guide on its own);
    default_tokens: the guess before anything has finished (clamped to max_tokens)."""

    history: int = 256
    max_prefixes: int = 200_000
    prior_weight: float = 0.0
    default_tokens: int = 256

    def __post_init__(self) -> None:
        if self.history < 1 or self.max_prefixes < 1:
            raise ValueError("history and max_prefixes must be >= 1")
        if self.prior_weight < 0 or self.default_tokens < 1:
            raise ValueError("prior_weight must be >= 0 and default_tokens >= 1")


class _Recent:
    """The last ``size`` values, kept sorted too so the median is one index."""

    __slots__ = ("size", "order", "sorted")

    def __init__(self, size: int) -> None:
        self.size = size
        self.order: deque[int] = deque()
        self.sorted: list[int] = []

    def add(self, value: int) -> None:
        if len(self.order) == self.size:
            old = self.order.popleft()
            del self.sorted[bisect_left(self.sorted, old)]
        self.order.append(value)
        insort(self.sorted, value)

    def median(self) -> int | None:
        return self.sorted[len(self.sorted) // 2] if self.sorted else None


def length_bucket(num_tokens: int) -> int:
    """Prompts within a factor of two share a bucket."""
    return max(num_tokens, 1).bit_length()


class OutputPredictor:
    """See the module docstring. ``predict`` is O(prompt blocks), ``observe`` too."""

    def __init__(self, cfg: PredictorConfig | None = None) -> None:
        self.cfg = cfg or PredictorConfig()
        self._prefix: dict[Hashable, list[float]] = {}    # key -> [count, sum of outputs]
        self._recent: dict[int, _Recent] = {}              # length bucket -> recent outputs
        self._all = _Recent(self.cfg.history)

    def predict(self, block_keys: Sequence[Hashable], num_tokens: int, max_tokens: int) -> int:
        """The expected output length of a request arriving now, in [1, max_tokens]."""
        prior = self._prior(num_tokens)
        guess = prior
        for key in reversed(block_keys):
            stats = self._prefix.get(key)
            if stats is not None:
                count, total = stats
                w = self.cfg.prior_weight
                guess = (total + w * prior) / (count + w)
                break
        return max(1, min(max_tokens, round(guess)))

    def observe(self, block_keys: Sequence[Hashable], num_tokens: int, output_tokens: int) -> None:
        """A request with this prompt finished after ``output_tokens`` tokens."""
        prefix = self._prefix
        for key in block_keys:
            stats = prefix.get(key)
            if stats is None:
                if len(prefix) >= self.cfg.max_prefixes:
                    del prefix[next(iter(prefix))]      # dicts keep insertion order: the oldest
                prefix[key] = [1, output_tokens]
            else:
                stats[0] += 1
                stats[1] += output_tokens
        bucket = length_bucket(num_tokens)
        if bucket not in self._recent:
            self._recent[bucket] = _Recent(self.cfg.history)
        self._recent[bucket].add(output_tokens)
        self._all.add(output_tokens)

    def _prior(self, num_tokens: int) -> float:
        recent = self._recent.get(length_bucket(num_tokens))
        median = recent.median() if recent is not None else None
        if median is None:
            median = self._all.median()
        return float(self.cfg.default_tokens if median is None else median)
