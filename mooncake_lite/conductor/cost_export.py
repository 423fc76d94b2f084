"""``GET /internal/v1/cost_model``: the running cluster's own cost models, as a profile file that
``mooncake sim --cost-model`` reads (``sim/costs.load_profile``; ``mooncake sim export-costs``
writes it), so the simulator can be calibrated from the cluster it is meant to predict.

Each live instance's current model is the one it registered with, as refined since by its
heartbeats (``instance/refine.py``); one the instance never reported is the conductor's default.
The simulator models identical instances, so the file holds the coefficient-wise median over
the live instances of each role (a median of models with non-negative coefficients is one too),
and lists every instance's own model under ``instances`` for a reader to check the spread.
``network_bytes_per_s`` is the median bandwidth instances reported, else the median of the
store pairs' speeds the conductor measured from migrations (``scheduler/links.py``), else the
conductor's prior, and then ``network_bytes_per_s_measured`` says ``false``.
``decode_step_ratios``, where every live decode reports them (``step_ratio_q*`` in its load,
``instance/refine.py``): equal-mass quantiles of a step's measured time over its model's
prediction, the median over the decodes quantile by quantile; the simulator draws each step's
time from them (``sim/batch.py``). Guarded by the cluster token like the other internal endpoints.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from aiohttp import web

from mooncake_lite.conductor.api import API
from mooncake_lite.conductor.membership import Instance, Membership
from mooncake_lite.instance.refine import STEP_RATIO_PREFIX
from mooncake_lite.scheduler import CostModels


async def cost_model(request: web.Request) -> web.Response:
    svc = request.app[API].svc
    return web.json_response(cluster_profile(svc.membership, svc.scheduler.costs))


def cluster_profile(membership: Membership, defaults: CostModels) -> dict[str, Any]:
    """The profile dict (module doc) of the live instances."""
    prefills, decodes = membership.alive("prefill"), membership.alive("decode")
    prefill_models = [i.costs.prefill or defaults.prefill for i in prefills]
    decode_models = [i.costs.decode or defaults.decode for i in decodes]
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
        "instances": [_instance(i, defaults) for i in (*prefills, *decodes)],
    }
    if decodes:   # a decode's Register.max_context is its KV capacity in tokens
        profile["decode_max_context_tokens"] = int(median(i.reg.max_context for i in decodes))
    ratios = [r for i in decodes if (r := _step_ratios(i))]
    if decodes and len(ratios) == len(decodes) and len({len(r) for r in ratios}) == 1:
        profile["decode_step_ratios"] = [median(col) for col in zip(*ratios)]
    return profile


def _step_ratios(inst: Instance) -> list[float]:
    """The decode's reported step-time spread, its quantiles in order (empty: none reported)."""
    keys = sorted(k for k in inst.load if k.startswith(STEP_RATIO_PREFIX))
    return [float(inst.load[k]) for k in keys]


def _median_model(models: list, default: dict[str, float]) -> dict[str, float]:
    if not models:
        return default
    dicts = [m.to_dict() for m in models]
    return {name: median(d[name] for d in dicts) for name in dicts[0]}


def _bandwidth(inst: Instance) -> float | None:
    """What the instance measured of its inbound KV rate (reported in its costs or its load)."""
    return inst.costs.bandwidth_bytes_per_s or inst.load.get("bandwidth_bytes_per_s") or None


def _instance(inst: Instance, defaults: CostModels) -> dict[str, Any]:
    own = inst.costs.prefill if inst.role == "prefill" else inst.costs.decode
    model = own or (defaults.prefill if inst.role == "prefill" else defaults.decode)
    return {"instance_id": inst.instance_id, "role": inst.role, "cost": model.to_dict(),
            "reported": own is not None}
