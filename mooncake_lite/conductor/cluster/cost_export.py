"""``GET /internal/v1/cost_model``: the running cluster's own cost models, as a profile file that
``mooncake sim --cost-model`` reads (``sim/costs.load_profile``; ``mooncake sim export-costs``
writes it), so the simulator can be calibrated from the cluster it is meant to predict.

Each live instance's current model is the one it registered with, as refined since by its
heartbeats (``instance/refine.py``) and corrected online by what its requests measured
(``scheduler/correction.py``: a prefill's compute terms, not its queue's, which the simulator
models itself, nor a decode's, see ``PredictionBook.simulated_costs``; ``corrections`` lists every
instance's factors); one the instance never reported is the conductor's default.
The simulator models identical instances, so the file holds the coefficient-wise median over
the live instances of each role (a median of models with non-negative coefficients is one too),
and lists every instance's own model under ``instances`` for a reader to check the spread.
``network_bytes_per_s`` is the median bandwidth instances reported, else the median of the
store pairs' speeds the conductor measured from migrations (``scheduler/links.py``), else the
conductor's prior, and then ``network_bytes_per_s_measured`` says ``false``.
``prefill_idle`` and ``prefill_busy``, where every prefill's correction has both node states: its
model at each state's speed (``PredictionBook.simulated_states``), which the simulator runs a
forward at by its node's state as it starts; ``prefill`` weighs the two and prices its conductor.
``decode_step_ratios``, where every live decode reports them (``step_ratio_q*`` in its load,
``instance/refine.py``): equal-mass quantiles of a step's measured time over its model's
prediction, the median over the decodes quantile by quantile; the simulator draws each step's
time from them (``sim/batch.py``). Guarded by the cluster token like the other internal endpoints.

Co-location (one box, issue #20 item 4): the export asks every live instance for its recent work
(``GET /v1/timeline``: a decode's steps, a prefill's forwards, on its host's monotonic clock) and
splits each decode's token gaps by whether a prefill on the same host was computing through them
(``instance/colocation.colocation_split``). Where that split exists, ``decode_step_ratios`` are the
spread of the gaps run alone (gap = step + the loop's work between steps, what a client's TBT
sees; the heartbeat's deciles time the step only), ``decode_busy_step_ratios`` the spread of those
beside one (where every decode has some), and ``decode_colocated_slowdown`` the mean gap beside a
prefill over the mean gap alone (per unit of the model's step), which the simulator applies to a
decode's steps while a prefill computes, their shape drawn from the busy spread (``sim/batch.py``);
``colocation`` has every decode's figures. A decode with no prefill on its host reports no slowdown.
``decode_padding_s_per_token``: where every decode's attention runs a batch's sequences to the
longest one's context (the torch reference kernel: CPU), the seconds a padding token adds to a
step, fitted to its gaps (``instance/colocation.padding_cost``; the median over the decodes); the
simulator adds them to its steps, and the ratios above are over that step.
``decode_kv_write_s_per_token``: what writing a received prompt's KV costs the decode's model
thread per prompt token (its joins in ``kv_intake``), which the simulator charges over the prefill
that streams it; the gaps above are taken without those writes (spread over that forward's gaps).
``store_blocks_per_node`` (the median DRAM slots), ``ssd_blocks_per_node`` and ``eviction``: the
capacity the stores the live prefills use report with their block events (``StoreCapacity``), in
blocks of ``block_size`` tokens; left out unless every such store reported it and all evict alike,
and the simulator then sizes its store from ``dram_bytes_per_node``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from statistics import median
from typing import Any

import aiohttp
from aiohttp import web

from mooncake_lite.common.auth import cluster_headers
from mooncake_lite.conductor.cluster.costs import InstanceCosts
from mooncake_lite.conductor.cluster.membership import Instance, Membership
from mooncake_lite.conductor.cluster.store_watch import StoreWatch
from mooncake_lite.conductor.services import SERVICES
from mooncake_lite.instance.colocation import colocation_split
from mooncake_lite.scheduler import CostModels

TIMELINE_TIMEOUT_S = 5.0


async def cost_model(request: web.Request) -> web.Response:
    svc = request.app[SERVICES]
    timelines = await fetch_timelines(svc.session, svc.membership, svc.cluster_token)
    book = svc.predictions
    return web.json_response(cluster_profile(svc.membership, svc.scheduler.costs, timelines,
                                             corrected=book.simulated_costs, corrections=book.export(),
                                             in_states=book.simulated_states))


async def fetch_timelines(session: aiohttp.ClientSession, membership: Membership,
                          token: str | None) -> dict[str, dict]:
    """Every live instance's ``GET /v1/timeline`` answer by instance id; one that does not
    answer (down, or a role from before timelines) is left out, and its decodes keep the
    heartbeat's spread."""
    async def one(inst: Instance) -> tuple[str, dict | None]:
        try:
            async with session.get(f"http://{inst.reg.http}/v1/timeline", headers=cluster_headers(token),
                                   timeout=aiohttp.ClientTimeout(total=TIMELINE_TIMEOUT_S)) as resp:
                if resp.status == 200:
                    return inst.instance_id, await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        return inst.instance_id, None
    insts = [*membership.alive("prefill"), *membership.alive("decode")]
    answers = await asyncio.gather(*(one(i) for i in insts))
    return {iid: t for iid, t in answers if isinstance(t, dict)}


