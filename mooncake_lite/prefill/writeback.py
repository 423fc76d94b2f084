"""Counting and logging a prefill stage's write-backs of new blocks to its store.

A write-back runs in the background and nothing waits for it, so a failing one costs future
prefix reuse silently unless it is counted and said. Every outcome is counted for ``/metrics``
(``mooncake_prefill_writebacks_total``, ``mooncake_prefill_writeback_failures_total{reason}``,
``mooncake_prefill_writeback_blocks_failed_total``). Logging must not repeat per request: the
first failure of each reason is logged at WARNING with the store's message; later ones are summed
up in one WARNING line at most every ``interval_s`` (and when the stage drains).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from mooncake_lite.transfer.client import RemoteError

log = logging.getLogger(__name__)


class BlockTooLarge(ValueError):
    """A block is larger than the store's slots: the store would refuse it (never retry)."""


def failure_reason(exc: BaseException) -> str:
    """A short, bounded label for why a write-back failed."""
    if isinstance(exc, BlockTooLarge):
        return "too_large"
    if isinstance(exc, RemoteError):      # the store refused: full, bad_request, ...
        return exc.code or "refused"
    if isinstance(exc, asyncio.TimeoutError):   # before OSError: TimeoutError is one
        return "timeout"
    if isinstance(exc, (ConnectionError, OSError)):
        return "unreachable"
    return "error"


class WritebackStats:
    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.num_ok = 0                   # write-backs (one put of a request's newly full blocks)
        self.num_blocks_failed = 0
        self.failures: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._last_log: float | None = None
        self._last_error = ""

    def succeeded(self) -> None:
        self.num_ok += 1

    def failed(self, exc: BaseException, num_blocks: int) -> None:
        reason = failure_reason(exc)
        self.failures[reason] += 1
        self.num_blocks_failed += num_blocks
        now = self.clock()
        if self.failures[reason] == 1:
            log.warning("writing %d block(s) to the store failed (reason %s): %s; these blocks will not be "
                        "reused. Further failures are counted in mooncake_prefill_writeback_failures_total "
                        "and summed up here at most every %.0f s", num_blocks, reason, exc, self.interval_s)
            if self._last_log is None:
                self._last_log = now
            return
        self._unlogged[reason] += 1
        self._last_error = f"{reason}: {exc}"
        if self._last_log is None or now - self._last_log >= self.interval_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Log the failures not logged yet, if any."""
        if not self._unlogged:
            return
        now = self.clock() if now is None else now
        since = now - self._last_log if self._last_log is not None else 0.0
        log.warning("%d more store write-back(s) failed in the last %.0f s (%s); last: %s",
                    sum(self._unlogged.values()), since,
                    ", ".join(f"{r} {n}" for r, n in sorted(self._unlogged.items())), self._last_error)
        self._unlogged.clear()
        self._last_log = now

    def figures(self) -> dict[str, float]:
        return {"writebacks_total": self.num_ok, "writeback_blocks_failed_total": self.num_blocks_failed}


class WritebackFailuresCollector:
    """``mooncake_prefill_writeback_failures_total{reason}`` (a labelled counter, which the plain
    figures of :mod:`mooncake_lite.common.metrics` cannot express)."""

    def __init__(self, stats: WritebackStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("mooncake_prefill_writeback_failures",
                                     "store write-backs that failed, by reason", labels=["reason"])
        for reason, n in sorted(self.stats.failures.items()):
            family.add_metric([reason], float(n))
        yield family
