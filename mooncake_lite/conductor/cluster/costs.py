"""Cost models the conductor starts with, and the ones instances report of themselves.

Until an instance reports its own self-profiled coefficients (``Register.cost``, refined by each
``Heartbeat.cost``: a :class:`~mooncake_lite.common.cost_report.CostReport`, checked when the
message was decoded), the scheduler predicts with rough defaults derived from the model's shape
and an assumed compute rate. They only need to rank instances sensibly; SLO admission is as good
as the reported profiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_lite.common.cost_report import CostReport, FlatCost
from mooncake_lite.model.args import ModelArgs
from mooncake_lite.scheduler import CostModels, DecodeCostModel, PrefillCostModel
from mooncake_lite.scheduler.links import LinkSpeeds


def default_costs(args: ModelArgs, kv_bytes_per_token: int, flops_per_s: float = 50e9,
                  bandwidth_bytes_per_s: float = 2e9, overhead_s: float = 0.005) -> CostModels:
    """Shape-derived defaults: linear cost 2·active params FLOPs per token (a token runs through
    its top-k experts only), attention
    4·layers·q_width FLOPs per (query, key) pair, a fixed per-call overhead. ``bandwidth_bytes_per_s``
    is only the prior: each store pair's measured speed replaces it (``links``, fed by dispatch)."""
    per_token = 2.0 * args.active_params() / flops_per_s
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


def instance_costs(report: CostReport | FlatCost, role: str) -> InstanceCosts:
    """The scheduler's models of what an instance reports; a flat report (an older instance's)
    is read as ``role``'s, and ValueError says when it does not fit that role."""
    if isinstance(report, FlatCost):
        report = report.for_role(role)
    prefill = None if report.prefill is None else PrefillCostModel(**vars(report.prefill))
    decode = None if report.decode is None else DecodeCostModel(**vars(report.decode))
    return InstanceCosts(prefill, decode, report.bandwidth_bytes_per_s)
