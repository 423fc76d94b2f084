"""Cost models the conductor starts with, and the ones instances report when they register.

Until an instance reports its own self-profiled coefficients (``Register.cost``), the scheduler
predicts with rough defaults derived from the model's shape and an assumed compute rate. They
only need to rank instances sensibly; SLO admission is as good as the reported profiles.

``Register.cost`` takes one of two forms. Flat: the instance's own model as
``PrefillCostModel.to_dict()`` (prefill) or ``DecodeCostModel.to_dict()`` (decode) — what the
roles send. Nested (every part optional)::

    {"prefill": {"c0": .., "c1": .., "c2": .., "c3": ..},   # PrefillCostModel, seconds
     "decode":  {"c0": .., "c1": .., "c2": ..},             # DecodeCostModel, seconds per step
     "bandwidth_bytes_per_s": 2.5e9}                        # measured inbound KV fetch rate
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mooncake_lite.model.args import ModelArgs
from mooncake_lite.scheduler import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.links import LinkSpeeds

COST_KEYS = ("prefill", "decode", "bandwidth_bytes_per_s")


def default_costs(args: ModelArgs, kv_bytes_per_token: int, flops_per_s: float = 50e9,
                  bandwidth_bytes_per_s: float = 2e9, overhead_s: float = 0.005) -> CostModels:
    """Shape-derived defaults: linear cost 2·params FLOPs per token, attention
    4·layers·q_width FLOPs per (query, key) pair, a fixed per-call overhead. ``bandwidth_bytes_per_s``
    is only the prior: each store pair's measured speed replaces it (``links``, fed by dispatch)."""
    per_token = 2.0 * args.num_params() / flops_per_s
    per_pair = 4.0 * args.num_layers * args.q_width / flops_per_s
    prefill = PrefillCostModel(c0=overhead_s, c1=per_token, c2=per_pair, c3=0.0)
    # A decode step reads the weights once per step, then pays per sequence and per cached token.
    decode = DecodeCostModel(c0=overhead_s + per_token, c1=per_token, c2=per_pair)
    return CostModels(prefill=prefill, decode=decode, kv_bytes_per_token=kv_bytes_per_token,
                      bandwidth_bytes_per_s=bandwidth_bytes_per_s, links=LinkSpeeds())


@dataclass(frozen=True)
class InstanceCosts:
    """What one instance reported about its own speed (None = use the cluster default)."""

    prefill: PrefillCostModel | None = None
    decode: DecodeCostModel | None = None
    bandwidth_bytes_per_s: float | None = None


def parse_instance_costs(cost: dict[str, Any], role: str) -> InstanceCosts:
    """Validate ``Register.cost``; a bad dict raises ValueError naming the problem."""
    if cost and all(k.startswith("c") and k[1:].isdigit() for k in cost):   # the flat form
        cost = {role: cost}
    unknown = sorted(set(cost) - set(COST_KEYS))
    if unknown:
        raise ValueError(f"cost: unknown key(s) {unknown}; expected some of {list(COST_KEYS)}")
    prefill = decode = None
    if cost.get("prefill") is not None:
        prefill = PrefillCostModel.from_dict(_mapping(cost["prefill"], "cost.prefill"))
    if cost.get("decode") is not None:
        decode = DecodeCostModel.from_dict(_mapping(cost["decode"], "cost.decode"))
    bandwidth = cost.get("bandwidth_bytes_per_s")
    if bandwidth is not None:
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or bandwidth <= 0:
            raise ValueError(f"cost.bandwidth_bytes_per_s must be a positive number, got {bandwidth!r}")
        bandwidth = float(bandwidth)
    return InstanceCosts(prefill, decode, bandwidth)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object of coefficients")
    return value
