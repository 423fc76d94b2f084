"""Synthetic Mooncake traces: Poisson arrivals, chosen length distributions and cache ratio.

The paper's simulated workload (16k/32k/64k/128k inputs, 512 outputs, 50% cache, Poisson) is
``SynthConfig(input_lengths=(16384, 32768, 65536, 131072), output_lengths=(512,), cache_ratio=0.5)``.

Reuse model: ``num_prefixes`` shared documents (system prompts, uploaded files); every request
after the first of its document reuses the leading ``cache_ratio`` of its blocks from one of
them and appends fresh blocks. Documents grow on demand, so with an infinite cache the measured
block reuse converges to ``cache_ratio`` from below (first touches of each document miss).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from mooncake_lite.trace.format import TRACE_BLOCK_SIZE, TraceRequest

DISTRIBUTIONS = ("fixed", "uniform", "exponential", "lognormal")


@dataclass(frozen=True)
class SynthConfig:
    num_requests: int = 1000
    rate_per_s: float = 1.0                  # mean Poisson arrival rate
    input_lengths: tuple[int, ...] = (16384,)  # means; one is drawn uniformly per request
    output_lengths: tuple[int, ...] = (512,)
    input_dist: str = "fixed"
    output_dist: str = "fixed"
    cache_ratio: float = 0.5
    num_prefixes: int = 64
    block_size: int = TRACE_BLOCK_SIZE
    max_length: int = 131072
    seed: int = 0
    first_hash_id: int = field(default=0)

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.rate_per_s <= 0:
            raise ValueError("num_requests must be >= 1 and rate_per_s > 0")
        if not self.input_lengths or not self.output_lengths or min(self.input_lengths + self.output_lengths) < 1:
            raise ValueError("input and output lengths must be positive")
        for dist in (self.input_dist, self.output_dist):
            if dist not in DISTRIBUTIONS:
                raise ValueError(f"unknown distribution {dist!r}; choose one of {', '.join(DISTRIBUTIONS)}")
        if not 0.0 <= self.cache_ratio < 1.0:
            raise ValueError(f"cache_ratio must be in [0, 1), got {self.cache_ratio}")
        if self.num_prefixes < 1 or self.block_size < 1:
            raise ValueError("num_prefixes and block_size must be >= 1")


def draw_length(rng: random.Random, mean: int, dist: str, max_length: int) -> int:
    """One length with the given mean: fixed, uniform on [mean/2, 3mean/2], exponential, or
    lognormal with sigma 1 (heavy tail like real chat inputs)."""
    if dist == "fixed":
        value = float(mean)
    elif dist == "uniform":
        value = rng.uniform(0.5 * mean, 1.5 * mean)
    elif dist == "exponential":
        value = rng.expovariate(1.0 / mean)
    else:
        value = rng.lognormvariate(math.log(mean) - 0.5, 1.0)  # mean of lognormal = exp(mu + s^2/2)
    return max(1, min(max_length, round(value)))


class _IdAllocator:
    def __init__(self, first: int) -> None:
        self.next_id = first

    def take(self, count: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids


def synthesize(cfg: SynthConfig) -> list[TraceRequest]:
    """Generate ``cfg.num_requests`` requests; the same config gives the same trace."""
    return list(iter_synthesize(cfg))


def iter_synthesize(cfg: SynthConfig) -> Iterator[TraceRequest]:
    """:func:`synthesize`'s requests one at a time (a million-request trace is written without
    being held: only the shared documents are)."""
    rng = random.Random(cfg.seed)
    ids = _IdAllocator(cfg.first_hash_id)
    documents: list[list[int]] = [[] for _ in range(cfg.num_prefixes)]
    now_s = 0.0
    for i in range(cfg.num_requests):
        if i:
            now_s += rng.expovariate(cfg.rate_per_s)
        n_in = draw_length(rng, rng.choice(cfg.input_lengths), cfg.input_dist, cfg.max_length)
        n_out = draw_length(rng, rng.choice(cfg.output_lengths), cfg.output_dist, cfg.max_length)
        num_blocks = math.ceil(n_in / cfg.block_size)
        # Only full blocks can be shared, and the last token is always computed.
        num_shared = min(round(cfg.cache_ratio * num_blocks), (n_in - 1) // cfg.block_size)
        doc = documents[rng.randrange(cfg.num_prefixes)]
        if len(doc) < num_shared:
            doc.extend(ids.take(num_shared - len(doc)))
        hash_ids = tuple(doc[:num_shared]) + tuple(ids.take(num_blocks - num_shared))
        yield TraceRequest(i, round(now_s * 1000.0, 3), n_in, n_out, hash_ids)
