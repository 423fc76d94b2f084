"""Prefill instance selection per strategy; ``kvcache-centric`` is Algorithm 1 lines 1–16
(REFERENCE.md §2): the smallest predicted TTFT over all instances, each costed either with its
local prefix or with the best global prefix fetched to it."""

from __future__ import annotations

import random
from collections.abc import Hashable
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

from mooncake_lite.scheduler.block_index import PrefixMatch
import numpy as np

from mooncake_lite.scheduler.cache import FROM_SCRATCH, Estimates
from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.scheduler.costs import CostModels, kv_transfer_time
from mooncake_lite.scheduler.decision import Route
from mooncake_lite.scheduler.estimate import Backlog, Queues, prefill_model, queues_at
from mooncake_lite.scheduler.packing import joins_tail, own_seconds
from mooncake_lite.scheduler.queue_order import overtake_allowance, priced
from mooncake_lite.scheduler.state import PrefillInstanceState, ScheduleRequest
from mooncake_lite.scheduler.wide import PrefillTable, choose_prefill_row


_new = tuple.__new__   # a NamedTuple without its constructor's Python frame (estimate.py)


class PrefillChoice(NamedTuple):
    """One costed option: run the prefill on ``instance`` reusing ``reused_blocks`` blocks, of
    which ``local_blocks`` are already in its store and the rest come from ``source_store_id``."""

    instance: PrefillInstanceState
    ttft_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    reused_blocks: int
    local_blocks: int
    source_store_id: Hashable | None
    route: Route


def _transfer_s(p: PrefillInstanceState, num_blocks: int, source: Hashable, cfg: SchedulerConfig,
                costs: CostModels) -> float:
    nbytes = num_blocks * cfg.block_size * costs.kv_bytes_per_token
    measured = costs.links.bandwidth(source, p.store_id) if costs.links is not None else None
    bandwidth = measured or p.bandwidth_bytes_per_s or costs.bandwidth_bytes_per_s
    return kv_transfer_time(nbytes, bandwidth, costs.transfer_latency_s)


def _option(req: ScheduleRequest, p: PrefillInstanceState, queue_s: float, local: int,
            match: PrefixMatch, fetch: bool, cfg: SchedulerConfig, costs: CostModels,
            route: Route | None = None, backlog: Backlog | None = None) -> PrefillChoice:
    """Cost one instance: with its local prefix, or (``fetch``) with blocks [local, best_len)
    copied from the best holder first. ``backlog`` (its queue's, when the instance packs)
    prices the request packed with what is queued (:func:`_packed`)."""
    model = prefill_model(p, costs)
    if fetch and match.best_len > local:
        transfer_s = _transfer_s(p, match.best_len - local, match.best_store_id, cfg, costs)
        prefix = match.best_len * cfg.block_size
        queue_s, prefill_s = _packed(req, model, queue_s, prefix, backlog, p)
        return _new(PrefillChoice, (p, transfer_s + queue_s + prefill_s, queue_s, prefill_s, transfer_s,
                                    match.best_len, local, match.best_store_id, route or "transfer"))
    queue_s, prefill_s = _packed(req, model, queue_s, local * cfg.block_size, backlog, p)
    route = route or ("local-hit" if local else "balance")
    return _new(PrefillChoice, (p, queue_s + prefill_s, queue_s, prefill_s, 0.0, local, local, None, route))


def _packed(req: ScheduleRequest, model, queue_s: float, prefix_tokens: int,
            backlog: Backlog | None, p: PrefillInstanceState | None = None) -> tuple[float, float]:
    """(queue, execution) of the request queued last: on an instance that packs, when it joins
    the last waiting pack its queue is the forwards before that pack and its execution that
    pack's forward with its own token terms added (scheduler/packing.py); else the whole
    queue, then its own prefill. On an instance serving shortest first (``p.overtakes``) it
    lands where scheduler/queue_order.py puts it: the forwards before its own, plus the most
    the later arrivals allowed to pass it may add."""
    if p is not None and p.overtakes > 0 and backlog is not None:
        done = (backlog.cumulative_s[-1] if backlog.cumulative_s else 0.0) - queue_s
        start, own = priced(backlog.queue, model, backlog.pack_tokens, p.overtakes, req.num_tokens, prefix_tokens)
        wait = start - done if start > done else 0.0
        return wait + overtake_allowance(model, p.overtakes, req.num_tokens, prefix_tokens), own
    if backlog is not None and backlog.pack_tokens > 0:
        n = req.num_tokens - min(prefix_tokens, req.num_tokens - 1)
        if joins_tail(backlog.tail_tokens, n, backlog.pack_tokens):
            ahead = queue_s - backlog.tail_s
            return ahead if ahead > 0.0 else 0.0, backlog.tail_s + own_seconds(model, req.num_tokens,
                                                                             prefix_tokens, True)
    return queue_s, model.predict(req.num_tokens, prefix_tokens)


