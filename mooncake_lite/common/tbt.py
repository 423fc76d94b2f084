"""TBT as the Mooncake paper (FAST'25) defines it: per request, the mean of the slowest 10% of
its token gaps (docs/paper.md §7).

One definition for every place that computes it — the live conductor's histogram, the replay
client's report and the simulator — so a simulated TBT and a live one average the same gaps:
with 31 gaps, the slowest 3 everywhere (the simulator used to take 4).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def slowest_count(num_gaps: int) -> int:
    """How many of a request's ``num_gaps`` gaps its TBT averages: a tenth, at least one."""
    return max(1, num_gaps // 10)


def paper_tbt(gaps: Sequence[float]) -> float | None:
    """The mean of the slowest 10% of ``gaps`` (at least one); None without gaps."""
    if not gaps:
        return None
    k = slowest_count(len(gaps))
    return sum(sorted(gaps)[-k:]) / k


def paper_tbt_of_runs(runs: Iterable[tuple[float, int]], num_gaps: int) -> float | None:
    """:func:`paper_tbt` of gaps given as ``(gap, count)`` runs (the simulator's folded step
    log), ``num_gaps`` of them in all."""
    if num_gaps == 0:
        return None
    want = left = slowest_count(num_gaps)
    acc = 0.0
    for gap, count in sorted(runs, reverse=True):
        take = min(count, left)
        acc += gap * take
        left -= take
        if left == 0:
            break
    return acc / want
