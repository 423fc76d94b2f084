"""A prefill's forward in each node state as it is really served: ``scale · (x + offset)`` (issue #36).

One factor corrected a prefill's speed, and it could not be right for a short forward and a long
one at once. Replaying six live trace runs (Zen 5, docs/results/2026-11-30-zen5.md §16), a request
priced under 0.15 s took 1.6-1.9x it and over 1.2 s 0.76-0.88x, in every run: a served forward
pays per-forward costs the profile never timed (its KV frames and executor hops, the intake beside
it), and a long one borrows an idle neighbour's CPU (beside a busy decode, one that outlasts the
decode's work). So each state's correction is a line, ``measured = scale · (x + offset)`` (``x``:
the request's forwards' seconds on the instance's own model, a long prompt's chunks summed),
fitted to its last ``window`` requests by least squares in relative error (a 0.1 s forward counts
as much as a 2 s one) with ``offset >= 0``. Shown as a model it is the same formula with ``c0``
raised by ``offset`` and every coefficient multiplied by ``scale`` (``costs.scaled``), so
every rule that prices with the model follows unchanged; a chunked prompt pays the offset once,
as it was fitted, not once a chunk (``PrefillCostModel.later_c0``). Paid once a chunk, a busy
line of 0.24 · (x + 2.2 s) priced a queued 8-chunk prompt 4 s too long, the queue 1.5x (§16).

The fit is used only once it can tell the two apart: ``min_pairs`` requests whose forwards span at
least ``MIN_SPREAD``x; before that the factor moves toward each request's own ratio on the
current line, after it toward the fitted scale, by the moving average every factor moves by
(``correction.step``: bounded by ``max_step`` in log). The offset moves by ``alpha`` × the window's
median forward at most, and its fixed part (``scale · offset``) stays within the window's fastest
forward measured: a fixed cost longer than a whole forward is no fixed cost.
Pure: no IO, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

MIN_SPREAD = 3.0     # the longest forward of the window over the shortest, for the fit to be used


@dataclass(frozen=True)
class ForwardLine:
    """A state's offset (seconds on the instance's own model, added to each forward) and the
    ``(x, measured)`` pairs it and the scale were fitted to, oldest first."""

    offset: float = 0.0
    pairs: tuple[tuple[float, float], ...] = ()

    def rebased(self, factor: float) -> "ForwardLine":
        """The instance's own model moved by ``factor`` by itself: its seconds, and so the pairs'
        ``x`` and the offset, are that many times what they were."""
        return ForwardLine(self.offset * factor, tuple((x * factor, y) for x, y in self.pairs))


def fit_line(pairs: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """``(scale, offset)`` of ``measured ≈ scale · (x + offset)`` over ``pairs``, least squares in
    relative error, ``offset >= 0``; None where the forwards do not span ``MIN_SPREAD``x or the fit
    is degenerate."""
    xs = [x for x, _ in pairs]
    if not pairs or min(xs) <= 0 or max(xs) < MIN_SPREAD * min(xs):
        return None
    # minimise sum((fixed + scale·x)/y - 1)^2 over (fixed, scale): u = 1/y, v = x/y
    suu = sum(1 / (y * y) for _, y in pairs)
    suv = sum(x / (y * y) for x, y in pairs)
    svv = sum(x * x / (y * y) for x, y in pairs)
    su, sv = sum(1 / y for _, y in pairs), sum(x / y for x, y in pairs)
    det = suu * svv - suv * suv
    fixed, scale = ((svv * su - suv * sv) / det, (suu * sv - suv * su) / det) if det > 1e-12 * suu * svv \
        else (-1.0, 0.0)
    if fixed < 0:             # no fixed cost: the scale alone
        fixed, scale = 0.0, sv / svv
    if not (math.isfinite(scale) and scale > 0 and math.isfinite(fixed)):
        return None
    return scale, fixed / scale


def moved_line(line: ForwardLine, x: float, y: float, window: int, min_pairs: int,
               alpha: float) -> tuple[ForwardLine, float | None]:
    """``line`` with the pair ``(x, y)`` added and its offset moved toward the fit's, by at most
    ``alpha`` × the window's median ``x``; and the scale that best fits the pairs at that offset,
    which the caller moves its factor toward (None: too few pairs, or too little spread, to fit:
    the caller moves it toward ``y / (x + offset)``)."""
    pairs = (*line.pairs[1 - window:], (x, y)) if window > 1 else ((x, y),)
    fitted = fit_line(pairs) if len(pairs) >= min_pairs else None
    if fitted is None:
        return ForwardLine(line.offset, pairs), None
    bound = alpha * median(p for p, _ in pairs)
    offset = capped(pairs, line.offset + min(bound, max(-bound, fitted[1] - line.offset)))
    return ForwardLine(offset, pairs), scale_at(pairs, offset)   # the best scale for the offset as moved


def capped(pairs: Sequence[tuple[float, float]], offset: float) -> float:
    """The largest offset up to ``offset`` whose fixed part, ``scale_at(offset) · offset``, is
    within the fastest forward measured (bisection: the fixed part grows with the offset)."""
    fastest = min(y for _, y in pairs)
    if offset * scale_at(pairs, offset) <= fastest:
        return offset
    lo, hi = 0.0, offset
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * scale_at(pairs, mid) <= fastest else (lo, mid)
    return lo


def scale_at(pairs: Sequence[tuple[float, float]], offset: float) -> float:
    """The scale of ``measured ≈ scale · (x + offset)`` with ``offset`` given, least squares in
    relative error."""
    return sum((x + offset) / y for x, y in pairs) / sum(((x + offset) / y) ** 2 for x, y in pairs)
