"""Measured KV transfer speed per store pair, for Algorithm 1's transfer-time estimate.

The conductor feeds it what prefills report after moving KV blocks between stores (a hot-spot
migration: bytes and seconds, source store → destination store), and what stores answer after
its own background copies of hot blocks (``conductor/hot_replication.py``) and the scheduler reads the
smoothed speed of the pair a fetch would use. Before a pair's first measurement nothing is
known here and the caller's prior applies (an instance's reported bandwidth, else
``CostModels.bandwidth_bytes_per_s``). Pure: no IO, no clock.

Smoothing is an EWMA of the rate; the first measurement of a pair replaces the prior outright,
because one timed transfer says more about a link than an assumed figure does.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Any

# Transfers smaller than this are mostly round-trip and setup time: their rate says little
# about the link's bandwidth, so they are not recorded.
MIN_TIMED_BYTES = 256 * 1024
_NONE: Mapping[Hashable, float] = {}


class LinkSpeeds:
    """Smoothed bytes/s per (source store, destination store)."""

    def __init__(self, alpha: float = 0.3, min_bytes: int = MIN_TIMED_BYTES) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.min_bytes = min_bytes
        # source -> destination -> bytes/s: the scheduler looks a request's source up once,
        # then one dict lookup per instance it costs with a fetch.
        self._by_source: dict[Hashable, dict[Hashable, float]] = {}
        self.num_observed = 0

    def observe(self, source: Hashable, dest: Hashable, num_bytes: float, seconds: float) -> bool:
        """Record one transfer; False (ignored) when too small to time, or not a transfer."""
        if source == dest or num_bytes < self.min_bytes or not seconds > 0.0:
            return False
        rate = num_bytes / seconds
        row = self._by_source.setdefault(source, {})
        old = row.get(dest)
        row[dest] = rate if old is None else old + self.alpha * (rate - old)
        self.num_observed += 1
        return True

    def from_source(self, source: Hashable) -> Mapping[Hashable, float]:
        """Measured speeds out of ``source``, by destination (empty when none)."""
        return self._by_source.get(source, _NONE)

    def bandwidth(self, source: Hashable, dest: Hashable) -> float | None:
        return self._by_source.get(source, _NONE).get(dest)

    def items(self) -> Iterator[tuple[Hashable, Hashable, float]]:
        """(source, destination, bytes/s) of every measured pair, sorted (for /metrics)."""
        for source in sorted(self._by_source, key=str):
            row = self._by_source[source]
            for dest in sorted(row, key=str):
                yield source, dest, row[dest]


def observe_migration(links: LinkSpeeds, source: Hashable, dest: Hashable,
                      timings: Mapping[str, Any]) -> bool:
    """Record the hot-spot migration a prefill timed (``PrefillResult.timings``: ``migrate_bytes``
    and ``migrate_s``, absent when it moved nothing); anything malformed is ignored."""
    num_bytes, seconds = timings.get("migrate_bytes"), timings.get("migrate_s")
    if not _number(num_bytes) or not _number(seconds):
        return False
    return links.observe(source, dest, float(num_bytes), float(seconds))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x not in (float("inf"),)