def choose_prefill(req: ScheduleRequest, prefills: tuple[PrefillInstanceState, ...],
                   match: PrefixMatch, cfg: SchedulerConfig, costs: CostModels, now: float,
                   rng: random.Random | None, queues: Queues | None = None,
                   cache: Estimates | None = None,
                   wide: tuple[PrefillTable, np.ndarray] | None = None) -> PrefillChoice | None:
    """The prefill option the configured strategy picks (None when there is no instance).
    Ties go to the earlier instance in ``prefills``, so results are deterministic. ``queues``
    (the backlogs of ``prefills`` at ``now``) saves recomputing them; ``cache`` (None: from
    scratch) keeps each queue's predicted work between decisions. ``wide`` (the estimate cache's
    table of ``prefills`` and their queue times as an array) picks by the table's rows instead
    of the loop (scheduler/wide.py: the same choice)."""
    if not prefills:
        return None
    if wide is not None and cfg.strategy == "kvcache-centric" and not wide[0].packing:
        hit = choose_prefill_row(req, wide[0], wide[1], match, cfg, costs)
        if hit is not None:     # the row's queue time is the array's double, as in the list below
            i, local, fetch = hit
            return _option(req, prefills[i], float(wide[1][i]), local, match, fetch, cfg, costs)
    if queues is None:
        queues = queues_at((cache or FROM_SCRATCH).backlogs(prefills, costs), now)
    queue_times = queues.queue_s
    packing = any(map(_PACK_TOKENS, queues.backlogs)) or any(map(_OVERTAKES, prefills))
    if cfg.strategy == "random":
        if rng is None:
            raise ValueError("strategy 'random' needs a seeded random.Random passed as rng")
        i = rng.randrange(len(prefills))
        return _option(req, prefills[i], queue_times[i], match.length_at(prefills[i].store_id),
                       match, False, cfg, costs, route="random", backlog=queues.backlogs[i])
    if cfg.strategy != "kvcache-centric":
        return _choose_without_transfer(req, prefills, match, cfg, costs, queue_times,
                                        queues.backlogs if packing else None)
    return _choose_kvcache(req, prefills, queue_times, queues.backlogs if packing else None, match, cfg, costs)


def _choose_kvcache(req: ScheduleRequest, prefills: tuple[PrefillInstanceState, ...], queue_times: list[float],
                    backlogs: list[Backlog] | None, match: PrefixMatch, cfg: SchedulerConfig,
                    costs: CostModels) -> PrefillChoice | None:
    """Algorithm 1's loop: each instance keyed by its queue, the transfer of the best prefix (if
    it fetches) and its own execution. ``backlogs`` (when an instance packs): its own execution
    priced packed with its queue (less ``c0`` when the request joins its last waiting pack; the
    queue time plus that is the same sum as :func:`_packed`)."""
    lengths, best_len, block_size = match.lengths, match.best_len, cfg.block_size
    threshold, num_tokens = cfg.kvcache_balancing_threshold, req.num_tokens
    block_bytes = block_size * costs.kv_bytes_per_token
    latency_s, default_bandwidth = costs.transfer_latency_s, costs.bandwidth_bytes_per_s
    best, best_key, default_model = None, float("inf"), costs.prefill
    measured = costs.links.from_source(match.best_store_id) if costs.links is not None else {}
    # This loop runs per instance per request: one cost-model call each, the transfer time
    # (_transfer_s) and the packed pricing (joins_tail, own_seconds) written out.
    for p, queue_s, backlog in zip(prefills, queue_times, backlogs or repeat(None)):
        local = lengths.get(p.store_id, 0)
        model = p.cost or default_model
        # Algorithm 1's branch, negated: ``best_len / prefix_len < threshold`` keeps the local
        # prefix; no local prefix at all makes the ratio infinite (fetch, if anything is cached).
        if local < best_len and (not local or best_len / local >= threshold):
            bandwidth = measured.get(p.store_id) or p.bandwidth_bytes_per_s or default_bandwidth
            transfer_s = latency_s + (best_len - local) * block_bytes / bandwidth
            key = transfer_s + queue_s
            prefix, fetch = best_len * block_size, True
        else:
            transfer_s, key, prefix, fetch = 0.0, queue_s, local * block_size, False
        own = model.predict(num_tokens, prefix)
        if backlog is not None and p.overtakes:      # shortest first: where it lands (_packed)
            wait, own = _packed(req, model, queue_s, prefix, backlog, p)
            key = transfer_s + wait if fetch else wait    # the sum _option reports as its TTFT
        elif backlog is not None:
            tail = backlog.tail_tokens
            if tail >= 0 and tail + num_tokens - (prefix if prefix < num_tokens else num_tokens - 1) <= backlog.pack_tokens:
                own = own - model.c0 if own > model.c0 else 0.0
        key += own
        if key < best_key:
            best, best_key = (p, queue_s, local, fetch, backlog), key
    if best is None:
        return None
    p, queue_s, local, fetch, backlog = best
    return _option(req, p, queue_s, local, match, fetch, cfg, costs, backlog=backlog)


def _choose_without_transfer(req: ScheduleRequest, prefills: tuple[PrefillInstanceState, ...],
                             match: PrefixMatch, cfg: SchedulerConfig, costs: CostModels,
                             queue_times: list[float], backlogs: list[Backlog] | None = None
                             ) -> PrefillChoice | None:
    """``load-balance`` (cache-blind: queue + full recompute; the engine still reuses what it
    has) and ``cache-aware`` (queue + execution given the local prefix). ``backlogs`` (when an
    instance packs) price the request packed with each queue."""
    lengths, num_tokens = match.lengths, req.num_tokens
    cached_tokens = 0 if cfg.strategy == "load-balance" else cfg.block_size
    best, best_key = None, float("inf")
    for i, (p, queue_s) in enumerate(zip(prefills, queue_times)):
        local = lengths.get(p.store_id, 0)
        if backlogs is None:
            key = queue_s + (p.cost or costs.prefill).predict(num_tokens, local * cached_tokens)
        else:
            key = sum(_packed(req, p.cost or costs.prefill, queue_s, local * cached_tokens, backlogs[i], p))
        if key < best_key:
            best, best_key = (p, queue_s, local, i), key
    if best is None:
        return None
    p, queue_s, local, i = best
    route: Route | None = "balance" if cfg.strategy == "load-balance" else None
    return _option(req, p, queue_s, local, match, False, cfg, costs, route=route,
                   backlog=None if backlogs is None else backlogs[i])


_PACK_TOKENS = attrgetter("pack_tokens")
_OVERTAKES = attrgetter("overtakes")
