"""How far above the central prediction requests land: the spreads (issue #36).

What the correction (``correction.py``) learns is a central prediction: half the requests meet
less, half more. Each instance also keeps the ratios measured / shown of its last
``spread_window`` requests, per metric (``ttft`` on a prefill, ``tbt`` on a decode: shown to
people), and a prefill its last waits (``wait``); ``Corrections.spread`` is their
``spread_quantile`` (the median: the bias the corrections left), shown. Admission judges the
central prediction unless ``bound_quantile`` asks for one (``Corrections.queue_bound``): the median
is the queue's bias, which the corrections already hold, so judged it counted that bias twice, plus
a window's noise. Below 1 it admitted 7 whose central prediction was over their SLO, 5 missed
(2026-12-01-zen3-admission.md §11); kept at 1 or above, 33 of the 47 refused on it alone over 22
runs would have met (§11-§14). Live on Zen 3 the 0.9 quantile had 99% of the admitted meet their
SLO (goal 95%) and refused 19% that would have met (goal 10%), the median 96.5% and 14%
(docs/results/2026-12-01-zen3.md §9-10), the central prediction 96.7% and 10.6% (§14). A wait,
not a TTFT, whose own forward (a burst's later members joining it) is no part of the queue: on
the TTFT's, admission refused 31-60% of requests that would have met their SLO in the simulator,
on the wait's 0-4% (2026-11-29-burst-window.md).
A window forgets a machine that changed; a broken report is refused.

A bound multiplies what others add to a request's TTFT by a quantile of measured / priced waits
over the prefill's last ``spread_window`` jobs (``correction.py``, ``admission.bounds``). Each wait
was priced with the corrections of its moment: the queue's scale, the speed of its node state,
the overtake and join shares. Against those prices a window of ratios holds again what the
corrections have learned since. Live on Zen 3 a run's second burst waited 1.2-1.9x its price
(its forwards slower than the start-up profile beside a busy decode, its first overtakes priced
at a share of 0); by the fourth burst the interference factor and the share held both, yet the
median of those ratios was 1.27, and at t = 45 s admission refused requests whose central
prediction met their SLOs and which the prefill's record has done in time
(docs/results/2026-12-01-zen3-admission.md §11).

So a wait is kept in the uncorrected model's seconds (:class:`KeptWait`: the work ahead before
the queue's scale, the worst cases of the two allowances) and priced again with the corrections
as they are when the spread is taken (:func:`repriced`). Where nothing moved, the price is the
one shown and the ratio the one measured then; where the model caught up with the waits, the
ratios come back to what is left unexplained. The work ahead keeps the per-forward offset of its
moment (``forward_fit.py``): an offset that moved later is not re-priced. Pure, no IO.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple


class ShownWait(NamedTuple):
    """A job's wait as the scheduler priced it (the seconds shown) and the corrections it was
    priced with: ``overtake_s`` and ``join_s`` of ``queue_s`` are the allowances at the shares
    then, ``*_full_s`` their worst cases, ``scale`` the prefill model's factor (on the instance's
    model as it is now: a refine since is converted by the caller), ``queue_scale`` the wait's
    for the work ahead, ``busy`` the node state it was priced in (None: both, weighed)."""

    queue_s: float
    own_s: float
    overtake_s: float = 0.0
    join_s: float = 0.0
    overtake_full_s: float = 0.0
    join_full_s: float = 0.0
    scale: float = 1.0
    queue_scale: float = 1.0
    busy: bool | None = None


class KeptWait(NamedTuple):
    """One measured wait and its price's parts on the uncorrected model (module doc)."""

    measured_s: float
    ahead_s: float
    overtake_full_s: float
    join_full_s: float
    busy: bool | None

    def rebased(self, factor: float) -> KeptWait:
        """The same wait once the instance's own model moved by ``factor`` (a refine)."""
        return self._replace(ahead_s=self.ahead_s * factor, overtake_full_s=self.overtake_full_s * factor,
                             join_full_s=self.join_full_s * factor)


def kept(shown: ShownWait, measured_s: float) -> KeptWait | None:
    """``measured_s`` with ``shown``'s price taken apart (None: a scale that is no positive number)."""
    if not (shown.scale > 0.0 and shown.queue_scale > 0.0):
        return None
    ahead = max(shown.queue_s - shown.overtake_s - shown.join_s, 0.0) / (shown.scale * shown.queue_scale)
    return KeptWait(measured_s, ahead, shown.overtake_full_s / shown.scale, shown.join_full_s / shown.scale,
                    shown.busy)


def repriced(waits: Iterable[KeptWait], scale: Callable[[bool | None], float], queue_scale: float,
             overtake_share: float, join_share: float) -> list[float]:
    """Each wait's measured / its price with the corrections as they are: ``scale`` of its node
    state, the ``queue_scale`` on the work ahead, the shares of the allowances' worst cases. A wait
    priced at nothing is left out."""
    scales: dict[bool | None, float] = {}
    ratios = []
    for w in waits:
        s = scales.get(w.busy)
        if s is None:
            s = scales[w.busy] = scale(w.busy)
        price = s * (w.ahead_s * queue_scale + overtake_share * w.overtake_full_s + join_share * w.join_full_s)
        if price > 0.0:
            ratios.append(w.measured_s / price)
    return ratios


def quantile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
