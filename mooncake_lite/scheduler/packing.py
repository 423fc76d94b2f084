"""Prefill batching as the scheduler prices it: a prefill instance's FIFO queue run packed.

A prefill instance with a packing budget (``--prefill-batch-tokens``, capped at its chunk: the
``pack_tokens`` it registers) serves the head of its queue together with the jobs queued behind
it while their uncached tokens fit in the budget (:func:`~mooncake_lite.scheduler.costs.pack_sizes`,
the rule ``prefill/packs.py`` forms its packs with), in one forward that pays the cost model's
fixed ``c0`` once (:func:`~mooncake_lite.scheduler.costs.packed_seconds`). Here the same rule
gives the conductor's queue estimate:

* the jobs shown started are the forward running now (whoever drives the queue — the conductor's
  membership, the simulator — starts a pack's members together); the jobs behind them are cut into
  packs by ``pack_sizes``;
* a pack's time is carried by its *first* job and its other jobs carry 0, so the running sums of
  the durations are each job's finish time (the end of its pack), and a started pack counts as
  done for its elapsed time exactly as one started job does;
* a new request queued last joins the last pack that has not started when its uncached tokens
  still fit (:func:`joins_tail`): it waits for the forwards before that pack, and its own forward
  is that pack's with its token terms added (``predict − c0``).

``pack_tokens`` 0 (an instance that does not pack, or registered before the field existed) gives
each job its own ``predict``: exactly the one-at-a-time estimate. Pure, no IO.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import reduce
from typing import NamedTuple

from mooncake_lite.scheduler.costs import (PrefillCostModel, capped, iter_pack_sizes, pack_sizes, packed_seconds,
                                           uncached_tokens)
from mooncake_lite.scheduler.state import QueuedPrefill

NO_TAIL = -1     # no pack a new request could join (nothing waiting, or packing off)


class PackedQueue(NamedTuple):
    """A queue priced packed: each job's share of the work (first of a pack carries it), and the
    last not-started pack's uncached tokens as ``pack_sizes`` counts them (``limit + 1`` for an
    oversize job that takes nobody along; :data:`NO_TAIL` when there is none), its seconds and
    its bound (``limit`` lowered by its members' caps: what a new job may join it up to)."""

    durations_s: list[float]
    tail_tokens: int
    tail_s: float
    tail_bound: int = 0


def num_started(queue: Sequence[QueuedPrefill]) -> int:
    """How many of ``queue``'s leading jobs (execution order) have started."""
    running = 0
    while running < len(queue) and queue[running].started_at is not None:
        running += 1
    return running


def packed_queue(queue: Sequence[QueuedPrefill], model: PrefillCostModel, limit: int) -> PackedQueue:
    """``queue`` (execution order, started jobs first) priced as an instance packing up to
    ``limit`` uncached tokens a forward runs it (module doc)."""
    predict = model.predict
    own = [predict(job.num_tokens, job.num_prefix_tokens) for job in queue]
    if limit <= 0:
        return PackedQueue(own, NO_TAIL, 0.0)
    running = num_started(queue)
    out: list[float] = []
    if running:
        out.append(packed_seconds(own[:running], model.shared_c0))
        out.extend([0.0] * (running - 1))
    tail_tokens, tail_s, i, last = NO_TAIL, 0.0, running, running
    waiting = [uncached_tokens(job.num_tokens, job.num_prefix_tokens) for job in queue[running:]]
    caps = queue_caps(queue[running:])
    for size in pack_sizes(waiting, limit, caps):
        last = i
        tail_s = packed_seconds(own[i:i + size], model.shared_c0)
        out.append(tail_s)
        out.extend([0.0] * (size - 1))
        tokens = sum(waiting[i - running:i - running + size])
        tail_tokens = tokens if tokens <= limit else limit + 1
        i += size
    bound = limit if caps is None else pack_bound(caps[last - running:], limit)
    return PackedQueue(out, tail_tokens, tail_s, bound)


def queue_caps(jobs: Sequence[QueuedPrefill]) -> list[int] | None:
    """The jobs' pack caps for ``pack_sizes``; None when none has one (the plain rule, cheaper)."""
    caps = [job.pack_cap for job in jobs]
    return caps if any(caps) else None


def pack_bound(caps: Sequence[int], limit: int) -> int:
    """The most uncached tokens a pack of jobs with these caps may hold (``costs.pack_sizes``)."""
    return reduce(capped, caps, limit)


def joins_tail(tail_tokens: int, new_uncached: int, bound: int) -> bool:
    """Whether a request with ``new_uncached`` tokens to compute, queued last, is taken along by
    the last pack still waiting (``pack_sizes``: it fits beside that pack's tokens, within the
    pack's ``bound``, ``PackedQueue.tail_bound``)."""
    return tail_tokens >= 0 and tail_tokens + new_uncached <= bound


def slo_pack_cap(model: PrefillCostModel, limit: int, forward_budget_s: float, num_tokens: int,
                 prefix_tokens: int) -> int:
    """The cap a request's decision sets on the packed forwards it may be in (``pack_sizes``):
    the most uncached tokens for which its forward still ends within ``forward_budget_s`` (its
    TTFT limit less what its decision puts before that forward). The others' tokens are priced as
    one prompt of that many tokens with no prefix (``predict(x) - c0``), at least what prompts
    summing to x cost alone; a member's long cached prefix adds what this leaves out. 0 (no cap)
    when the budget holds a full forward of ``limit``; its own tokens when it holds nobody more."""
    own = uncached_tokens(num_tokens, prefix_tokens)
    if limit <= 0 or own >= limit:
        return 0
    rest = forward_budget_s - model.predict(num_tokens, prefix_tokens)
    if not rest < math.inf:
        return 0          # no TTFT SLO (infinite): no cap
    if rest <= 0.0:
        return own
    c1, c2 = model.c1, model.c2
    if c2 > 0.0:
        x = (math.sqrt(c1 * c1 + 4.0 * c2 * rest) - c1) / (2.0 * c2)
    elif c1 > 0.0:
        x = rest / c1
    else:
        return 0          # tokens cost nothing: no forward is too long
    cap = own + int(x)
    return 0 if cap >= limit else cap


def own_seconds(model: PrefillCostModel, num_tokens: int, num_prefix_tokens: int, joins: bool) -> float:
    """The new request's own share of the work: ``predict``, less the fixed cost its pack pays
    anyway when it joins one (``shared_c0``)."""
    t = model.predict(num_tokens, num_prefix_tokens)
    if joins:
        t = t - model.shared_c0
        return t if t > 0.0 else 0.0
    return t


def first_pack(uncached: Iterable[int], limit: int, caps: Iterable[int] | None = None) -> int:
    """How many jobs from the head of a queue with these uncached token counts (and pack caps)
    the head's forward takes: ``pack_sizes(uncached, limit, caps)[0]`` (0 for no jobs), reading
    no further than the first job left out."""
    return next(iter_pack_sizes(uncached, limit, caps), 0)


def forward_seconds(model: PrefillCostModel, num_tokens: int, prefix_tokens: int, forward_tokens: float,
                    forward_jobs: float) -> float:
    """The forward a job of ``num_tokens`` (``prefix_tokens`` cached) really ran in, as ``model``
    prices it: the prefill reports the forward's computed tokens and jobs (``timings``), the
    others taken as equal shares of the rest with no prefix. The job alone when it ran alone."""
    own = model.predict(num_tokens, prefix_tokens)
    others = int(forward_jobs) - 1
    rest = forward_tokens - uncached_tokens(num_tokens, prefix_tokens)
    if others < 1 or rest < others:
        return own
    return packed_seconds([own, *[model.predict(round(rest / others))] * others], model.shared_c0)
