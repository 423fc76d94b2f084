"""Prefill instance selection per strategy; ``kvcache-centric`` is Algorithm 1 lines 1–16
(REFERENCE.md §2): the smallest predicted TTFT over all instances, each costed either with its
local prefix or with the best global prefix fetched to it."""

from __future__ import annotations

import random
from dataclasses import dataclass

from mooncake_lite.scheduler.block_index import PrefixMatch
from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.scheduler.costs import CostModels, kv_transfer_time
from mooncake_lite.scheduler.decision import Route
from mooncake_lite.scheduler.estimate import prefill_model, prefill_queue_time
from mooncake_lite.scheduler.state import PrefillInstanceState, ScheduleRequest


@dataclass(frozen=True)
class PrefillChoice:
    """One costed option: run the prefill on ``instance`` reusing ``reused_blocks`` blocks, of
    which ``local_blocks`` are already in its store and the rest come from ``source_store_id``."""

    instance: PrefillInstanceState
    ttft_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    reused_blocks: int
    local_blocks: int
    source_store_id: object | None
    route: Route


def _local(req: ScheduleRequest, p: PrefillInstanceState, local_blocks: int, queue_s: float,
           cfg: SchedulerConfig, costs: CostModels, route: Route | None = None) -> PrefillChoice:
    prefill_s = prefill_model(p, costs).predict(req.num_tokens, local_blocks * cfg.block_size)
    if route is None:
        route = "local-hit" if local_blocks else "balance"
    return PrefillChoice(p, queue_s + prefill_s, queue_s, prefill_s, 0.0,
                         local_blocks, local_blocks, None, route)


def _fetched(req: ScheduleRequest, p: PrefillInstanceState, local_blocks: int, match: PrefixMatch,
             queue_s: float, cfg: SchedulerConfig, costs: CostModels) -> PrefillChoice:
    """Cost of fetching blocks [local_blocks, best_len) from the best holder, then prefilling."""
    fetch_blocks = match.best_len - local_blocks
    nbytes = fetch_blocks * cfg.block_size * costs.kv_bytes_per_token
    bandwidth = p.bandwidth_bytes_per_s or costs.bandwidth_bytes_per_s
    transfer_s = kv_transfer_time(nbytes, bandwidth, costs.transfer_latency_s)
    prefill_s = prefill_model(p, costs).predict(req.num_tokens, match.best_len * cfg.block_size)
    if fetch_blocks <= 0:  # this instance is (one of) the best holders
        return _local(req, p, local_blocks, queue_s, cfg, costs)
    return PrefillChoice(p, transfer_s + queue_s + prefill_s, queue_s, prefill_s, transfer_s,
                         match.best_len, local_blocks, match.best_store_id, "transfer")


def wants_transfer(best_len: int, local_len: int, threshold: float) -> bool:
    """Algorithm 1's branch test, negated: ``best_len / prefix_len < threshold`` keeps the local
    prefix. A zero local prefix makes the ratio infinite (fetch) unless nothing is cached at all."""
    if best_len <= local_len:
        return False
    if local_len == 0:
        return True
    return best_len / local_len >= threshold


def choose_prefill(req: ScheduleRequest, prefills: tuple[PrefillInstanceState, ...],
                   match: PrefixMatch, cfg: SchedulerConfig, costs: CostModels, now: float,
                   rng: random.Random | None) -> PrefillChoice | None:
    """The prefill option the configured strategy picks (None when there is no instance).
    Ties go to the earlier instance in ``prefills``, so results are deterministic."""
    if not prefills:
        return None
    if cfg.strategy == "random":
        if rng is None:
            raise ValueError("strategy 'random' needs a seeded random.Random passed as rng")
        p = rng.choice(prefills)
        return _local(req, p, match.length_at(p.store_id), prefill_queue_time(p, costs, now),
                      cfg, costs, route="random")
    best: PrefillChoice | None = None
    best_key = float("inf")
    for p in prefills:
        queue_s = prefill_queue_time(p, costs, now)
        local_blocks = match.length_at(p.store_id)
        if cfg.strategy == "load-balance":
            # Cache-blind: rank by queue + full recompute; the engine still reuses what it has.
            key = queue_s + prefill_model(p, costs).predict(req.num_tokens, 0)
            option = _local(req, p, local_blocks, queue_s, cfg, costs, route="balance")
        elif cfg.strategy == "cache-aware" or not wants_transfer(
                match.best_len, local_blocks, cfg.kvcache_balancing_threshold):
            option = _local(req, p, local_blocks, queue_s, cfg, costs)
            key = option.ttft_s
        else:
            option = _fetched(req, p, local_blocks, match, queue_s, cfg, costs)
            key = option.ttft_s
        if key < best_key:
            best, best_key = option, key
    return best
