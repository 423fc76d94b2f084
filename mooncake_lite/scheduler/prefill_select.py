"""Prefill instance selection per strategy; ``kvcache-centric`` is Algorithm 1 lines 1–16
(docs/paper.md §2): the smallest predicted TTFT over all instances, each costed either with its
local prefix or with the best global prefix fetched to it."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

from mooncake_lite.scheduler import rules
from mooncake_lite.scheduler.block_index import PrefixMatch
from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.scheduler.costs import CostModels, PrefillCostModel, kv_transfer_time, transfer_seconds
from mooncake_lite.scheduler.decision import Route
from mooncake_lite.scheduler.estimate import Backlog, Queues, prefill_model
from mooncake_lite.scheduler.packing import joins_tail, own_seconds
from mooncake_lite.scheduler.queue_order import join_allowance, overtake_allowance, priced
from mooncake_lite.scheduler.state import PrefillInstanceState, ScheduleRequest


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
    nbytes = num_blocks * (cfg.block_size * costs.kv_bytes_per_token)   # a block's bytes, as the loops take them
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
        queue_s, prefill_s = _packed(req, model, queue_s, match.best_len * cfg.block_size, backlog, p)
        return _choice(p, rules.prefill_cost_key(transfer_s, queue_s, prefill_s), transfer_s, queue_s, prefill_s,
                       local, match, True, route)
    queue_s, prefill_s = _packed(req, model, queue_s, local * cfg.block_size, backlog, p)
    return _choice(p, rules.prefill_cost_key(0.0, queue_s, prefill_s), 0.0, queue_s, prefill_s, local, match, False,
                   route)


def _choice(p: PrefillInstanceState, key: float, transfer_s: float, queue_s: float, prefill_s: float, local: int,
            match: PrefixMatch, fetch: bool, route: Route | None) -> PrefillChoice:
    """The option of ``p`` keyed ``key`` from its estimates, fetching blocks [local, best_len) or not."""
    if fetch:
        return _new(PrefillChoice, (p, key, queue_s, prefill_s, transfer_s, match.best_len, local,
                                    match.best_store_id, route or "transfer"))
    return _new(PrefillChoice, (p, key, queue_s, prefill_s, transfer_s, local, local, None,
                                route or ("local-hit" if local else "balance")))


def _packed(req: ScheduleRequest, model, queue_s: float, prefix_tokens: int,
            backlog: Backlog | None, p: PrefillInstanceState | None = None) -> tuple[float, float]:
    """(queue, execution) of the request queued last: on an instance that packs, when it joins
    the last waiting pack its queue is the forwards before that pack and its execution that
    pack's forward with its own token terms added (scheduler/packing.py); else the whole
    queue, then its own prefill. On an instance serving shortest first (``p.overtakes``) it
    lands where scheduler/queue_order.py puts it: the forwards before its own, plus what the
    later arrivals allowed to pass it (if it waits at all), or joining its forward, are predicted
    to add (the instance's learned shares of the most). ``queue_s`` is the backlog's work left ×
    its ``queue_scale`` (estimate.queues_at): the forwards ahead are waited for that many times
    their price, the allowances and its own forward are priced as they are."""
    q = backlog.queue_scale if backlog is not None else 1.0
    if p is not None and p.overtakes > 0 and backlog is not None:
        done = (backlog.cumulative_s[-1] if backlog.cumulative_s else 0.0) - queue_s / q
        started = len(backlog.started)
        start, own = priced(backlog.queue, model, backlog.pack_tokens, p.overtakes, req.num_tokens, prefix_tokens,
                            backlog.cumulative_s[started - 1] if started else None)
        wait = (start - done) * q if start > done else 0.0
        # a job that starts at once (wait 0) is passed by nobody: only a waiting one is priced for it
        # (done is the backlog's sum less its queue: a head just over leaves a rounding error, no wait)
        allowance = overtake_allowance(model, p.overtakes, req.num_tokens, prefix_tokens, p.overtake_share,
                                       p.recent_uncached) if wait > 1e-9 else 0.0
        if p.join_share:
            allowance += join_allowance(model, backlog.pack_tokens, req.num_tokens, prefix_tokens, p.join_share)
        return wait + allowance, own
    if backlog is not None and backlog.pack_tokens > 0:
        n = req.num_tokens - min(prefix_tokens, req.num_tokens - 1)
        if joins_tail(backlog.tail_tokens, n, backlog.tail_bound):
            ahead = queue_s - backlog.tail_s * q
            return ahead if ahead > 0.0 else 0.0, backlog.tail_s + own_seconds(model, req.num_tokens,
                                                                             prefix_tokens, True)
    return queue_s, model.predict(req.num_tokens, prefix_tokens)


def choose_prefill(req: ScheduleRequest, prefills: Sequence[PrefillInstanceState], match: PrefixMatch,
                   cfg: SchedulerConfig, costs: CostModels, queues: Queues,
                   rng: random.Random | None = None) -> PrefillChoice | None:
    """The prefill option the configured strategy picks (None when there is no instance), from
    ``queues``, the backlogs of ``prefills`` at the decision's time (an estimate cache's
    ``prefill_queues``). Ties go to the earlier instance in ``prefills``, so results are
    deterministic. On a wide cluster the queues' rows cost Algorithm 1 as arrays
    (``wide.RowQueues.kvcache_row``: the same rules, the same choice)."""
    if not prefills:
        return None
    packs = queues.packing      # (rows: an instance packs or serves shortest first)
    if cfg.strategy == "kvcache-centric" and not packs:
        hit = queues.kvcache_row(req, match, cfg, costs)
        if hit is not None:     # the row's queue time is the array's double, as in the list below
            i, local, fetch = hit
            return _option(req, prefills[i], queues.queue_at(i), local, match, fetch, cfg, costs)
    packing = packs or any(map(_OVERTAKES, prefills))
    queue_times = queues.queue_s
    backlogs = queues.backlogs if packing else None
    if cfg.strategy == "random":
        if rng is None:
            raise ValueError("strategy 'random' needs a seeded random.Random passed as rng")
        i = rng.randrange(len(prefills))
        return _option(req, prefills[i], queue_times[i], match.length_at(prefills[i].store_id),
                       match, False, cfg, costs, route="random", backlog=queues.backlogs[i])
    if cfg.strategy != "kvcache-centric":
        return _choose_without_transfer(req, prefills, match, cfg, costs, queue_times, backlogs)
    return _choose_kvcache(req, prefills, queue_times, backlogs, match, cfg, costs)


def _choose_kvcache(req: ScheduleRequest, prefills: Sequence[PrefillInstanceState], queue_times: list[float],
                    backlogs: list[Backlog] | None, match: PrefixMatch, cfg: SchedulerConfig,
                    costs: CostModels) -> PrefillChoice | None:
    """Algorithm 1's loop: each instance's estimates (its transfer of the best prefix if
    :func:`rules.fetches_best_prefix`, its queue, its own execution), keyed by
    :func:`rules.prefill_cost_key`. ``backlogs`` (when an instance packs): its queue and
    execution where the request lands (:func:`_packed_estimate`)."""
    lengths, best_len, block_size = match.lengths, match.best_len, cfg.block_size
    threshold, num_tokens = cfg.kvcache_balancing_threshold, req.num_tokens
    block_bytes = block_size * costs.kv_bytes_per_token
    latency_s, default_bandwidth, transfer = costs.transfer_latency_s, costs.bandwidth_bytes_per_s, transfer_seconds
    best, best_key, default_model = None, float("inf"), costs.prefill
    measured = costs.links.from_source(match.best_store_id) if costs.links is not None else {}
    fetches, cost_key = rules.fetches_best_prefix, rules.prefill_cost_key
    # Most instances hold none of the prefix: the rule's branch and the transfer at the default
    # bandwidth for them are found once.
    fetch_unheld = fetches(0, best_len, threshold)
    transfer_unheld = transfer(best_len * block_bytes, default_bandwidth, latency_s) if fetch_unheld else 0.0
    last_model, last_prefix, own = None, -1, 0.0
    for p, queue_s, backlog in zip(prefills, queue_times, backlogs or repeat(None)):
        local = lengths.get(p.store_id, 0)
        fetch = fetches(local, best_len, threshold) if local else fetch_unheld
        if fetch:
            bandwidth = measured.get(p.store_id) or p.bandwidth_bytes_per_s or default_bandwidth
            transfer_s = transfer_unheld if not local and bandwidth == default_bandwidth else \
                transfer((best_len - local) * block_bytes, bandwidth, latency_s)
            prefix = best_len * block_size
        else:
            transfer_s, prefix = 0.0, local * block_size
        model = p.cost or default_model
        if model is not last_model or prefix != last_prefix:     # (instances share models: one call each)
            last_model, last_prefix, own = model, prefix, model.predict(num_tokens, prefix)
        if backlog is None:
            key = cost_key(transfer_s, queue_s, own)
        else:
            key = cost_key(transfer_s, *_packed_estimate(req, model, queue_s, prefix, own, backlog, p))
        if key < best_key:
            best, best_key = (p, transfer_s, queue_s, own, local, fetch, backlog), key
    if best is None:
        return None
    p, transfer_s, queue_s, own, local, fetch, backlog = best
    if backlog is None:      # the loop's estimates are the option's (_option would derive them again)
        return _choice(p, best_key, transfer_s, queue_s, own, local, match, fetch, None)
    return _option(req, p, queue_s, local, match, fetch, cfg, costs, backlog=backlog)


def _packed_estimate(req: ScheduleRequest, model: PrefillCostModel, queue_s: float, prefix_tokens: int,
                     own_s: float, backlog: Backlog, p: PrefillInstanceState) -> tuple[float, float]:
    """(queue, execution) of the request on an instance that packs or serves shortest first, as
    Algorithm 1's loop costs it: where it lands in a shortest-first queue (:func:`_packed`); its
    execution less ``shared_c0`` when it joins the last waiting pack (its queue then holds that pack)."""
    if p.overtakes:
        return _packed(req, model, queue_s, prefix_tokens, backlog, p)
    uncached = req.num_tokens - (prefix_tokens if prefix_tokens < req.num_tokens else req.num_tokens - 1)
    if joins_tail(backlog.tail_tokens, uncached, backlog.tail_bound):
        own_s = own_s - model.shared_c0
        return queue_s, own_s if own_s > 0.0 else 0.0
    return queue_s, own_s


def _choose_without_transfer(req: ScheduleRequest, prefills: Sequence[PrefillInstanceState],
                             match: PrefixMatch, cfg: SchedulerConfig, costs: CostModels,
                             queue_times: list[float], backlogs: list[Backlog] | None = None
                             ) -> PrefillChoice | None:
    """``load-balance`` (cache-blind: queue + full recompute; the engine still reuses what it
    has) and ``cache-aware`` (queue + execution given the local prefix), keyed as Algorithm 1 with
    no transfer. ``backlogs`` (when an instance packs) price the request packed with each queue."""
    lengths, num_tokens = match.lengths, req.num_tokens
    cached_tokens = 0 if cfg.strategy == "load-balance" else cfg.block_size
    best, best_key = None, float("inf")
    for i, (p, queue_s) in enumerate(zip(prefills, queue_times)):
        local = lengths.get(p.store_id, 0)
        model = p.cost or costs.prefill
        if backlogs is None:
            key = rules.prefill_cost_key(0.0, queue_s, model.predict(num_tokens, local * cached_tokens))
        else:
            key = rules.prefill_cost_key(0.0, *_packed(req, model, queue_s, local * cached_tokens, backlogs[i], p))
        if key < best_key:
            best, best_key = (p, queue_s, local, i), key
    if best is None:
        return None
    p, queue_s, local, i = best
    route: Route | None = "balance" if cfg.strategy == "load-balance" else None
    return _option(req, p, queue_s, local, match, False, cfg, costs, route=route,
                   backlog=None if backlogs is None else backlogs[i])


_OVERTAKES = attrgetter("overtakes")