def cluster_profile(membership: Membership, defaults: CostModels,
                    timelines: Mapping[str, Mapping] | None = None,
                    corrected: Callable[[Instance], InstanceCosts] = lambda inst: inst.costs,
                    corrections: Mapping[str, Any] | None = None,
                    in_states: Callable[[Instance], tuple[InstanceCosts, InstanceCosts] | None] = lambda inst: None,
                    ) -> dict[str, Any]:
    """The profile dict (module doc) of the live instances (``timelines``: their ``/v1/timeline``
    answers by id, for the co-location split; ``corrected``: an instance's models as corrected;
    ``in_states``: a prefill's, idle and busy, or None)."""
    prefills, decodes = membership.alive("prefill"), membership.alive("decode")
    prefill_models = [corrected(i).prefill or defaults.prefill for i in prefills]
    decode_models = [corrected(i).decode or defaults.decode for i in decodes]
    bandwidths = [b for i in prefills if (b := _bandwidth(i)) is not None] \
        or [speed for _, _, speed in (defaults.links.items() if defaults.links is not None else ())]
    profile: dict[str, Any] = {
        "name": f"live-{membership.model_id}",
        "prefill": _median_model(prefill_models, defaults.prefill.to_dict()),
        "decode": _median_model(decode_models, defaults.decode.to_dict()),
        "kv_bytes_per_token": membership.kv_bytes_per_token or defaults.kv_bytes_per_token,
        "block_size": membership.block_size,
        "network_bytes_per_s": median(bandwidths) if bandwidths else defaults.bandwidth_bytes_per_s,
        "network_bytes_per_s_measured": bool(bandwidths),
        "instances": [_instance(i, defaults, corrected(i)) for i in (*prefills, *decodes)],
        "corrections": dict(corrections or {}),   # each instance's factors, by id
    }
    profile.update(store_capacity(prefills, membership.stores))
    profile.update(prefill_states(prefills, defaults, in_states))
    if decodes:   # a decode's Register.max_context is its KV capacity in tokens
        profile["decode_max_context_tokens"] = int(median(i.reg.max_context for i in decodes))
    splits = colocation(decodes, prefills, timelines or {}, defaults)
    if splits:
        profile["colocation"] = splits
    profile.update(step_spreads(decodes, splits))
    padding = [s["padding_s_per_token"] for s in splits.values() if s.get("padding_s_per_token")]
    if padding:   # a step costs batch × the longest context, the padding at this much a token
        profile["decode_padding_s_per_token"] = median(padding)
    writes = [s["kv_write_s_per_token"] for s in splits.values() if s.get("kv_write_s_per_token")]
    if writes:    # received KV written in the decode's model thread, between its steps
        profile["decode_kv_write_s_per_token"] = median(writes)
    slowdowns = [s["slowdown"] for s in splits.values() if s.get("slowdown")]
    if slowdowns:   # the decodes that share a host with a prefill and ran steps both ways
        profile["decode_colocated_slowdown"] = median(slowdowns)
    return profile


