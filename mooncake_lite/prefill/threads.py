"""Borrowed threads (``--borrow-threads N``): a prefill runs on up to N more CPUs than its own
``--threads`` while the rest of the machine leaves them idle.

On one box a prefill and a decode each get a slice of the cores (``cluster/plan.py``). Prefill is
bursty and compute-bound; the decode beside it steps only while it has sequences, and is idle
between a replay's bursts. A prefill given the decode's cores for good would run beside every
decode step (and beside any other work on a shared box) with a thread that straggles, and one
slow thread holds up a whole parallel matmul. So the prefill borrows instead: before each piece
of model work it looks at how much CPU everything else on the machine used over the last tenth
of a second (``/proc/stat`` less its own CPU time) and takes an extra thread per CPU left idle.
``/proc/stat`` counts the whole machine: in a container given fewer CPUs than the host, work on
the others reads as busy, so the prefill borrows less, never more.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from mooncake_lite.common.host import cpu_ticks

WINDOW_S = 0.1          # the shortest span a decision reads (/proc/stat counts in 10 ms ticks)
IDLE_TO_BORROW = 0.75   # of a CPU idle over the window for the prefill to take a thread on it


def machine_busy_seconds(path: str = "/proc/stat") -> float | None:
    """CPU seconds every process on the machine has run (the ``cpu`` line, less idle and
    iowait), or None where there is no such file."""
    fields = cpu_ticks(path)
    if fields is None or len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")   # guest time is already in user


def extra_threads(*, num_cpus: int, own: int, borrow: int, others_busy: float) -> int:
    """Threads to add to ``own``: one per CPU the others left idle beyond ours, at most ``borrow``."""
    idle = num_cpus - own - others_busy
    return max(0, min(borrow, math.floor(idle + 1 - IDLE_TO_BORROW)))


class ThreadBorrower:
    """Picks the torch thread count before each piece of model work (call ``pick`` on the
    thread that runs it). ``busy`` reads the machine's CPU seconds, ``own`` this process's and
    ``clock`` the wall clock (all swappable for tests); ``apply`` sets the count."""

    def __init__(self, own: int, borrow: int, *, num_cpus: int | None = None,
                 busy: Callable[[], float | None] = machine_busy_seconds,
                 own_cpu: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 apply: Callable[[int], None] | None = None):
        self.own, self.borrow = own, borrow
        self.num_cpus = num_cpus or _usable_cpus()
        self._busy, self._own_cpu, self._clock = busy, own_cpu, clock
        self._apply = apply or _set_torch_threads
        self.threads = own
        self.num_borrowed = 0            # pieces of work run with extra threads (/metrics, tests)
        self._held: int | None = None
        self._last = self._sample()

    @contextlib.contextmanager
    def held(self, threads: int):
        """Run every piece of work at ``threads`` meanwhile, whatever the machine does (the
        start-up profile times both counts: ``prefill/profiling.busy_scale``)."""
        self._held = threads
        try:
            yield
        finally:
            self._held = None

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._busy()
        return None if busy is None else (self._clock(), busy, self._own_cpu())

    def pick(self) -> int:
        """The thread count for the work about to run: re-decided once a window has passed."""
        if self._held is not None:
            self._set(self._held)
            return self.threads
        now = self._clock()
        if self._last is not None and now - self._last[0] >= WINDOW_S:
            sample = self._sample()
            if sample is not None:
                elapsed = sample[0] - self._last[0]
                others = max(0.0, (sample[1] - self._last[1]) - (sample[2] - self._last[2])) / elapsed
                self._set(self.own + extra_threads(num_cpus=self.num_cpus, own=self.own, borrow=self.borrow,
                                                   others_busy=others))
            self._last = sample
        self.num_borrowed += self.threads > self.own
        return self.threads

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            self._apply(threads)
            self.threads = threads


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _set_torch_threads(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)


class BorrowingExecutor(ThreadPoolExecutor):
    """The prefill's one model thread, picking its torch thread count before each call."""

    def __init__(self, borrower: ThreadBorrower, thread_name_prefix: str = ""):
        super().__init__(max_workers=1, thread_name_prefix=thread_name_prefix)
        self.borrower = borrower

    def submit(self, fn, /, *args, **kwargs) -> Future:
        def run():
            self.borrower.pick()
            return fn(*args, **kwargs)
        return super().submit(run)
