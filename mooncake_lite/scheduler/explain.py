"""What a refused request's predicted wait was made of, for its log line (issue #36).

A refusal's log says its predicted TTFT and the bound over its SLO; why the wait was that long
is in the prefill's backlog at that moment, gone a second later. A refusal that the instance's
own record shows would have met (``bench fidelity``) is only explained by the parts: the started
job's rest (priced to its own end: the instance's report of its chunks, or its price when it
started at once; else from the model), the jobs it lands
behind (shortest first: not the whole queue), the queue's learned scale, the allowance for later
arrivals passing it, and the spread the bound multiplies the wait by. :func:`wait_parts` derives
them again from the same state, by the rules the decision priced with (``prefill_select._packed``,
``estimate.queues_at``, ``queue_order.priced``); a test holds it to the decision's figure. Read
only after a refusal, never on the decision's path. Pure.
"""

from __future__ import annotations

from typing import NamedTuple

from mooncake_lite.scheduler.costs import CostModels, uncached_tokens
from mooncake_lite.scheduler.estimate import backlog_of, prefill_model, queues_at
from mooncake_lite.scheduler.queue_order import join_allowance, overtake_allowance, priced, queue_landing
from mooncake_lite.scheduler.state import PrefillInstanceState


class WaitParts(NamedTuple):
    """A new job's predicted wait on one prefill, in the seconds shown (module doc)."""

    head_left_s: float      # what is left of the started jobs
    head_reported: bool     # priced to its own end (its chunks' report, or its price as it started), not the model
    ahead_jobs: int         # queued jobs it lands behind
    ahead_s: float          # their forwards, before the queue scale
    queue_scale: float
    allowance_s: float      # later arrivals predicted to pass it or join its forward (their shares)
    overtake_share: float
    spread: float

    @property
    def wait_s(self) -> float:
        return (self.head_left_s + self.ahead_s) * self.queue_scale + self.allowance_s

    def describe(self) -> str:
        head = f"{self.head_left_s:.3g}s left of the running job ({'own end' if self.head_reported else 'model'})"
        return (f"waits {self.wait_s:.3g}s = ({head} + {self.ahead_jobs} job(s) ahead {self.ahead_s:.3g}s) x queue "
                f"scale {self.queue_scale:.3g} + {self.allowance_s:.3g}s for later arrivals (overtake "
                f"share {self.overtake_share:.3g}); spread {self.spread:.3g}")


def wait_parts(p: PrefillInstanceState, costs: CostModels, num_tokens: int, prefix_tokens: int,
               now: float) -> WaitParts:
    """The parts of the wait a job of ``num_tokens`` (``prefix_tokens`` reused) is priced at on
    ``p`` at ``now``, on an instance serving shortest first or in order (one job a forward; a
    packing instance's packs are priced whole, as ``queue_order.priced`` cuts them)."""
    model = prefill_model(p, costs)
    backlog = backlog_of(p, model)
    at_now = queues_at([backlog], now)
    started = len(backlog.started)
    head_total = backlog.cumulative_s[started - 1] if started else 0.0
    head_left = max(head_total - at_now.done_s[0], 0.0)
    reported = bool(started) and p.queue[0].reported_s() is not None
    bound = p.overtakes
    if bound > 0:
        start, _ = priced(backlog.queue, model, backlog.pack_tokens, bound, num_tokens, prefix_tokens,
                          head_total if started else None)
        ahead_s = max(start - head_total, 0.0)
        landing = queue_landing(p.queue, uncached_tokens(num_tokens, prefix_tokens), bound)
        waits = (head_left + ahead_s) > 0.0
        allowance = overtake_allowance(model, bound, num_tokens, prefix_tokens, p.overtake_share,
                                       p.recent_uncached) if waits else 0.0
        if p.join_share:
            allowance += join_allowance(model, backlog.pack_tokens, num_tokens, prefix_tokens, p.join_share)
    else:
        ahead_s, landing, allowance = max((backlog.cumulative_s[-1] if backlog.cumulative_s else 0.0)
                                          - head_total, 0.0), len(p.queue), 0.0
    return WaitParts(head_left, reported, max(landing - started, 0), ahead_s, backlog.queue_scale, allowance,
                     p.overtake_share if bound > 0 else 0.0, p.queue_spread)
