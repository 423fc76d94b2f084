"""A burst decided together: requests that arrive within a short window are placed in the order
a shortest-first queue serves them, so each one's prediction already knows the rest of its burst
(issue #36). One rule for the live conductor (``conductor/flight/arrivals.py``) and the simulator
(``sim/cluster.py``). Pure, no IO, no clock.

Why: a prediction made at arrival cannot know later arrivals, and on a shortest-first queue
(``queue_order``) the later, shorter members of a burst pass the earlier ones. Ten requests sent
at one instant (an agent fanning out, a trace whose timestamps are rounded) then leave the
simulator, whose forwards take exactly the model's time, with a median TTFT prediction error
of 16% on the queue order alone (docs/results/2026-11-29-burst-window.md). Decided shortest
first, no member of the burst passes one decided before it: their order is known when each is
priced.

When: only where holding costs the request nothing it would not wait anyway, i.e. every prefill
instance has a job (a request that reaches an idle instance starts at once, and nobody can
pass it), and only where the order can change (some instance serves shortest first; FIFO serves
the arrival order, which is priced exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from mooncake_lite.scheduler.block_index import BlockIndex
from mooncake_lite.scheduler.costs import PrefillCostModel, uncached_tokens
from mooncake_lite.scheduler.packing import packed_queue
from mooncake_lite.scheduler.state import ClusterState, QueuedPrefill, ScheduleRequest

# The live conductor's window (--burst-window): long enough for a burst sent at one instant to
# reach it (the replay's ten requests arrive within 10 ms), short beside a CPU prefill's seconds.
DEFAULT_WINDOW_S = 0.02


def holds(cluster: ClusterState, window_s: float) -> bool:
    """Whether a request arriving now waits up to ``window_s`` for the rest of its burst."""
    prefills = cluster.prefills
    return (window_s > 0 and bool(prefills) and all(p.queue for p in prefills)
            and any(p.overtakes > 0 for p in prefills))


def uncached_now(index: BlockIndex, req: ScheduleRequest, block_size: int) -> int:
    """The tokens ``req`` would compute on the store with its longest cached prefix: the key its
    queue orders it by (``queue_order.job_uncached``), before an instance is chosen."""
    return uncached_tokens(req.num_tokens, index.match(req.block_keys).best_len * block_size)


def decision_order(uncached: Sequence[int]) -> list[int]:
    """The positions of a burst's requests (in arrival order) in the order they are decided:
    fewest uncached tokens first, ties in arrival order (the queue's own tie rule)."""
    return sorted(range(len(uncached)), key=uncached.__getitem__)


def burst_shifts(placed: Sequence[tuple[str, str]],
                 queue: Callable[[str], tuple[Sequence[QueuedPrefill], int, PrefillCostModel]]) -> dict[str, float]:
    """What each member of a burst just placed adds to its predicted TTFT now that the whole burst
    is: ``placed`` holds (request id, prefill id) in decision order; ``queue(prefill id)`` that
    instance's queue now, its packing budget and the model its view shows. A member decided early
    was priced with its pack as the queue stood (the queue now without the members decided after
    it); the later members that joined its pack (``packing.joins_tail``) or re-cut it move its
    end, by the model. Live, a pack of five of a burst's members was predicted 0.17–0.86 s and all
    five had their first token at 1.22 s (docs/results/2026-11-30-zen5.md). {} without packing;
    a member whose pack stands, or that is not waiting, is left out."""
    by_prefill: dict[str, list[str]] = {}
    for rid, pid in placed:
        by_prefill.setdefault(pid, []).append(rid)
    out: dict[str, float] = {}
    for pid, members in by_prefill.items():
        jobs, limit, model = queue(pid)
        if len(members) < 2 or limit <= 0:
            continue
        now, later = _pack_ends(jobs, limit, model), set(members)
        for rid in members:
            later.discard(rid)
            if rid in now and later:
                shift = now[rid] - _pack_ends([j for j in jobs if j.request_id not in later], limit, model)[rid]
                if shift:
                    out[rid] = shift
    return out


def _pack_ends(jobs: Sequence[QueuedPrefill], limit: int, model: PrefillCostModel) -> dict[str, float]:
    """Each waiting job's pack's end, from the running forward's start (``packed_queue``: the
    first job of a pack carries its time, so the running sum at a job is its pack's end)."""
    ends = accumulate(packed_queue(jobs, model, limit).durations_s)
    return {job.request_id: end for job, end in zip(jobs, ends) if job.started_at is None}
