"""Decode selection by predicted TBT and the SLO admission check (docs/paper.md §2 steps 3–4, §3).

``none`` and ``early`` read every decode instance's committed load *now* (running batch plus the
requests already dispatched there whose KV has not arrived, plus the new request);
``predictive`` reads the load predicted for ``t = now + predicted TTFT``: incoming requests whose
prefill finishes by ``t`` join (and leave t_d later), running requests older than t_d at ``t`` leave.

The SLOs checked are absolute or relative to the request alone on the chosen instances
(``SchedulerConfig``, :func:`slo_violation`), each against its bound (:func:`bounds`): the
central prediction × how far above its predictions the instance was measured to land. :func:`unmeetable_slos` tells a caller
when an instance's own profile says it cannot meet an absolute SLO even when idle.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

from mooncake_lite.scheduler import rules
from mooncake_lite.scheduler.cache import FROM_SCRATCH, Estimates
from mooncake_lite.scheduler.config import SchedulerConfig
from mooncake_lite.scheduler.costs import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.decision import RejectCause
from mooncake_lite.scheduler.estimate import (Queues, decode_has_room, decode_tbt, joining_step, loads_at,
                                              own_decode_span, queues_at, running_load)
from mooncake_lite.scheduler.prefill_select import PrefillChoice
from mooncake_lite.scheduler.state import ClusterState, DecodeInstanceState, ScheduleRequest

_new = tuple.__new__   # a NamedTuple without its constructor's Python frame (estimate.py)


class DecodeChoice(NamedTuple):
    """The decode instance picked and its predicted TBT once the new request has joined."""

    instance: DecodeInstanceState
    tbt_s: float
    batch_size: int       # including the new request
    context_tokens: int   # including the new request's prompt


def choose_decode(req: ScheduleRequest, cluster: ClusterState, cfg: SchedulerConfig,
                  costs: CostModels, now: float, ttft_s: float, rng: random.Random | None,
                  queues: Queues | None = None, cache: Estimates | None = None) -> DecodeChoice | None:
    """SelectDecodingInstance: of the instances with room (:func:`rules.decode_has_room`), the
    smallest predicted TBT after adding ``req`` (ties: earliest in ``cluster.decodes``); with
    strategy ``random`` a random eligible one. None when no instance has room. ``queues`` (the
    backlogs of ``cluster.prefills`` at ``now``) saves recomputing them when the caller has
    them; ``cache`` (None: from scratch) keeps what is derived per instance between decisions,
    and on a wide cluster picks over its rows (the same rule, the same choice). The room rule is
    asked until one has room, then only where the TBT beats the best (one not asked cannot win)."""
    decodes, num_tokens, max_output = cluster.decodes, req.num_tokens, req.max_output_tokens
    # n sequences (req.num_sequences) join: n more in the batch, each attending to the prompt;
    # the KV they need is the prompt's, shared, and each one's output (its copy of the prompt's
    # partial last block is left out). Room for n is room for one more past n - 1 others.
    n = req.num_sequences
    estimates = cache or FROM_SCRATCH
    if cfg.strategy != "random" and cfg.admission != "predictive" and n == 1:   # the rows price one
        row = estimates.decode_rows_now(decodes, costs, req)
        if row is not None:
            return _new(DecodeChoice, (decodes[row.row], row.tbt_s, row.batch_size, row.context_tokens))
    loads = _loads(cluster, cfg, costs, now, ttft_s, queues, estimates)
    best, best_tbt, need, default = None, float("inf"), num_tokens + n * max_output, costs.decode
    has_room, joined = rules.decode_has_room, n * num_tokens
    if cfg.strategy == "random":
        if rng is None:
            raise ValueError("strategy 'random' needs a seeded random.Random passed as rng")
        eligible = [(d, batch + n, context + joined) for d, (batch, context) in zip(decodes, loads)
                    if has_room(d.max_batch_size, d.max_context_tokens, batch + n - 1, context, need)]
        if not eligible:
            return None
        d, batch, context = rng.choice(eligible)
        return DecodeChoice(d, decode_tbt(d, costs, batch, context), batch, context)
    for d, (batch, context) in zip(decodes, loads):
        if best is None:
            if has_room(d.max_batch_size, d.max_context_tokens, batch + n - 1, context, need):
                best, best_tbt, best_load = d, (d.cost or default).predict(batch + n, context + joined), \
                    (batch, context)
            continue
        tbt = (d.cost or default).predict(batch + n, context + joined)
        if tbt < best_tbt and has_room(d.max_batch_size, d.max_context_tokens, batch + n - 1, context, need):
            best, best_tbt, best_load = d, tbt, (batch, context)
    if best is None:
        return None
    return _new(DecodeChoice, (best, best_tbt, best_load[0] + n, best_load[1] + joined))


def _loads(cluster: ClusterState, cfg: SchedulerConfig, costs: CostModels, now: float, ttft_s: float,
           queues: Queues | None, estimates: Estimates) -> list[tuple[int, int]]:
    """Each decode instance's (batch size, context tokens) before adding the request: the load
    now (``none``/``early``) or predicted for ``t = now + ttft_s`` (``predictive``)."""
    decodes = cluster.decodes
    if cfg.admission == "predictive":
        if any(d.incoming for d in decodes):
            if queues is None:
                queues = queues_at(estimates.backlogs(cluster.prefills, costs), now)
        else:
            queues = None
        uniform = cfg.uniform_decode_s
        profiles = estimates.leave_profiles(decodes, costs, uniform)
        return loads_at(decodes, profiles, now, now + ttft_s, queues, uniform, costs.decode)
    return estimates.loads_now(decodes)


def tbt_refusal(cost: DecodeCostModel, batch: int, context_tokens: int, num_tokens: int,
                tbt_slo_s: float | None, tbt_slo_factor: float | None = None, n: int = 1) -> str | None:
    """The decode instance's own TBT double check, one code for the live decode
    (``decode/batcher.py``, at reservation) and the simulator: None if ``n`` more sequences of
    ``num_tokens`` context each on an instance decoding ``batch`` sequences of ``context_tokens``
    (:func:`held_load_at`) keep the predicted step within the SLO, else why not. The SLO is
    ``tbt_slo_s`` if set, else ``tbt_slo_factor`` × one step of the request alone (its ``n``
    sequences: the conductor's relative SLO, :func:`slo_violation`), else there is no check."""
    slo = tbt_slo_s
    if slo is None:
        if tbt_slo_factor is None:
            return None
        slo = tbt_slo_factor * cost.predict(n, n * num_tokens)
    tbt = cost.predict(batch + n, context_tokens + n * num_tokens)
    if tbt <= slo:
        return None
    how = "" if tbt_slo_s is not None else f" ({tbt_slo_factor:g}x a step alone)"
    return f"predicted TBT {tbt * 1e3:.2f} ms with batch {batch + n} exceeds the TBT SLO {slo * 1e3:.2f} ms{how}"


# A sequence a decode holds, as its double check reads it: (when it decodes from: the KV's expected
# arrival for one reserved, ``now`` for one running; its output tokens left; its context tokens).
Held = tuple[float, int, int]


def held_load_at(held: Sequence[Held], model: DecodeCostModel, now: float, t: float | None) -> tuple[int, int]:
    """(sequences, context tokens) of ``held`` still decoding at ``t``, when a new request's KV is
    due: each decodes for t_d = :func:`~estimate.decode_span` of its tokens left, at least its
    own step alone — the conductor's rules (``estimate.loads_at``): one joined by ``now`` from
    now, at the step of those joined (:func:`~estimate.pricing_tbt`'s running batch); one still
    to join from its join, at the step of the joined ones still there at ``t``
    (:func:`~estimate.joining_step`). One joining after ``t`` is not beside it then. Counted
    together, a burst's tenth reservation was judged at batch 10 where its members, prefilled one
    after another, decode one or two at a time. ``t`` None: when it joins is unknown, and
    everything held counts, as if all decoded together from now."""
    if t is None:
        return len(held), sum([tokens for _, _, tokens in held])
    joined = [tokens for join_at, _, tokens in held if join_at <= now]
    tbt = model.predict(len(joined), sum(joined))
    batch = context = 0
    for join_at, tokens_left, tokens in held:
        if join_at <= now and now + own_decode_span(model, tokens_left, tokens, None, tbt) > t:
            batch += 1
            context += tokens
    step = joining_step(model, batch, context)
    for join_at, tokens_left, tokens in held:
        if now < join_at <= t < join_at + own_decode_span(model, tokens_left, tokens, None, step):
            batch += 1
            context += tokens
    return batch, context


def decode_admits(d: DecodeInstanceState, req: ScheduleRequest, costs: CostModels,
                  tbt_slo_s: float | None, tbt_slo_factor: float | None = None) -> bool:
    """The paper's local double check when the KV arrives: room left and TBT with ``req``
    added within the SLO, judged on the running batch only (``incoming`` is the conductor's
    forecast, not the instance's own state); a refusal here wastes the prefill already done.
    The simulator's ``decode_check="arrival"``; the live decode checks at reservation instead
    (:func:`tbt_refusal`, before the prefill starts); the SLO as :func:`tbt_refusal` takes it."""
    batch, context = running_load(d)
    if not decode_has_room(d, req.num_tokens, req.max_output_tokens, batch, context):
        return False
    return tbt_refusal(d.cost or costs.decode, batch, context, req.num_tokens, tbt_slo_s, tbt_slo_factor) is None


def bounds(p: PrefillChoice, d: DecodeChoice | None) -> tuple[float, float | None]:
    """The (TTFT, TBT) admission judges: the TTFT with what others add to it (its queue) × the
    prefill's ``PrefillInstanceState.queue_spread`` (1 by default: the central prediction, why in
    ``Corrections.queue_bound``; a quantile of measured / predicted waits there where one is asked
    for), and the TBT step as predicted (without the tail). A central prediction admits about half
    of those near the limit to miss it (docs/results/2026-11-29-prediction-admission.md); an upper
    quantile refuses them, and with them most of those that would have met. The request alone is judged on its
    prediction: a spread on the whole would refuse every request on an idle instance once it
    passes the SLO factor, and a request never admitted never measures the spread down again.
    Never under the central prediction: that already holds what the corrections learned of the
    queue's bias; a spread under 1 (waits lately under the model as it stands, ``wait_spread.py``)
    judged a request below it, and counted that bias twice: live on Zen 3 it admitted 7 requests
    whose central prediction was over their SLO, and 5 missed it (2026-12-01-zen3-admission.md §11)."""
    spread = p.instance.queue_spread
    ttft = p.ttft_s if spread <= 1.0 else p.ttft_s + p.queue_s * (spread - 1.0)
    # The TBT's spread is measured and shown (DecodeInstanceState.tbt_spread) but not judged here:
    # live, a bound on it refused mostly requests that would have met their SLO (47% and 60% of
    # those refused, against 11% with the TTFT bound alone): the TBT misses are the gap tail
    # beside a colocated prefill, not what the batch adds (2026-11-29-prediction-admission.md).
    return ttft, None if d is None else d.tbt_s


def slo_violation(cfg: SchedulerConfig, req: ScheduleRequest, costs: CostModels, p: PrefillChoice,
                  d: DecodeChoice, bound: tuple[float, float | None]) -> tuple[RejectCause, str] | None:
    """(cause, reason) if admission rejects, else None. ``none`` never rejects on SLOs. What is
    judged is each prediction's bound (``bound``: :func:`bounds`, which the decision also carries).

    A relative SLO (``cfg.ttft_slo_s``/``tbt_slo_s`` None) is the factor × what the chosen
    instance's own cost model predicts for this request alone on it: the whole prompt's
    execution with no queue and no cached prefix (reuse only makes the real one faster), and
    one decode step at batch 1 with the prompt as context. One ``predict`` call per metric; the
    request's size is an argument of both, so there is nothing to precompute per instance."""
    if cfg.admission == "none":
        return None
    alone: float | None = None
    limit = cfg.ttft_slo_s      # (ttft_limit's rule, written out: a call more per decision shows)
    if limit is None:
        alone = (p.instance.cost or costs.prefill).predict(req.num_tokens)
        limit = cfg.ttft_slo_factor * alone
    ttft, tbt = bound
    # over the SLO, then over its margin (config.py): a request under its SLO pays nothing for it
    if ttft > limit and ttft > limit * (1.0 + cfg.ttft_admit_margin):
        return "ttft", _refusal("TTFT", p.ttft_s, ttft, limit, cfg.ttft_slo_factor, alone, "", "this prompt alone",
                                p.instance.instance_id, cfg.ttft_admit_margin)
    step_alone: float | None = None
    tbt_limit = cfg.tbt_slo_s
    if tbt_limit is None:
        step_alone = (d.instance.cost or costs.decode).predict(req.num_sequences, req.num_sequences * req.num_tokens)
        tbt_limit = cfg.tbt_slo_factor * step_alone
    if tbt is not None and tbt > tbt_limit:
        return "tbt", _refusal("TBT", d.tbt_s, tbt, tbt_limit, cfg.tbt_slo_factor, step_alone, " step",
                               "this request alone",
                               d.instance.instance_id)
    return None


def ttft_limit(cfg: SchedulerConfig, num_tokens: int, costs: CostModels, prefill: PrefillCostModel | None) -> float:
    """The TTFT limit :func:`slo_violation` judges a prompt of ``num_tokens`` by on an instance
    with this cost model (None: the default): absolute, or the factor x the prompt alone."""
    ttft = cfg.ttft_slo_s
    return ttft if ttft is not None else cfg.ttft_slo_factor * (prefill or costs.prefill).predict(num_tokens)


def _refusal(metric: str, predicted_s: float, bound_s: float, limit_s: float, factor: float, alone_s: float | None,
             unit: str, what: str, instance_id: str, margin: float = 0.0) -> str:
    """Why admission refused: the predicted time (its bound, where a spread was measured) over
    the limit (a relative one: of what alone; and the margin admission allows over it)."""
    spread = "" if bound_s == predicted_s else f" (bound by its measured spread {bound_s:.3g}s)"
    over = f" + {margin:.0%}" if margin else ""
    why = f"rejected: predicted {metric} {predicted_s:.3g}s{spread} > SLO {limit_s:.3g}s{over}"
    if alone_s is None:
        return why
    return f"{why} ({factor:g}x the {alone_s:.3g}s{unit} of {what} on {instance_id})"


def slo_limits(cfg: SchedulerConfig, num_tokens: int, costs: CostModels, prefill: PrefillCostModel | None,
               decode: DecodeCostModel | None) -> tuple[float, float]:
    """The (TTFT, TBT) limits :func:`slo_violation` judges a prompt of ``num_tokens`` by on
    instances with these cost models (None: the defaults): absolute, or factor x alone."""
    ttft = ttft_limit(cfg, num_tokens, costs, prefill)
    tbt = cfg.tbt_slo_s
    if tbt is None:
        tbt = cfg.tbt_slo_factor * (decode or costs.decode).predict(1, num_tokens)
    return ttft, tbt


def ttft_load(cfg: SchedulerConfig, req: ScheduleRequest, costs: CostModels, cluster: ClusterState,
              prefill_id: str | None, ttft_s: float) -> float:
    """An accepted request's predicted TTFT over its TTFT limit (1.0: at the SLO). Its TTFT is
    also how long the chosen prefill is taken before a request arriving behind it can start (the
    queue it waits in plus its own prefill), so the tenants' priority rule
    (``scheduler/tenants.py``) sheds lower classes above a fraction of it."""
    p = next((x.cost for x in cluster.prefills if x.instance_id == prefill_id), None)
    return ttft_s / slo_limits(cfg, req.num_tokens, costs, p, None)[0]


class UnmeetableSlo(NamedTuple):
    """An absolute SLO that an instance's own cost model says it misses even idle and alone."""

    metric: str           # "ttft" or "tbt"
    predicted_s: float    # what the instance's model predicts for ``what``
    slo_s: float
    what: str             # the smallest work that already misses it
    consequence: str      # which requests admission will therefore reject


def unmeetable_slos(cfg: SchedulerConfig, prefill: PrefillCostModel | None = None,
                    decode: DecodeCostModel | None = None) -> list[UnmeetableSlo]:
    """Absolute SLOs an instance cannot meet even when idle, judged by its own cost model: a
    prefill of one block (``cfg.block_size`` tokens) over ``ttft_slo_s``, a decode step at batch 1
    with one token of context over ``tbt_slo_s``. Empty for admission ``none`` and for relative
    SLOs (met by construction). For the caller to say so loudly once per instance: every such
    request will be rejected."""
    out: list[UnmeetableSlo] = []
    if cfg.admission == "none":
        return out
    if prefill is not None and cfg.ttft_slo_s is not None:
        block_size = cfg.block_size
        t = prefill.predict(block_size)
        if t > cfg.ttft_slo_s:
            out.append(UnmeetableSlo("ttft", t, cfg.ttft_slo_s, f"prefilling one block ({block_size} tokens) alone",
                                     f"every prompt of {block_size} tokens or more"))
    if decode is not None and cfg.tbt_slo_s is not None:
        t = decode.predict(1, 1)
        if t > cfg.tbt_slo_s:
            out.append(UnmeetableSlo("tbt", t, cfg.tbt_slo_s, "one decode step alone (batch 1)",
                                     "every request"))
    return out
