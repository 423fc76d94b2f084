"""Small builders for hand-computable simulator scenarios."""

from __future__ import annotations

from mooncake_lite.scheduler import DecodeCostModel, PrefillCostModel
from mooncake_lite.sim.costs import Hardware
from mooncake_lite.trace.format import TraceRequest


def toy_hardware(prefill_per_token: float = 1e-3, step_s: float = 0.01, **kw) -> Hardware:
    """Prefill costs ``prefill_per_token`` per new token, every decode step ``step_s``; the
    network and local loads are effectively instant, so times are hand-computable."""
    args = dict(name="toy", prefill=PrefillCostModel(c1=prefill_per_token),
                decode=DecodeCostModel(c0=step_s), kv_bytes_per_token=1, network_bytes_per_s=1e15,
                local_load_bytes_per_s=1e15, decode_max_context_tokens=None, dram_bytes_per_node=10**9,
                dram_usable_fraction=1.0)
    args.update(kw)
    return Hardware(**args)


def req(i: int, t_s: float, n_in: int, n_out: int, ids: list[int] | None = None) -> TraceRequest:
    """A trace request; by default its blocks are unique (ids 1000·i + k)."""
    if ids is None:
        ids = [1000 * (i + 1) + k for k in range(-(-n_in // 512))]
    return TraceRequest(i, t_s * 1000.0, n_in, n_out, tuple(ids))