def colocation(decodes: list[Instance], prefills: list[Instance], timelines: Mapping[str, Mapping],
               defaults: CostModels) -> dict[str, dict]:
    """Each decode's ``colocation_split`` (its steps against the forwards of the prefills on its
    host, by its own model), by instance id; decodes without a timeline are left out."""
    out = {}
    for d in decodes:
        mine = timelines.get(d.instance_id)
        if not mine or not mine.get("steps"):
            continue
        forwards = [f for p in prefills if (t := timelines.get(p.instance_id)) and t.get("host") == mine.get("host")
                    for f in t.get("forwards", ())]
        split = colocation_split(mine["steps"], forwards, d.costs.decode or defaults.decode,
                                 padded=bool(mine.get("padded_attention")), intake=mine.get("kv_intake") or ())
        if split is not None:
            out[d.instance_id] = split
    return out


def prefill_states(prefills: list[Instance], defaults: CostModels,
                   in_states: Callable[[Instance], tuple[InstanceCosts, InstanceCosts] | None]) -> dict[str, Any]:
    """``prefill_idle`` and ``prefill_busy``: the prefill's model in each node state (the median over
    the prefills, as ``prefill``), where every prefill has both; else nothing."""
    states = [in_states(i) for i in prefills]
    if not states or any(s is None for s in states):
        return {}
    return {key: _median_model([(s[k].prefill or defaults.prefill) for s in states if s is not None],
                               defaults.prefill.to_dict())
            for k, key in enumerate(("prefill_idle", "prefill_busy"))}


def store_capacity(prefills: list[Instance], watch: StoreWatch) -> dict[str, Any]:
    """The profile's store keys (module doc) for the stores ``prefills`` use; {} when one of them
    did not report its capacity or they evict differently."""
    caps = [watch.capacity.get(s) for s in sorted({i.reg.store for i in prefills if i.reg.store})]
    if not caps or None in caps or len({c.eviction for c in caps}) != 1:
        return {}
    return {"store_blocks_per_node": int(median(c.dram_slots for c in caps)),
            "ssd_blocks_per_node": int(median(c.ssd_blocks for c in caps)), "eviction": caps[0].eviction}


def step_spreads(decodes: list[Instance], splits: Mapping[str, Mapping]) -> dict[str, list[float]]:
    """``decode_step_ratios`` (each decode's gaps alone, else its heartbeat's spread) and
    ``decode_busy_step_ratios`` (its gaps beside a prefill): each where every decode has one."""
    spreads = {"decode_step_ratios": [_gap_ratios(splits.get(i.instance_id)) or _step_ratios(i) for i in decodes],
               "decode_busy_step_ratios": [_gap_ratios(splits.get(i.instance_id), "busy") for i in decodes]}
    return {key: spread for key, rows in spreads.items() if (spread := _median_spread(rows))}


def _gap_ratios(split: Mapping | None, side: str = "idle") -> list[float]:
    """The spread of a decode's gaps with no prefill computing beside it, or (``busy``) with one
    (empty: none)."""
    return list(split.get(f"{side}_ratios") or ()) if split else []


def _median_spread(spreads: list[list[float]]) -> list[float]:
    """The decodes' spreads' median quantile by quantile, where every decode has one and all
    have as many quantiles (empty: else)."""
    if not spreads or not all(spreads) or len({len(r) for r in spreads}) != 1:
        return []
    return [median(col) for col in zip(*spreads)]


def _step_ratios(inst: Instance) -> list[float]:
    """The decode's reported step-time spread, its quantiles in order (empty: none reported)."""
    return list(inst.load.step_ratios)


def _median_model(models: list, default: dict[str, float]) -> dict[str, float]:
    if not models:
        return default
    dicts = [m.to_dict() for m in models]
    return {name: median(d[name] for d in dicts) for name in dicts[0]}


def _bandwidth(inst: Instance) -> float | None:
    """What the instance measured of its inbound KV rate (reported in its costs or its load)."""
    return inst.costs.bandwidth_bytes_per_s or inst.load.bandwidth_bytes_per_s or None


def _instance(inst: Instance, defaults: CostModels, shown: InstanceCosts) -> dict[str, Any]:
    is_prefill = inst.role == "prefill"
    own = inst.costs.prefill if is_prefill else inst.costs.decode
    base = own or (defaults.prefill if is_prefill else defaults.decode)
    model = (shown.prefill if is_prefill else shown.decode) or base
    return {"instance_id": inst.instance_id, "role": inst.role, "cost": model.to_dict(),
            "reported": own is not None, "corrected": model != base}
